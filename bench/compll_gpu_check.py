"""Check every generated CompLL codec on a GPU against the NumPy references, and time it.

For each shipped spec (onebit, TBQ, TernGrad, DGC, GradDrop) this script

1. encodes CuPy arrays with the generated codec (its CUDA kernels, compiled through
   ``cupy.RawModule``) and compares the payload with the hand-written codec's NumPy
   reference on the same data: bit for bit, except onebit's two means, whose float64 sums
   are added in another order on the GPU (relative error <= 1e-6 allowed);
   DGC and GradDrop draw their threshold sample from CuPy's generator, so their sampled
   path is compared with the hand-written codec run on CuPy (same generator) and checked
   against the NumPy definition (values = x[idx], selection = {|x| >= smallest kept}),
   and their exact path (sample_ratio = 1) bit for bit with NumPy;
2. decodes the GPU payload on the GPU and compares with the NumPy decode, bit for bit;
3. prints GB/s of encode and decode (gradient bytes / time) next to a device-to-device
   copy of the same array.

Sizes 1 .. 100003 check the tails of the packed outputs; 16M and 256M elements are timed.
Exits 1 on any mismatch. Runs in about a minute on an H200.

    python bench/compll_gpu_check.py [--sizes 16777216,268435456] [--repeat 10]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

SPECS = ["onebit", "tbq", "terngrad", "dgc", "graddrop"]
PARAMS = {"tbq": {"threshold": 0.5}}
SMALL = [1, 7, 8, 9, 15, 16, 17, 33, 1000, 4097, 100003]
FAILURES = []


def fail(msg: str) -> None:
    FAILURES.append(msg)
    print(f"  MISMATCH: {msg}", flush=True)


def host(payload):
    from hipress.codecs.base import Payload

    return Payload(payload.codec_id, payload.dtype, payload.shape,
                   tuple(s.get() if hasattr(s, "get") else s for s in payload.sections))


def same(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def compare_sections(what, name, gen, ref):
    """Compare generated (host copy) and reference sections; return True when equal."""
    ok = len(gen) == len(ref)
    for i, (a, b) in enumerate(zip(gen, ref)):
        if name == "onebit" and i == 1:
            rel = np.abs(a.astype(np.float64) - b) / np.maximum(np.abs(b.astype(np.float64)),
                                                              1e-30)
            if not (a.dtype == b.dtype and a.shape == b.shape and rel.max() <= 1e-6):
                fail(f"{what}: {name} means {a} vs {b}")
                ok = False
        elif not same(a, b):
            diff = "sizes differ" if a.size != b.size else \
                f"{int(np.count_nonzero(a != b))} of {a.size} differ"
            fail(f"{what}: {name} section {i} ({a.dtype}[{a.size}]) vs reference "
                 f"({b.dtype}[{b.size}]): {diff}")
            ok = False
    return ok


def check_sparse_definition(what, x, gen):
    """DGC/GradDrop sampled path: values are x[idx], idx ascending, a magnitude threshold."""
    idx, vals = gen
    if not same(vals, x[idx]):
        fail(f"{what}: values are not x[idx]")
    if idx.size > 1 and not np.all(np.diff(idx) > 0):
        fail(f"{what}: indices not ascending")
    if idx.size:
        t = np.abs(vals).min()
        want = np.flatnonzero(np.abs(x) >= t)
        if want.size <= 2 * max(1, idx.size) and not same(idx.astype(np.int64), want):
            fail(f"{what}: selection is not {{|x| >= {t}}} ({idx.size} vs {want.size})")


def timeit(fn, repeat, cupy):
    fn()
    cupy.cuda.Device().synchronize()
    t0 = time.perf_counter()
    for _ in range(repeat):
        fn()
    cupy.cuda.Device().synchronize()
    return (time.perf_counter() - t0) / repeat


def time_size(cupy, n: int, repeat: int, rng) -> None:
    """Print encode/decode GB/s of every generated and hand-written codec at n elements."""
    from hipress.codecs import get_codec

    x = cupy.asarray(rng.standard_normal(n, dtype=np.float32))
    y = cupy.empty_like(x)
    t_copy = timeit(lambda: cupy.copyto(y, x), repeat, cupy)
    gb = x.nbytes / 1e9
    for name in SPECS:
        try:
            gen = get_codec(f"compll.{name}", **PARAMS.get(name, {}))
            ref = get_codec(name, **PARAMS.get(name, {}))
            p, pr = gen.encode(x, "grad"), ref.encode(x, "grad")
            te = timeit(lambda c=gen: c.encode(x, "grad"), repeat, cupy)
            td = timeit(lambda c=gen, q=p: c.decode(q), repeat, cupy)
            tre = timeit(lambda c=ref: c.encode(x, "grad"), max(2, repeat // 3), cupy)
            trd = timeit(lambda c=ref, q=pr: c.decode(q), max(2, repeat // 3), cupy)
            print(f"{name:10s} {n:11d} {gb / te:9.1f} {gb / td:9.1f} {gb / tre:9.1f} "
                  f"{gb / trd:9.1f} {gb / t_copy:9.1f}", flush=True)
        except Exception:
            fail(f"timing {name} n={n}: exception\n{traceback.format_exc()}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="16777216,268435456", help="timed sizes (elements)")
    ap.add_argument("--repeat", type=int, default=10)
    args = ap.parse_args()
    import cupy

    from hipress import compll
    from hipress.codecs import get_codec

    dev = cupy.cuda.runtime.getDeviceProperties(0)
    print(f"GPU: {dev['name'].decode()}  CuPy {cupy.__version__}  NumPy {np.__version__}")
    compll.register_builtin_specs()
    rng = np.random.default_rng(0)

    # ------------------------------------------------------------ correctness
    print("\n== correctness: generated (CuPy) vs hand-written NumPy reference ==", flush=True)
    for name in SPECS:
        params = PARAMS.get(name, {})
        variants = [params] if name not in ("dgc", "graddrop") else [
            dict(params, sample_ratio=1.0), params]
        for prm in variants:
            t0 = time.perf_counter()
            nok = 0
            for n in SMALL + [1 << 20]:
                x = rng.standard_normal(n).astype(np.float32)
                xg = cupy.asarray(x)
                what = f"{name}{prm or ''} n={n}"
                try:
                    gen = get_codec(f"compll.{name}", **prm)
                    ref = get_codec(name, **prm)
                    pg = gen.encode(xg, "grad")
                    secs = [s.get() for s in pg.sections]
                    sampled = name in ("dgc", "graddrop") and prm.get("sample_ratio") != 1.0 \
                        and n > 4096
                    if sampled:
                        ref_gpu = get_codec(name, **prm)
                        pr = ref_gpu.encode(xg, "grad")
                        ok = compare_sections(what + " (vs hand-written on CuPy)", name, secs,
                                              [s.get() for s in pr.sections])
                        check_sparse_definition(what, x, secs)
                    else:
                        pr = ref.encode(x, "grad")
                        ok = compare_sections(what, name, secs, list(pr.sections))
                    yg = gen.decode(pg).get()
                    yr = gen.decode(host(pg))
                    if not same(yg, yr):
                        fail(f"{what}: GPU decode differs from the NumPy decode of the same "
                             "payload")
                        ok = False
                    nok += ok
                except Exception:  # report and go on with the others
                    fail(f"{what}: exception\n{traceback.format_exc()}")
            print(f"{name:9s} {str(prm):40s} {nok}/{len(SMALL) + 1} sizes OK "
                  f"({time.perf_counter() - t0:.1f} s)", flush=True)

    # ------------------------------------------------------------------ speed
    print("\n== GB/s (gradient bytes / time), float32, same run ==", flush=True)
    print(f"{'codec':10s} {'n':>11s} {'encode':>9s} {'decode':>9s} {'ref enc':>9s} "
          f"{'ref dec':>9s} {'d2d copy':>9s}")
    for n in [int(v) for v in args.sizes.split(",")]:
        time_size(cupy, n, args.repeat, rng)
        cupy.get_default_memory_pool().free_all_blocks()
    print("\n(d2d copy: input bytes / time of cupy.copyto; it reads and writes, so its memory "
          "traffic is twice that)")
    if FAILURES:
        print(f"\n{len(FAILURES)} MISMATCH(ES)")
        return 1
    print("\nall generated kernels match the references")
    return 0


if __name__ == "__main__":
    sys.exit(main())
