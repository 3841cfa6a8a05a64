"""Numba helpers inlined into generated CPU kernels (imported only when one is compiled)."""

from __future__ import annotations

import numba
import numpy as np

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_SM1 = np.uint64(0xBF58476D1CE4E5B9)
_SM2 = np.uint64(0x94D049BB133111EB)
_ONE = np.uint64(1)
_S8, _S27, _S30, _S31, _S40 = (np.uint64(v) for v in (8, 27, 30, 31, 40))
_LOW24 = np.uint64(0xFFFFFF)
_SCALE = np.float32(2.0**-24)


@numba.njit(inline="always", nogil=True, cache=True)
def u24f(i, key):  # pragma: no cover - compiled
    """Return draw i of the stream keyed ``key``, a float32 multiple of 2**-24 in [0, 1).

    SplitMix64 of the pair counter j = i // 2; element 2j takes the top 24 bits, element
    2j + 1 bits 8..31 (hipress.codecs._kernels_quant's stream).
    """
    iu = np.uint64(i)
    z = key + ((iu >> _ONE) + _ONE) * _GOLDEN
    z = (z ^ (z >> _S30)) * _SM1
    z = (z ^ (z >> _S27)) * _SM2
    z = z ^ (z >> _S31)
    u = (z >> _S40) if (iu & _ONE) == 0 else ((z >> _S8) & _LOW24)
    return np.float32(u) * _SCALE


@numba.njit(inline="always", nogil=True, cache=True)
def smix(key, j):  # pragma: no cover - compiled
    """Return SplitMix64 output j of the stream keyed ``key`` (the draws of elements 2j, 2j+1)."""
    z = key + (np.uint64(j) + _ONE) * _GOLDEN
    z = (z ^ (z >> _S30)) * _SM1
    z = (z ^ (z >> _S27)) * _SM2
    return z ^ (z >> _S31)


@numba.njit(inline="always", nogil=True, cache=True)
def u24pair(z, i):  # pragma: no cover - compiled
    """Return the draw of element i from its pair's SplitMix64 output ``z`` (float32)."""
    u = (z >> _S40) if (i & 1) == 0 else ((z >> _S8) & _LOW24)
    return np.float32(u) * _SCALE


@numba.njit(inline="always", nogil=True, cache=True)
def idiv(a, b):  # pragma: no cover - compiled
    """Integer division truncating toward zero (C)."""
    q = abs(a) // abs(b)
    return q if (a >= 0) == (b >= 0) else -q


@numba.njit(inline="always", nogil=True, cache=True)
def imod(a, b):  # pragma: no cover - compiled
    """Remainder with the sign of the dividend (C)."""
    return a - idiv(a, b) * b
