"""Helpers that generated CompLL modules call at run time (NumPy or CuPy arrays).

Kept small and free of the front end (no lark, no Numba at import), so importing a
generated module from the disk cache costs only this file. Numba and CuPy are imported
when the first CPU or GPU kernel is needed.
"""

from __future__ import annotations

import importlib
import math
import sys
import threading
from typing import Any, Dict, Tuple

import numpy as np

from hipress.backend import to_host
from hipress.codecs import _kernels_quant as kq
from hipress.codecs import ops
from hipress.errors import CodecError, PayloadError

#: Threads per CUDA block of every generated kernel.
BLOCK = 256
#: Most blocks a generated kernel launches (threads then stride over the rest).
MAX_GRID = 4096

_LOCK = threading.Lock()
_CPU: Dict[Tuple[str, str], Any] = {}
_GPU: Dict[str, Any] = {}


# ------------------------------------------------------------------------ scalars
def small(xp: Any, values: list, dtype: Any) -> Any:
    """Return a small 1-D array of ``values`` on ``xp``'s device."""
    arr = np.array(values, dtype=dtype)
    return arr if xp is np else xp.asarray(arr)


def item(arr: Any, i: Any, dtype: Any, bits: int = 0) -> Any:
    """Return element ``i`` of a host or device array as a NumPy scalar of ``dtype``.

    For packed codes (``bits`` < 8) the element is code ``i`` of the packed bytes.

    Raises:
        CodecError: ``i`` is outside the array.
    """
    i = int(i)
    size = arr.size * 8 // bits if bits else arr.size
    if not 0 <= i < size:
        raise CodecError(f"index {i} is outside an array of {size} elements (spec bug)")
    if bits:
        byte = int(to_host(arr[(i * bits) // 8 : (i * bits) // 8 + 1])[0])
        return int((byte >> (8 - bits - (i * bits) % 8)) & ((1 << bits) - 1))
    v = to_host(arr[i : i + 1])[0]
    return np.dtype(dtype).type(v) if np.dtype(dtype).kind == "f" else (
        bool(v) if np.dtype(dtype) == np.bool_ else int(v))


def trunc(x: Any) -> int:
    """Convert a float to an integer toward zero, as C does.

    Raises:
        CodecError: ``x`` is NaN or infinite (no integer holds it).
    """
    f = float(x)
    if not math.isfinite(f):
        raise CodecError(f"cannot convert {f} to an integer in a CompLL spec")
    return int(f)


def idiv(a: int, b: int) -> int:
    """Integer division truncating toward zero (C semantics).

    Raises:
        CodecError: ``b`` is 0.
    """
    if b == 0:
        raise CodecError("integer division by zero in a CompLL spec")
    q = abs(a) // abs(b)
    return q if (a >= 0) == (b >= 0) else -q


def imod(a: int, b: int) -> int:
    """Remainder with the sign of ``a`` (C semantics)."""
    return a - idiv(a, b) * b


def smin(a: Any, b: Any) -> Any:
    """``min`` as the kernels compute it: ``b if b < a else a``."""
    return b if b < a else a


def smax(a: Any, b: Any) -> Any:
    """``max`` as the kernels compute it: ``b if b > a else a``."""
    return b if b > a else a


def check_finite(value: Any, name: str, what: str) -> None:
    """Refuse a non-finite scale or threshold (``check_finite`` in a spec)."""
    ops.check_finite(value, name, what)


# ------------------------------------------------------------------------- arrays
def kth(xp: Any, a: Any, k: Any, dtype: Any) -> Any:
    """Return the k-th largest element of ``a`` (k = 1 is the maximum), as a host scalar.

    Uses ``partition`` at ``m - k`` (m = a.size), the selection of
    :func:`hipress.codecs.ops.sampled_threshold`.

    Raises:
        CodecError: k is not in [1, m].
    """
    m, k = int(a.size), int(k)
    if not 1 <= k <= m:
        raise CodecError(f"kth: k = {k} is outside [1, {m}] (the array has {m} elements)")
    v = to_host(xp.partition(a, m - k)[m - k : m - k + 1])[0]
    return np.dtype(dtype).type(v) if np.dtype(dtype).kind == "f" else int(v)


def topk(xp: Any, a: Any, k: Any) -> Any:
    """Return the ascending int32 positions of the k largest elements of ``a``.

    ``sort(argpartition(a, m - k)[m - k:])`` as :func:`hipress.codecs.topk.topk_indices`
    does (all positions when k >= m, none when k <= 0).
    """
    m, k = int(a.size), int(k)
    if k >= m:
        return xp.arange(m, dtype=np.int32)
    if k <= 0:
        return xp.zeros(0, dtype=np.int32)
    return xp.sort(xp.argpartition(a, m - k)[m - k :]).astype(np.int32)


def randint(xp: Any, rng: Any, lo: Any, hi: Any, m: Any) -> Any:
    """Return ``m`` int64 draws in [lo, hi) from the encode's shared generator."""
    return rng.integers(int(lo), int(hi), size=int(m))


def check_indices(idx: Any, m: Any) -> None:
    """Raise PayloadError if an index read from a payload is outside [0, m)."""
    if idx.size and (int(idx.min()) < 0 or int(idx.max()) >= int(m)):
        raise PayloadError(f"payload holds an index outside [0, {int(m)}): corrupted")


def scatter(xp: Any, idx: Any, vals: Any, m: Any, dtype: Any) -> Any:
    """Return zeros(m) with ``vals`` written at ``idx`` (indices checked).

    Raises:
        PayloadError: the counts differ or an index is outside [0, m).
    """
    if idx.size != vals.size:
        raise PayloadError(f"payload holds {idx.size} indices but {vals.size} values: corrupted")
    check_indices(idx, m)
    out = xp.zeros(int(m), dtype=dtype)
    out[idx] = vals
    return out


def check_section_length(arr: Any, length: Any, bits: int, i: int) -> None:
    """Raise PayloadError unless section ``i`` holds ``length`` elements (or codes)."""
    want = (int(length) * bits + 7) // 8 if bits else int(length)
    if arr.size != want:
        raise PayloadError(f"payload section {i} holds {arr.size} elements, expect {want}: "
                           "corrupted")


# ------------------------------------------------------------------------ kernels
def cpu_kernel(module_name: str, kernel: str) -> Any:
    """Return the Numba-compiled kernel ``kernel`` of a generated module (compiled once).

    The module's helper functions are compiled first (inlined into kernels); kernels are
    cached on disk by Numba (``cache=True``) next to the generated module.
    """
    key = (module_name, kernel)
    fn = _CPU.get(key)
    if fn is not None:
        return fn
    with _LOCK:
        fn = _CPU.get(key)
        if fn is None:
            import numba

            from hipress.compll import cpuhelp

            mod = sys.modules[module_name]
            ns = vars(mod)
            ns.update(_u24f=cpuhelp.u24f, _smix=cpuhelp.smix, _u24pair=cpuhelp.u24pair,
                      _idiv=cpuhelp.idiv, _imod=cpuhelp.imod)
            fn = numba.njit(cache=True, nogil=True, boundscheck=False)(ns[kernel])
            _CPU[key] = fn
    return fn


def cuda_module(module_name: str, source: str) -> Any:
    """Return the ``cupy.RawModule`` of a generated module's CUDA source (compiled once)."""
    mod = _GPU.get(module_name)
    if mod is None:
        with _LOCK:
            mod = _GPU.get(module_name)
            if mod is None:
                cupy = importlib.import_module("cupy")
                mod = cupy.RawModule(code=source, options=("--fmad=false",))
                _GPU[module_name] = mod
    return mod


def grid(ngroups: int) -> int:
    """Return the number of blocks for ``ngroups`` work items (threads stride beyond)."""
    return int(max(1, min(MAX_GRID, -(-int(ngroups) // BLOCK))))


def finish(part: Any, op: str, kind: Any) -> Any:
    """Combine a GPU kernel's per-block partials into a host scalar."""
    if op == "+":
        v = part.sum()
    elif op == "max":
        v = part.max()
    else:
        v = part.min()
    v = to_host(v.reshape(1))[0]
    return int(v) if kind is int else kind(v)


# ------------------------------------------------------------------ random streams
#: The key of one encode's counter-based stream (``random``): the codecs' own contract,
#: ``kq.stream_key(seed, name, step, rank)`` drawn on the host from ``ops.rng_for``, so
#: generated codecs, TernGrad/QSGD, CPU and GPU all draw the same numbers.
stream_key = kq.stream_key


def uniform(xp: Any, n: int, key: int) -> Any:
    """Return draws 0..n-1 of the stream keyed ``key`` (the reference of ``random(n)``).

    Pair j = i // 2 gets z = SplitMix64(key, j); element 2j is ``z >> 40``, element 2j + 1
    ``(z >> 8) & 0xFFFFFF`` (:func:`hipress.codecs._kernels_quant.uniform_u24`), each
    times 2**-24 (float32, exact).
    """
    return kq.uniform_u24(xp, int(n), key).astype(np.float32) * np.float32(2.0**-24)


class EncodeContext:
    """What one encode of one gradient may draw: keys and generator, from one step.

    The step of ``name`` is taken (and advanced) when the context is made, so each encode
    of a stochastic codec moves its stream forward exactly once, whether or not the spec
    draws on this path.
    """

    def __init__(self, name: str, seed: int = 0, step: int = 0, rank: int = 0) -> None:
        self.name = name
        self.seed = seed
        self.step = step
        self.rank = rank
        self._key: Any = None
        self._rng: Any = None

    def key(self) -> int:
        """Return the 64-bit key of ``random`` (per rank: independent noise)."""
        if self._key is None:
            self._key = stream_key(self.seed, self.name, self.step, self.rank)
        return self._key

    def rng(self, xp: Any) -> Any:
        """Return the generator of ``randint`` (rank 0: the same sample on every rank)."""
        if self._rng is None:
            self._rng = ops.rng_for(xp, self.seed, self.name, self.step)
        return self._rng
