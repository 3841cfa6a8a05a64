"""QSGD: unbiased stochastic quantization of g / ||g||_2 to ``s`` levels.

Paper: D. Alistarh, D. Grubic, J. Li, R. Tomioka, M. Vojnovic, "QSGD: Communication-
Efficient SGD via Gradient Quantization and Encoding", NeurIPS 2017 (section 3.1). Each
element becomes ``||g||_2 * sign(g_i) * xi_i / s`` where ``xi_i`` is ``|g_i| / ||g||_2 * s``
rounded stochastically to one of its two neighbouring integers, so that
``E[xi_i] = |g_i| / ||g||_2 * s`` and the decode is unbiased.

Wire layout (sections in order)::

    0  float32  1             ||g||_2 (computed in float64, rounded up to float32)
    1  uint8    ceil(n / 8)   sign bits, 8 per byte, MSB first; 1 = negative
    2  uint8    n             level indices xi_i in [0, s]

The paper's Elias coding of the levels is not used: a fixed-size byte per level keeps the
payload size independent of the data (the engine can plan it) and ``s`` up to 255.

Random numbers: the counter-based stream of :mod:`hipress.codecs._kernels_quant` keyed by
``ops.rng_for(numpy, seed, name, step, rank)``, as for TernGrad (per-name step counters
in :meth:`state_dict`; ``rank`` set by the engine).

NaN/Inf policy: the norm is computed from the gradient; ``ops.check_finite`` on it raises
:class:`~hipress.errors.NonFiniteGradientError`.
"""

from __future__ import annotations

import math
from typing import Any, Dict, Sequence, Tuple

import numpy as np

from hipress.backend import array_module, compute_dtype
from hipress.codecs import _kernels_quant as kq
from hipress.codecs import ops
from hipress.codecs.base import Codec, Layout, register_codec
from hipress.codecs.onebit import decode_sign_bits
from hipress.codecs.state import SeededStreamMixin
from hipress.errors import CodecError


def l2_norm(flat: Any, use_fast_path: bool = True) -> float:
    """Return ||flat||_2: the float64 sum of squares in the fixed 16-lane order, square-rooted.

    The order is that of :func:`hipress.codecs._kernels_quant.lane_sums`, so the Numba
    kernel and the NumPy/CuPy reference give the same bits. A float64 gradient whose
    squares overflow (|g| > 1e154) is rescaled by max|g| first, so only real NaN/Inf make
    the norm non-finite.
    """
    xp = array_module(flat)
    fast, xin = kq.fast_input(flat) if use_fast_path else (None, flat)
    with np.errstate(over="ignore", invalid="ignore"):
        if fast is not None:
            lanes = fast.sumsq_lanes(xin)
        else:
            x64 = flat.astype(np.float64)
            lanes = kq.lane_sums(x64 * x64)
    norm = math.sqrt(kq.combine_lanes(lanes))
    if not math.isfinite(norm):
        m = float(xp.abs(flat.astype(np.float64)).max())
        if math.isfinite(m) and m > 0:
            y = flat.astype(np.float64) / m
            norm = m * math.sqrt(float(xp.dot(y, y)))
        else:
            norm = m if not math.isnan(m) else norm
    return norm


def levels_reference(flat: Any, mult: float, levels: int, key: int) -> Any:
    """Return QSGD's uint8 level indices with NumPy/CuPy (steps 2-4 of the codec).

    r = |g| * mult (mult = s / N), then floor(r) + [u * 2**-24 < r - floor(r)], clipped
    to ``levels``, all in float64.
    """
    xp = array_module(flat)
    r = xp.abs(flat.astype(np.float64)) * mult
    low = xp.floor(r)
    u = kq.uniform_u24(xp, flat.size, key).astype(np.float64) * (1.0 / kq.TWO24)
    up = u < (r - low)
    return xp.minimum(low + up, levels).astype(np.uint8)


@register_codec("qsgd", codec_id=13)
class QSGDCodec(SeededStreamMixin, Codec):
    """QSGD (Alistarh et al., NeurIPS 2017) with ``levels`` quantization levels.

    Algorithm (gradient g of n elements, s = ``levels``):
        1. N = ||g||_2 (float64 sum of squares in the fixed 16-lane order of
           :func:`hipress.codecs._kernels_quant.lane_sums`); ``ops.check_finite`` raises
           :class:`~hipress.errors.NonFiniteGradientError` on NaN/Inf. N is rounded up to
           float32 (so |g_i| / N <= 1).
        2. r_i = |g_i| * (s / N); l_i = floor(r_i); p_i = r_i - l_i (float64).
        3. Draw u_i (24-bit) from the stream keyed by (seed, name, step, rank); advance step.
        4. xi_i = l_i + [u_i * 2**-24 < p_i], clipped to [0, s], as uint8.
        5. Pack the sign bits (g_i < 0) 8 per byte.

    On NumPy input a Numba kernel does steps 2-4 in one pass with the same float64
    operations and random numbers as :func:`levels_reference` (bit-identical payloads);
    ``use_fast_path = False`` forces the reference, which also runs on CuPy.

    Decode: N / s * xi_i * (-1 if sign bit else +1), in float32 (float64 for float64
    gradients), cast to the gradient's dtype. ``E[decode] = g`` up to the 2**-24 resolution
    of the uniforms.

    Tuning: variance grows as min(n / s**2, sqrt(n) / s) (paper, Lemma 3.1); s = 127 keeps
    it small for layers up to millions of elements while the payload stays ~3.6x smaller
    than float32 (1 byte + 1 bit per element).

    Args:
        levels: s, an integer in [1, 255] (level indices travel as uint8).
        seed: integer in [0, 2**32) keying the random streams (same on every rank).

    Raises:
        CodecError: bad ``levels`` or ``seed``.
    """

    stochastic = True
    use_fast_path = True

    def __init__(self, levels: int = 127, seed: int = 0) -> None:
        if isinstance(levels, bool) or not isinstance(levels, (int, np.integer)):
            raise CodecError(f"qsgd levels must be an integer in [1, 255], got {levels!r}")
        if not 1 <= int(levels) <= 255:
            raise CodecError(
                f"qsgd levels must be in [1, 255] (indices travel as uint8), got {levels!r}"
            )
        self.levels = int(levels)
        self._init_stream(seed, "qsgd")

    def params(self) -> Dict[str, Any]:
        """Return the constructor parameters."""
        return {"levels": self.levels, "seed": self.seed}

    def _encode(self, flat: Any, shape: Tuple[int, ...], name: str) -> Sequence[Any]:
        xp = array_module(flat)
        norm = l2_norm(flat, self.use_fast_path)
        ops.check_finite(norm, name, "L2 norm")
        norm32 = kq.round_up_float32(norm)
        ops.check_finite(norm32, name, "L2 norm as float32")
        key = self._next_key(name)
        signs = ops.pack_bits(flat < 0)
        fast, xin = kq.fast_input(flat) if self.use_fast_path else (None, flat)
        mult = self.levels / float(norm32) if norm32 else 0.0
        if norm32 == 0:
            levels = xp.zeros(flat.size, dtype=np.uint8)
        elif fast is not None:
            levels = np.empty(flat.size, dtype=np.uint8)
            fast.qsgd_levels(xin, mult, self.levels, np.uint64(key), levels)
        else:
            levels = levels_reference(flat, mult, self.levels, key)
        norm_sec = np.array([norm32], dtype=np.float32)
        return [norm_sec if xp is np else xp.asarray(norm_sec), signs, levels]

    def _decode(self, sections: Sequence[Any], shape: Tuple[int, ...], dtype: np.dtype) -> Any:
        norm_sec, signs, levels = sections
        (norm,) = kq.host_floats(norm_sec)
        n = int(np.prod(shape))
        cd = compute_dtype(dtype)
        sign = decode_sign_bits(signs, n, 1.0, -1.0, cd)
        out = levels.astype(cd) * cd.type(norm / self.levels)
        out *= sign
        return out.astype(dtype, copy=False)

    def _layout(self, shape: Tuple[int, ...], dtype: np.dtype) -> Layout:
        n = int(np.prod(shape))
        return [(np.dtype(np.float32), 1), (np.dtype(np.uint8), -(-n // 8)),
                (np.dtype(np.uint8), n)]
