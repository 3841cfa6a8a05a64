"""Benchmark: CompLL-generated CPU kernels vs the hand-written codecs, GB/s, same run.

For each shipped spec (onebit, TBQ, TernGrad, DGC, GradDrop) this times, on one float32
gradient of ``--numel`` elements (16M by default), in the same process:

- ``gen``: the generated codec ``compll.<name>`` (Numba kernels from the spec);
- ``hand``: the hand-written codec as shipped (its own Numba fast paths where it has them);
- ``numpy``: the hand-written codec's NumPy reference (``use_fast_path = False``), for
  codecs that have a fast path (the sparse codecs are NumPy throughout);

encode and decode, as gradient bytes / median time (``--repeat`` runs after one warm-up
that also compiles), next to a plain memory copy of the gradient. Prints a table; it
asserts nothing (tests/test_compll.py checks the results are identical).

    python bench/compll_cpu.py [--numel 16777216] [--repeat 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

SPECS = ["onebit", "tbq", "terngrad", "dgc", "graddrop"]
PARAMS = {"tbq": {"threshold": 2.0}}


def median_time(fn, repeat: int) -> float:
    fn()  # warm-up (and JIT compilation)
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def rates(codec, x, repeat):
    payload = codec.encode(x, "bench")
    gb = x.nbytes / 1e9
    te = median_time(lambda: codec.encode(x, "bench"), repeat)
    td = median_time(lambda: codec.decode(payload), repeat)
    return gb / te, gb / td, payload.nbytes


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--numel", type=int, default=1 << 24)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()

    from hipress import compll
    from hipress.codecs import get_codec

    compll.register_builtin_specs()
    x = np.random.default_rng(0).standard_normal(args.numel).astype(np.float32)
    y = np.empty_like(x)
    copy = x.nbytes / 1e9 / median_time(lambda: np.copyto(y, x), args.repeat)
    print(f"float32 gradient of {args.numel} elements ({x.nbytes / 2**20:.0f} MiB); "
          f"memory copy {copy:.1f} GB/s; median of {args.repeat}")
    print(f"{'codec':10s} {'variant':7s} {'encode GB/s':>12s} {'decode GB/s':>12s} "
          f"{'payload B':>11s}")
    for name in SPECS:
        params = PARAMS.get(name, {})
        rows = [("gen", get_codec(f"compll.{name}", **params)),
                ("hand", get_codec(name, **params))]
        if hasattr(rows[1][1], "use_fast_path"):
            ref = get_codec(name, **params)
            ref.use_fast_path = False
            rows.append(("numpy", ref))
        for variant, codec in rows:
            enc, dec, nbytes = rates(codec, x, args.repeat)
            print(f"{name:10s} {variant:7s} {enc:12.2f} {dec:12.2f} {nbytes:11d}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
