"""``hipressrun --check``: report what this machine can run, like ``horovodrun --check-build``.

Nothing heavy is imported: frameworks are found with :func:`importlib.util.find_spec` and
their versions read from package metadata, so the check takes well under a second even
with PyTorch installed. GPUs are listed by ``nvidia-smi -L`` when it exists.
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
from typing import IO, List, Optional, Sequence, Tuple

try:
    from importlib import metadata as _metadata
except ImportError:  # pragma: no cover  (Python < 3.8)
    import importlib_metadata as _metadata  # type: ignore[no-redef]

__all__ = ["check_build", "package_version"]

# (label, import name, distribution names to read the version from)
_FRAMEWORKS: Sequence[Tuple[str, str, Sequence[str]]] = (
    ("PyTorch", "torch", ("torch",)),
    ("TensorFlow", "tensorflow", ("tensorflow", "tensorflow-cpu", "tensorflow-gpu")),
    ("MXNet", "mxnet", ("mxnet", "mxnet-cu112", "mxnet-cu110")),
)
_CUPY_DISTS = ("cupy", "cupy-cuda12x", "cupy-cuda11x", "cupy-cuda13x")


def package_version(module: str, dists: Sequence[str]) -> Optional[str]:
    """Return the installed version of a module ("" if unknown), or None if not installed."""
    try:
        if importlib.util.find_spec(module) is None:
            return None
    except (ImportError, ValueError):
        return None
    for dist in dists:
        try:
            return _metadata.version(dist)
        except _metadata.PackageNotFoundError:
            continue
    return ""


def _gpus(timeout_s: float = 10.0) -> Tuple[List[str], str]:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return [], "nvidia-smi not found"
    try:
        res = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=timeout_s,
                             check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return [], f"nvidia-smi failed: {exc}"
    gpus = [line.strip() for line in res.stdout.splitlines() if line.startswith("GPU")]
    return gpus, "" if gpus else (res.stderr.strip() or "nvidia-smi lists no GPU")


def _row(ok: bool, text: str) -> str:
    return f"    [{'X' if ok else ' '}] {text}"


def check_build(out: IO[str], mpirun: Optional[str] = None) -> int:
    """Write the availability report to ``out`` and return 0.

    Args:
        out: a text stream.
        mpirun: launcher to examine instead of the one :func:`find_mpirun` picks.

    Returns:
        0 (the report itself is the result, as with ``horovodrun --check-build``).
    """
    from hipress import __version__
    from hipress.launch.runner import MPIError, find_mpirun, mpi_version

    lines = [f"HiPress v{__version__}:", "", "Available frameworks:"]
    for label, module, dists in _FRAMEWORKS:
        ver = package_version(module, dists)
        lines.append(_row(ver is not None, f"{label} {ver or ''}".rstrip()))

    lines += ["", "Available MPI:"]
    path = find_mpirun(mpirun)
    if path is None:
        lines.append(_row(False, "mpirun (not found)"))
    else:
        try:
            flavour, ver = mpi_version(path)
            name = {"openmpi": "Open MPI", "mpich": "MPICH"}[flavour]
            lines.append(_row(True, f"{name} {ver} ({path})"))
        except MPIError as exc:
            lines.append(_row(False, f"{path}: {exc}"))
    ver = package_version("mpi4py", ("mpi4py",))
    lines.append(_row(ver is not None, f"mpi4py {ver or ''}".rstrip()))

    lines += ["", "Available GPU support:"]
    ver = package_version("cupy", _CUPY_DISTS)
    lines.append(_row(ver is not None, f"CuPy {ver or ''}".rstrip()))
    gpus, why = _gpus()
    if gpus:
        lines += [_row(True, g) for g in gpus]
    else:
        lines.append(_row(False, f"GPUs: none ({why})"))

    try:
        from hipress.codecs import codec_names

        lines += ["", "Codecs: " + ", ".join(codec_names())]
    except Exception as exc:  # noqa: BLE001  (a report, not a failure)
        lines += ["", f"Codecs: cannot list ({type(exc).__name__}: {exc})"]
    out.write("\n".join(lines) + "\n")
    return 0
