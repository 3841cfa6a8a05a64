"""GPU check of the engine: CuPy gradients through hipress.allreduce, against the NumPy path.

Run on a machine with a CUDA GPU and CuPy (the repository need not be installed):

    python bench/gpu_engine_check.py              # world size 1
    mpirun -np 2 python bench/gpu_engine_check.py # if an MPI launcher is there

For every codec and strategy it synchronizes the same gradient once as a CuPy array and
once as a NumPy array, and checks that the CuPy result stays on the GPU with the input's
shape and dtype and equals the NumPy result (bit for bit for deterministic codecs, in
distribution for stochastic ones, whose GPU random streams may differ). Prints PASS/FAIL
per case and exits non-zero on any FAIL. When torch sees the GPU, the PyTorch adapter runs
too: float32, float16 and bfloat16 CUDA tensors, exact and onebit, against the same
tensors on the CPU (bfloat16 CUDA gradients cross to CuPy as float32).
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
    torch_failures, torch_cases = torch_checks(g_host, rank)
    hp.shutdown()
    if rank == 0:
        print(f"{len(CASES) - failures}/{len(CASES)} engine GPU cases passed (world size {n})")
        if torch_cases:
            print(f"{torch_cases - torch_failures}/{torch_cases} torch CUDA cases passed")
    return 1 if failures or torch_failures else 0


def torch_checks(g_host: np.ndarray, rank: int):
    """The PyTorch adapter with CUDA tensors (float32, float16, bfloat16), if torch sees one.

    Each dtype's CUDA tensor is allreduced (exact, and onebit in place) and compared with
    the same tensor on the CPU: bit for bit for exact sums, within onebit's GPU-summed
    means (relative 1e-5) otherwise; the result stays on the GPU in the input's dtype.
    Returns (failures, cases); (0, 0) when torch or CUDA is missing (said so).
    """
    try:
        import torch

        import hipress.torch as hpt
    except ImportError as exc:
        print(f"NOTE: torch CUDA cases skipped: {exc}", flush=True)
        return 0, 0
    if not torch.cuda.is_available():
        print("NOTE: torch CUDA cases skipped: torch sees no CUDA device", flush=True)
        return 0, 0
    failures = cases = 0
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for codec in (None, "onebit"):
            cases += 1
            label = f"torch/{str(dtype).replace('torch.', '')}/{codec}"
            try:
                host = torch.from_numpy(g_host).to(dtype)
                dev = host.cuda()
                ref = hpt.allreduce_(host.clone(), name=label + "/cpu", compression=codec)
                out = hpt.allreduce_(dev, name=label + "/gpu", compression=codec)
                torch.cuda.synchronize()
                assert out.device.type == "cuda" and out.dtype == dtype, (out.device, out.dtype)
                got = out.cpu()
                if codec is None:
                    ok = torch.equal(got, ref)
                else:
                    ok = torch.allclose(got.float(), ref.float(), rtol=1e-5, atol=1e-6)
            except Exception as exc:  # noqa: BLE001 - report every case
                ok = False
                print(f"FAIL {label} {type(exc).__name__}: {exc}", flush=True)
            failures += not ok
            if rank == 0:
                print(f"{'PASS' if ok else 'FAIL'} {label}", flush=True)
    return failures, cases


if __name__ == "__main__":
    sys.exit(main())
