"""GPU check of the engine: CuPy gradients through hipress.allreduce, against the NumPy path.

Run on a machine with a CUDA GPU and CuPy (the repository need not be installed):

    python bench/gpu_engine_check.py              # world size 1
    mpirun -np 2 python bench/gpu_engine_check.py # if an MPI launcher is there

For every codec and strategy it synchronizes the same gradient once as a CuPy array and
once as a NumPy array, and checks that the CuPy result stays on the GPU with the input's
shape and dtype and equals the NumPy result (bit for bit for deterministic codecs, in
distribution for stochastic ones, whose GPU random streams may differ). Prints PASS/FAIL
per case and exits non-zero on any FAIL.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

try:
    import cupy as cp
except ImportError:  # pragma: no cover - GPU machines only
    sys.exit("CuPy is not installed: this check needs a CUDA GPU with CuPy")

import hipress as hp  # noqa: E402
from hipress.codecs import get_codec  # noqa: E402

PARAMS = {"tbq": {"threshold": 0.5}, "topk": {"ratio": 0.01}, "dgc": {"ratio": 0.01},
          "randomk": {"ratio": 0.01}, "powersgd": {"rank": 2}}
CASES = [("none", None), ("fp16", None), ("bf16", None), ("onebit", "ps"), ("onebit", "ring"),
         ("tbq", "ps"), ("tbq", "ring"), ("terngrad", "ps"), ("terngrad", None),
         ("topk", None), ("dgc", None), ("graddrop", None), ("powersgd", None),
         ("randomk", None), ("signsgd", "ps"), ("qsgd", "ps")]


def main() -> int:
    hp.init({"compression": {"min_compress_bytes": 0}, "logging": {"level": "WARNING"}})
    rank, n = hp.rank(), hp.size()
    failures = 0
    rng = np.random.default_rng(3 + rank)
    g_host = rng.standard_normal((512, 257)).astype(np.float32)
    g_dev = cp.asarray(g_host)
    for codec, strategy in CASES:
        params = PARAMS.get(codec, {})
        t0 = time.perf_counter()
        try:
            out_dev = hp.allreduce(g_dev, f"gpu/{codec}/{strategy}",
                                   codec=get_codec(codec, **params), strategy=strategy)
            cp.cuda.Device().synchronize()
            dt = time.perf_counter() - t0
            out_host = hp.allreduce(g_host, f"cpu/{codec}/{strategy}",
                                    codec=get_codec(codec, **params), strategy=strategy)
            assert isinstance(out_dev, cp.ndarray), type(out_dev)
            assert out_dev.shape == g_host.shape and out_dev.dtype == g_host.dtype
            got = cp.asnumpy(out_dev)
            stochastic = get_codec(codec, **params).stochastic or codec in ("dgc", "graddrop")
            if stochastic:
                ok = abs(float(got.mean()) - float(out_host.mean())) < 0.05 and np.isfinite(
                    got).all()
                how = "distribution"
            else:
                ok = np.allclose(got, out_host, rtol=1e-5, atol=1e-6)
                how = "exact" if np.array_equal(got, out_host) else "allclose"
            status = "PASS" if ok else "FAIL"
            failures += not ok
            if rank == 0:
                print(f"{status} {codec:9s} {str(strategy):5s} {how:12s} "
                      f"{hp.stats()[f'gpu/{codec}/{strategy}']['strategy']:9s} {dt * 1e3:8.1f} ms",
                      flush=True)
        except Exception as exc:  # noqa: BLE001 - report every case
            failures += 1
            print(f"FAIL {codec:9s} {str(strategy):5s} {type(exc).__name__}: {exc}", flush=True)
    hp.shutdown()
    if rank == 0:
        print(f"{len(CASES) - failures}/{len(CASES)} engine GPU cases passed (world size {n})")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
