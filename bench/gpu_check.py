"""One-shot GPU check of every codec: CuPy against the NumPy reference, then throughput.

Run on a CUDA machine from the repository root (the tree need not be installed)::

    python bench/gpu_check.py                 # checks + GB/s table, exit 1 on any FAIL
    python bench/gpu_check.py --cpu-dry-run   # same logic with NumPy standing in for CuPy

What it checks, per codec (default parameters; ``tbq`` gets a threshold):

1. Shapes (1000,), (1025, 1023) and (2048, 2048) in float32, and (1025, 1023) in float16
   and float64 (bfloat16 too when CuPy accepts it): encode and decode on CuPy keep shape,
   dtype and device.
2. Wire compatibility, exact: the GPU payload's bytes decoded by the NumPy codec equal
   the GPU decode, and the NumPy payload decoded on the GPU equals the NumPy decode.
3. Against the reference: deterministic codecs must decode bit-identically to NumPy
   (PowerSGD within a relative tolerance: its matrix products round differently on the
   GPU). Stochastic codecs pass exactly if their random streams agree across devices;
   otherwise their error ``||decode(x) - x|| / ||x||`` must match the NumPy one within
   10% (for >= 10**5 elements), fixed-size payloads must have the same size (variable-size
   ones within a factor of 4, as sampled thresholds vary), and the
   unbiased ones (TernGrad, QSGD) must average out: over K encodes
   ``||mean - x|| <= 2 ||decode(x) - x|| / sqrt(K)``.
4. Summable codecs: ``reduce_stages`` driven as one rank gives the NumPy result (same
   rules as 3).

Then it prints the throughput table of ``bench/codecs.py`` (1M, 16M, 64M float32 on the
device, next to a device-to-device copy), skipping sizes once ``--budget-s`` is spent,
and a ``RATE PASS|MISS`` line per codec of :data:`RATE_CODECS` against 60% of the copy.

On CuPy arrays the built-in names onebit, TBQ, TernGrad, DGC and GradDrop run their
CompLL kernels (``Codec.device_kernels``), so steps 2-4 check those against the NumPy
hand-written code.

Missing imports are reported by name. ``ml_dtypes`` is required by the core
(``hipress/backend.py``); ``--fallback-path DIR`` is appended to ``sys.path`` and retried
when it is missing. When ``import hipress`` fails on an engine dependency (pydantic,
PyYAML, mpi4py), the codecs are loaded without the package's ``__init__``.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import math
import sys
import time
import traceback
import types
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

#: Constructor parameters for the checks (inputs are N(0, 1)).
PARAMS: Dict[str, Dict[str, Any]] = {"tbq": {"threshold": 0.5}}
#: Deterministic codecs whose GPU result may differ by rounding: max relative L2 difference.
APPROX: Dict[str, float] = {"powersgd": 1e-4}
#: Stochastic codecs that are unbiased estimators of their input.
UNBIASED = {"terngrad", "qsgd"}
UNBIASED_DRAWS = 32


def log(msg: str) -> None:
    print(msg, flush=True)


# ------------------------------------------------------------------------- imports
def probe_imports(fallback: List[str]) -> Dict[str, str]:
    """Import the modules the check may use; return {module: version or 'MISSING: why'}."""
    found: Dict[str, str] = {}
    for mod in ("numpy", "ml_dtypes", "cupy", "numba", "pydantic", "yaml", "mpi4py", "rich"):
        try:
            m = importlib.import_module(mod)
            found[mod] = str(getattr(m, "__version__", "?"))
        except Exception as exc:  # ImportError, or a broken binary
            found[mod] = f"MISSING ({type(exc).__name__}: {exc})"
            if mod == "ml_dtypes" and fallback:
                sys.path.extend(fallback)
                try:
                    m = importlib.import_module(mod)
                    found[mod] = f"{getattr(m, '__version__', '?')} (from --fallback-path)"
                except Exception as exc2:
                    found[mod] += f"; fallback failed too ({type(exc2).__name__}: {exc2})"
    return found


def import_codecs() -> Any:
    """Return ``hipress.codecs``, bypassing ``hipress/__init__`` if its engine deps miss."""
    try:
        import hipress.codecs as codecs

        return codecs
    except Exception as exc:  # ImportError, or an MPI library that fails to load
        if "ml_dtypes" in str(exc):
            raise
        log(f"NOTE: 'import hipress' failed ({exc}); loading hipress.codecs without the "
            "package __init__ (engine/config dependencies are not needed for codecs)")
    for key in [k for k in sys.modules if k == "hipress" or k.startswith("hipress.")]:
        del sys.modules[key]
    pkg = types.ModuleType("hipress")
    pkg.__path__ = [str(ROOT / "hipress")]  # type: ignore[attr-defined]
    sys.modules["hipress"] = pkg
    return importlib.import_module("hipress.codecs")


def load_bench() -> Any:
    """Load bench/codecs.py as a module (its file name shadows the stdlib's ``codecs``)."""
    spec = importlib.util.spec_from_file_location("hipress_bench_codecs",
                                                  ROOT / "bench" / "codecs.py")
    mod = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(mod)
    return mod


# ------------------------------------------------------------------------- checking
class Failure(Exception):
    """A check did not hold."""


class Device:
    """The array module under test (CuPy, or NumPy in dry-run mode)."""

    def __init__(self, dry_run: bool) -> None:
        import numpy as np

        self.np = np
        self.dry_run = dry_run
        if dry_run:
            self.xp = np
            self.name = "NumPy (dry run)"
        else:
            import cupy

            self.xp = cupy
            props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
            name = props["name"]
            self.name = name.decode() if isinstance(name, bytes) else str(name)

    def put(self, host: Any) -> Any:
        """Return a device copy of the host array."""
        return host.copy() if self.dry_run else self.xp.asarray(host)

    def get(self, arr: Any) -> Any:
        """Return a host (NumPy) copy of a device array."""
        return self.np.asarray(arr) if self.dry_run else self.xp.asnumpy(arr)

    def is_device(self, arr: Any) -> bool:
        """Return True if ``arr`` lives on the device under test."""
        return isinstance(arr, self.xp.ndarray)

    def sync(self) -> None:
        """Wait for queued device work."""
        if not self.dry_run:
            self.xp.cuda.Device().synchronize()


def same_bits(a: Any, b: Any) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def diff_text(a: Any, b: Any) -> str:
    np = sys.modules["numpy"]
    a64, b64 = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
    bad = a64 != b64
    both_nan = np.isnan(a64) & np.isnan(b64)
    bad &= ~both_nan
    if not bad.any():
        return "same values, different bits (signed zeros or NaN payloads)"
    i = int(np.flatnonzero(bad)[0])
    return (f"{int(bad.sum())}/{a64.size} elements differ, max |diff| "
            f"{float(np.nanmax(np.abs(a64 - b64))):.3g}, first at {i}: {a64[i]!r} vs {b64[i]!r}")


def rel_err(y: Any, x: Any) -> float:
    np = sys.modules["numpy"]
    x64 = x.astype(np.float64)
    return float(np.linalg.norm(y.astype(np.float64) - x64) / max(np.linalg.norm(x64), 1e-300))


def drive_single_rank(gen: Any, copy: Callable[[Any], Any]) -> Tuple[Any, Any]:
    arr, _op = next(gen)
    while True:
        try:
            arr, _op = gen.send(copy(arr))
        except StopIteration as stop:
            return stop.value


def check_case(codecs: Any, dev: Device, name: str, shape: Tuple[int, ...], dtype: Any,
               notes: List[str]) -> None:
    """Run checks 1-4 for one codec, shape and dtype; raise Failure on the first miss."""
    np = dev.np
    from hipress.codecs.base import Payload

    params = PARAMS.get(name, {})
    label = f"{shape} {np.dtype(dtype)}"
    host = np.random.default_rng(sum(shape) * 10 + len(shape)).standard_normal(shape)
    host = host.astype(np.float32).astype(dtype)
    x = dev.put(host)
    ref, gpu = codecs.get_codec(name, **params), codecs.get_codec(name, **params)
    p_ref = ref.encode(host, "chk")
    p_dev = gpu.encode(x, "chk")
    y_ref = ref.decode(p_ref)
    y_dev = gpu.decode(p_dev)
    dev.sync()
    # 1. shape, dtype, device
    if not dev.is_device(y_dev):
        raise Failure(f"{label}: decode returned {type(y_dev).__name__}, not a device array")
    if tuple(y_dev.shape) != shape or np.dtype(y_dev.dtype) != np.dtype(dtype):
        raise Failure(f"{label}: decode gave {y_dev.shape} {y_dev.dtype}")
    y_dev_h = dev.get(y_dev)
    # 2. wire compatibility both ways, exact
    wire_dev = p_dev.to_bytes()
    y_cross = codecs.get_codec(name, **params).decode(Payload.from_bytes(wire_dev))
    if not same_bits(y_cross, y_dev_h):
        raise Failure(f"{label}: GPU payload decoded by NumPy differs from the GPU decode: "
                      + diff_text(y_cross, y_dev_h))
    p_back = Payload.from_bytes(p_ref.to_bytes(), xp=dev.xp)
    y_back = dev.get(codecs.get_codec(name, **params).decode(p_back))
    if not same_bits(y_back, y_ref):
        raise Failure(f"{label}: NumPy payload decoded on the GPU differs from NumPy's decode: "
                      + diff_text(y_back, y_ref))
    # 3. against the reference
    cls = codecs.codec_class(name)
    if same_bits(y_dev_h, y_ref):
        if wire_dev != p_ref.to_bytes():
            notes.append(f"{label}: same decode, different payload bytes")
    elif name in APPROX:
        err = rel_err(y_dev_h, y_ref)
        if err > APPROX[name]:
            raise Failure(f"{label}: relative difference to NumPy {err:.3g} > {APPROX[name]}")
        notes.append(f"{label}: within {err:.2g} of NumPy (tolerance {APPROX[name]})")
    elif not cls.stochastic:
        raise Failure(f"{label}: deterministic codec decodes differently from NumPy: "
                      + diff_text(y_dev_h, y_ref))
    else:
        check_stochastic(codecs, dev, name, params, host, x, p_ref, p_dev, y_ref, y_dev_h,
                         label, notes)
    # 4. reduce_stages as one rank
    if cls.summable:
        r_ref, _ = drive_single_rank(codecs.get_codec(name, **params)
                                     .reduce_stages(host, "chk", 1, 1.0), lambda a: a.copy())
        r_dev, _ = drive_single_rank(codecs.get_codec(name, **params)
                                     .reduce_stages(x, "chk", 1, 1.0), lambda a: a.copy())
        r_dev_h = dev.get(r_dev)
        if tuple(r_dev_h.shape) != shape or r_dev_h.dtype != np.dtype(dtype):
            raise Failure(f"{label}: reduce_stages gave {r_dev_h.shape} {r_dev_h.dtype}")
        if not same_bits(r_dev_h, r_ref):
            if name in APPROX:
                err = rel_err(r_dev_h, r_ref)
                if err > APPROX[name]:
                    raise Failure(f"{label}: reduce_stages differs from NumPy by {err:.3g}")
            elif not cls.stochastic:
                raise Failure(f"{label}: reduce_stages differs from NumPy: "
                              + diff_text(r_dev_h, r_ref))


def check_stochastic(codecs: Any, dev: Device, name: str, params: Dict[str, Any], host: Any,
                     x: Any, p_ref: Any, p_dev: Any, y_ref: Any, y_dev_h: Any, label: str,
                     notes: List[str]) -> None:
    """Distribution checks for a stochastic codec whose streams differ across devices."""
    np = dev.np
    cls = codecs.codec_class(name)
    if not cls.variable_size and p_ref.nbytes != p_dev.nbytes:
        raise Failure(f"{label}: payload {p_dev.nbytes} B on the GPU, {p_ref.nbytes} B on NumPy")
    # sampled thresholds (DGC, GradDrop) vary with the sample: a 2x spread is normal
    if cls.variable_size and not (p_ref.nbytes / 4 - 64 <= p_dev.nbytes <= 4 * p_ref.nbytes + 64):
        raise Failure(f"{label}: payload {p_dev.nbytes} B on the GPU vs {p_ref.nbytes} B")
    e_ref, e_dev = rel_err(y_ref, host), rel_err(y_dev_h, host)
    if host.size >= 10**5 and abs(e_dev - e_ref) > 0.1 * e_ref + 1e-3:
        raise Failure(f"{label}: error {e_dev:.4g} on the GPU vs {e_ref:.4g} on NumPy")
    msg = f"{label}: streams differ; error {e_dev:.4g} (NumPy {e_ref:.4g})"
    if name in UNBIASED and host.size >= 10**5:
        codec = codecs.get_codec(name, **params)
        acc = dev.xp.zeros(x.shape, dtype=np.float64)
        for _ in range(UNBIASED_DRAWS):
            acc += codec.decode(codec.encode(x, "unbiased")).astype(np.float64)
        mean_err = rel_err(dev.get(acc / UNBIASED_DRAWS), host)
        bound = 2 * e_dev / math.sqrt(UNBIASED_DRAWS)
        if mean_err > bound:
            raise Failure(f"{label}: biased: mean of {UNBIASED_DRAWS} decodes is {mean_err:.3g} "
                          f"from x (expect <= {bound:.3g})")
        msg += f"; mean of {UNBIASED_DRAWS} within {mean_err:.3g} (bound {bound:.3g})"
    notes.append(msg)


def check_codec(codecs: Any, dev: Device, name: str, bf16_ok: bool) -> Tuple[bool, List[str]]:
    np = dev.np
    from hipress.backend import bfloat16

    cases: List[Tuple[Tuple[int, ...], Any]] = [
        ((1000,), np.float32), ((1025, 1023), np.float32), ((2048, 2048), np.float32),
        ((1025, 1023), np.float16), ((1025, 1023), np.float64),
    ]
    if bf16_ok:
        cases.append(((1025, 1023), bfloat16))
    notes: List[str] = []
    for shape, dtype in cases:
        try:
            check_case(codecs, dev, name, shape, dtype, notes)
        except Failure as exc:
            return False, notes + [str(exc)]
        except Exception as exc:
            tb = traceback.format_exc(limit=-3).strip().splitlines()
            return False, notes + [f"{shape} {np.dtype(dtype)}: {type(exc).__name__}: {exc}"] + [
                "    " + t for t in tb[-6:]]
    return True, notes


#: codecs whose encode and decode must reach RATE_TARGET of the device copy (issue: the GPU
#: path at GPU speed); the verdicts read the largest size measured (64M on a GPU)
RATE_CODECS = ("onebit", "tbq", "terngrad", "dgc", "graddrop", "fp16", "powersgd")
RATE_TARGET = 0.60


def rate_verdicts(rows: List[Dict[str, Any]], size_label: Callable[[int], str]) -> List[str]:
    """Return one ``RATE PASS|MISS`` line per codec of :data:`RATE_CODECS` measured.

    A MISS is reported, not counted as a failed check: some algorithms cannot reach a
    copy's rate (DGC and GradDrop sample and select; PowerSGD multiplies matrices), and
    the figure says by how much.
    """
    ok_rows = [r for r in rows if not r["error"]]
    if not ok_rows:
        return []
    top = max(r["size"] for r in ok_rows)
    out = [f"rate target: encode and decode >= {RATE_TARGET:.0%} of the copy at "
           f"{size_label(top)} float32"]
    for r in ok_rows:
        if r["size"] != top or r["codec"] not in RATE_CODECS:
            continue
        worst = min(r["enc_rel"], r["dec_rel"])
        verdict = "PASS" if worst >= RATE_TARGET else "MISS"
        out.append(f"RATE {verdict} {r['codec']:9s} encode {r['enc_gbs']:8.1f} GB/s "
                   f"({r['enc_rel']:.2f} of copy), decode {r['dec_gbs']:8.1f} GB/s "
                   f"({r['dec_rel']:.2f} of copy)")
    return out


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpu-dry-run", action="store_true",
                    help="use NumPy in place of CuPy (tests this script without a GPU)")
    ap.add_argument("--codecs", default="", help="comma-separated subset (default: all)")
    ap.add_argument("--bench-sizes", default="",
                    help="sizes for the GB/s table (default 1M,16M,64M; 1M in a dry run)")
    ap.add_argument("--repeat", type=int, default=5, help="timed runs per bench measurement")
    ap.add_argument("--budget-s", type=float, default=170.0,
                    help="skip remaining bench sizes after this many seconds (default 170)")
    ap.add_argument("--no-bench", action="store_true", help="checks only")
    ap.add_argument("--fallback-path", action="append", default=[],
                    help="directory appended to sys.path if ml_dtypes is missing")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()

    found = probe_imports(args.fallback_path)
    log(f"python {sys.version.split()[0]} at {sys.executable}")
    for mod, ver in found.items():
        log(f"  {mod:10s} {ver}")
    if found["numpy"].startswith("MISSING"):
        log("FATAL: numpy is missing")
        return 2
    if found["ml_dtypes"].startswith("MISSING"):
        log("FATAL: ml_dtypes is missing; hipress/backend.py imports it for bfloat16. Install it "
            "(pip install ml_dtypes) or pass --fallback-path to a directory holding it")
        return 2
    if not args.cpu_dry_run and found["cupy"].startswith("MISSING"):
        log("FATAL: cupy is missing; install cupy-cuda12x/13x, or use --cpu-dry-run")
        return 2
    if found["numba"].startswith("MISSING"):
        log("NOTE: numba is missing: CPU references run without their Numba fast paths")

    codecs = import_codecs()
    dev = Device(args.cpu_dry_run)
    log(f"device: {dev.name}")
    names = [c for c in args.codecs.split(",") if c] or codecs.codec_names()
    unknown = sorted(set(names) - set(codecs.codec_names()))
    if unknown:
        log(f"FATAL: unknown codecs {unknown}; registered: {codecs.codec_names()}")
        return 2
    log(f"codecs: {', '.join(names)}")

    import numpy as np

    from hipress.backend import bfloat16

    try:
        dev.put(np.zeros(4, dtype=bfloat16))
        bf16_ok = True
    except Exception as exc:
        bf16_ok = False
        log(f"NOTE: bfloat16 arrays skipped on this device ({type(exc).__name__}: {exc})")

    failed = []
    for name in names:
        t = time.perf_counter()
        ok, notes = check_codec(codecs, dev, name, bf16_ok)
        log(f"{'PASS' if ok else 'FAIL'} {name} ({time.perf_counter() - t:.1f} s)")
        for n in notes:
            log(f"     {n}")
        if not ok:
            failed.append(name)
    log(f"checks done in {time.perf_counter() - t0:.1f} s: "
        f"{len(names) - len(failed)} PASS, {len(failed)} FAIL {failed if failed else ''}")

    if not args.no_bench:
        bench = load_bench()
        backend = bench.Backend("cpu" if args.cpu_dry_run else "gpu")
        sizes = [bench.parse_size(s) for s in
                 (args.bench_sizes or ("1M" if args.cpu_dry_run else "1M,16M,64M")).split(",")]
        rows = []
        for n in sizes:
            spent = time.perf_counter() - t0
            if spent > args.budget_s:
                log(f"NOTE: bench of {bench.size_label(n)} skipped: {spent:.0f} s spent "
                    f"(--budget-s {args.budget_s:.0f})")
                continue
            rows += bench.run_bench([n], names, backend, args.repeat,
                                    {k: dict(v) for k, v in bench.DEFAULT_PARAMS.items()})
        title = (f"codec throughput on {dev.name}, float32, median of {args.repeat}, GB/s of "
                 "input; copy = device-to-device" if not args.cpu_dry_run else
                 f"codec throughput (dry run on the CPU), median of {args.repeat}")
        print(bench.format_table(rows, title), flush=True)
        errs = [f"{bench.size_label(r['size'])} {r['codec']}" for r in rows if r["error"]]
        if errs:
            log(f"bench errors: {errs}")
        for line in rate_verdicts(rows, bench.size_label):
            log(line)
    log(f"total {time.perf_counter() - t0:.1f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
