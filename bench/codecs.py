"""Encode/decode throughput of every registered codec, next to a plain memory copy.

Usage::

    python bench/codecs.py                                # 1M, 16M, 64M float32, CPU
    python bench/codecs.py --sizes 1M,16M --codecs onebit,topk --repeat 5
    python bench/codecs.py --device gpu                   # CuPy arrays, device-to-device copy

Throughput is GB/s (1e9 bytes) of the *input* gradient (n * 4 bytes for float32), for
encode and for decode alike, so the two read on the same scale as the copy. The copy is
measured in the same run on the same array (``numpy.copyto`` into a preallocated array on
the CPU, a device-to-device copy on the GPU); the ``enc/copy`` and ``dec/copy`` columns
are codec throughput divided by copy throughput (1.0 = as fast as touching the data once).

Data: standard normal float32 from ``numpy.random.default_rng(0)`` (the same values on
CPU and GPU). A size that is a multiple of 1024 is shaped ``(n / 1024, 1024)`` so that
PowerSGD sees a matrix (every other codec flattens its input); sizes take K/M/G suffixes
(powers of 2). Summable codecs are timed through encode/decode only (their
``reduce_stages`` needs a collective). Timings are the median of ``--repeat`` runs after
one warm-up call; on the GPU the device is synchronized before and after each run.

The machine's cores are shared: run it when the machine is quiet, and compare ratios to
the copy rather than absolute numbers between runs. PowerSGD's matrix products go through
BLAS: on an oversubscribed machine set ``OPENBLAS_NUM_THREADS=1`` (on the 2-core dev box
with other jobs running, its 1M encode went from 0.2 to 18 GB/s).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

#: Parameters for codecs that need some (inputs are N(0, 1)); override with --params.
DEFAULT_PARAMS: Dict[str, Dict[str, Any]] = {"tbq": {"threshold": 2.0}}


def parse_size(text: str) -> int:
    """Return the element count of ``text``: an int with an optional K/M/G suffix (2**10)."""
    t = text.strip().upper()
    mult = {"K": 2**10, "M": 2**20, "G": 2**30}.get(t[-1:], 1)
    if mult != 1:
        t = t[:-1]
    n = int(float(t) * mult)
    if n <= 0:
        raise argparse.ArgumentTypeError(f"size must be > 0 elements, got {text!r}")
    return n


def size_label(n: int) -> str:
    """Return ``n`` as e.g. ``16M`` when it is a round power-of-2 multiple, else digits."""
    for suffix, unit in (("G", 2**30), ("M", 2**20), ("K", 2**10)):
        if n % unit == 0:
            return f"{n // unit}{suffix}"
    return str(n)


def parse_params(items: Sequence[str]) -> Dict[str, Dict[str, Any]]:
    """Parse ``codec:key=value`` items (values read as int, float, bool or str)."""
    out: Dict[str, Dict[str, Any]] = {}
    for item in items:
        try:
            codec, kv = item.split(":", 1)
            key, raw = kv.split("=", 1)
        except ValueError:
            raise SystemExit(f"--params expects codec:key=value, got {item!r}") from None
        value: Any = raw
        for conv in (int, float):
            try:
                value = conv(raw)
                break
            except ValueError:
                continue
        if raw.lower() in ("true", "false"):
            value = raw.lower() == "true"
        out.setdefault(codec, {})[key] = value
    return out


class Backend:
    """Array module, synchronization and copy for one device."""

    def __init__(self, device: str) -> None:
        self.device = device
        if device == "gpu":
            import cupy

            self.xp = cupy
            self._sync: Callable[[], None] = lambda: cupy.cuda.Device().synchronize()
        else:
            self.xp = np
            self._sync = lambda: None

    def sync(self) -> None:
        """Wait for queued device work (no-op on the CPU)."""
        self._sync()

    def array(self, host: np.ndarray) -> Any:
        """Return ``host`` on this device."""
        return host if self.xp is np else self.xp.asarray(host)

    def copy_into(self, dst: Any, src: Any) -> None:
        """Copy ``src`` into ``dst`` (host memcpy, or device-to-device)."""
        self.xp.copyto(dst, src)


def timeit(fn: Callable[[], Any], backend: Backend, repeat: int, warmup: int = 1) -> float:
    """Return the median wall time in seconds of ``fn`` over ``repeat`` runs."""
    for _ in range(warmup):
        fn()
    backend.sync()
    times = []
    for _ in range(max(1, repeat)):
        backend.sync()
        t0 = time.perf_counter()
        fn()
        backend.sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def make_data(n: int, backend: Backend, dtype: Any = np.float32) -> Any:
    """Return n standard-normal values (seed 0), shaped (n/1024, 1024) when possible."""
    host = np.random.default_rng(0).standard_normal(n, dtype=np.float32).astype(dtype, copy=False)
    if n % 1024 == 0 and n >= 2048:
        host = host.reshape(n // 1024, 1024)
    return backend.array(host)


def run_bench(
    sizes: Sequence[int],
    codec_names: Sequence[str],
    backend: Backend,
    repeat: int = 3,
    params: Optional[Dict[str, Dict[str, Any]]] = None,
    log: Callable[[str], None] = lambda s: None,
) -> List[Dict[str, Any]]:
    """Measure copy, encode and decode throughput; return one row per (size, codec).

    Args:
        sizes: element counts.
        codec_names: registered codec names.
        backend: where the arrays live.
        repeat: timed runs per measurement (median kept).
        params: constructor parameters per codec (defaults from DEFAULT_PARAMS).
        log: progress callback.

    Returns:
        Rows with keys size, codec, ratio, enc_gbs, dec_gbs, enc_rel, dec_rel, error
        (codec ``"copy"`` is the baseline row of each size).
    """
    from hipress.codecs import get_codec

    params = {**DEFAULT_PARAMS, **(params or {})}
    rows: List[Dict[str, Any]] = []
    for n in sizes:
        x = make_data(n, backend)
        nbytes = n * 4
        dst = backend.xp.empty_like(x)
        t_copy = timeit(lambda x=x, dst=dst: backend.copy_into(dst, x), backend, repeat)
        copy_gbs = nbytes / t_copy / 1e9
        rows.append({"size": n, "codec": "copy", "ratio": 1.0, "enc_gbs": copy_gbs,
                     "dec_gbs": copy_gbs, "enc_rel": 1.0, "dec_rel": 1.0, "error": ""})
        log(f"{size_label(n)} copy {copy_gbs:.2f} GB/s")
        del dst
        for name in codec_names:
            row: Dict[str, Any] = {"size": n, "codec": name, "ratio": math.nan,
                                   "enc_gbs": math.nan, "dec_gbs": math.nan,
                                   "enc_rel": math.nan, "dec_rel": math.nan, "error": ""}
            try:
                codec = get_codec(name, **params.get(name, {}))
                payload = codec.encode(x, "bench")
                t_enc = timeit(lambda c=codec, x=x: c.encode(x, "bench"), backend, repeat, warmup=0)
                t_dec = timeit(lambda c=codec, p=payload: c.decode(p), backend, repeat)
                row.update(
                    ratio=nbytes / payload.nbytes,
                    enc_gbs=nbytes / t_enc / 1e9,
                    dec_gbs=nbytes / t_dec / 1e9,
                )
                row["enc_rel"] = row["enc_gbs"] / copy_gbs
                row["dec_rel"] = row["dec_gbs"] / copy_gbs
                del payload
            except Exception as exc:  # a bench reports every codec, even a broken one
                row["error"] = f"{type(exc).__name__}: {exc}"[:120]
            rows.append(row)
            log(f"{size_label(n)} {name} enc {row['enc_gbs']:.3g} dec {row['dec_gbs']:.3g} GB/s")
        del x
    return rows


def format_table(rows: Sequence[Dict[str, Any]], title: str = "") -> str:
    """Return the rows as a plain-text table."""
    head = ["size", "codec", "ratio", "enc GB/s", "dec GB/s", "enc/copy", "dec/copy"]

    def fmt(v: float, spec: str) -> str:
        return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)

    body = []
    for r in rows:
        body.append([
            size_label(r["size"]), r["codec"], fmt(r["ratio"], ".1f"), fmt(r["enc_gbs"], ".3f"),
            fmt(r["dec_gbs"], ".3f"), fmt(r["enc_rel"], ".3f"), fmt(r["dec_rel"], ".3f"),
        ] + ([f"ERROR {r['error']}"] if r["error"] else []))
    widths = [max(len(head[i]), *(len(b[i]) for b in body)) for i in range(len(head))]
    lines = [title] if title else []
    lines.append("  ".join(h.rjust(w) if i >= 2 else h.ljust(w)
                           for i, (h, w) in enumerate(zip(head, widths))))
    lines.append("  ".join("-" * w for w in widths))
    prev = None
    for b in body:
        if prev is not None and b[0] != prev:
            lines.append("")
        prev = b[0]
        cells = [c.rjust(w) if i >= 2 else c.ljust(w) for i, (c, w) in enumerate(zip(b, widths))]
        lines.append("  ".join(cells + b[len(head):]))
    return "\n".join(lines)


def print_table(rows: Sequence[Dict[str, Any]], title: str = "") -> None:
    """Print the table with ``rich`` if it is installed, else as plain text."""
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(format_table(rows, title))
        return
    table = Table(title=title or None)
    for h in ["size", "codec", "ratio", "enc GB/s", "dec GB/s", "enc/copy", "dec/copy", "error"]:
        table.add_column(h, justify="right" if h not in ("size", "codec", "error") else "left")
    for r in rows:
        cells = [f"{r[k]:.3f}" if not math.isnan(r[k]) else "-"
                 for k in ("enc_gbs", "dec_gbs", "enc_rel", "dec_rel")]
        ratio = f"{r['ratio']:.1f}" if not math.isnan(r["ratio"]) else "-"
        table.add_row(size_label(r["size"]), r["codec"], ratio, *cells, r["error"])
    Console().print(table)


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="1M,16M,64M",
                    help="comma-separated element counts, K/M/G = 2**10/20/30 "
                    "(default %(default)s)")
    ap.add_argument("--codecs", default="",
                    help="comma-separated codec names (default: every registered codec)")
    ap.add_argument("--repeat", type=int, default=3, help="timed runs, median kept (default 3)")
    ap.add_argument("--device", choices=("cpu", "gpu"), default="cpu")
    ap.add_argument("--params", action="append", default=[], metavar="CODEC:KEY=VALUE",
                    help="codec constructor parameter, repeatable (e.g. topk:ratio=0.001)")
    ap.add_argument("--plain", action="store_true", help="plain-text table even if rich exists")
    ap.add_argument("-v", "--verbose", action="store_true", help="progress on stderr")
    args = ap.parse_args(argv)

    from hipress.codecs import codec_names

    known = codec_names()
    names = [c for c in args.codecs.split(",") if c] or known
    unknown = sorted(set(names) - set(known))
    if unknown:
        ap.error(f"unknown codecs {unknown}; valid: {', '.join(known)}")
    sizes = [parse_size(s) for s in args.sizes.split(",") if s]
    backend = Backend(args.device)
    log = (lambda s: print(s, file=sys.stderr, flush=True)) if args.verbose else (lambda s: None)
    rows = run_bench(sizes, names, backend, args.repeat, parse_params(args.params), log)
    title = (f"codec throughput, float32, device={args.device}, median of {args.repeat}; "
             "GB/s of input")
    if args.plain:
        print(format_table(rows, title))
    else:
        print_table(rows, title)
    return 1 if any(r["error"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
