"""TernGrad: unbiased stochastic ternary quantization {-s, 0, +s}.

Paper: W. Wen, C. Xu, F. Yan, C. Wu, Y. Wang, Y. Chen, H. Li, "TernGrad: Ternary Gradients
to Reduce Communication in Distributed Deep Learning", NeurIPS 2017. With s = max|g|, each
element becomes ``s * sign(g_i) * b_i`` where ``b_i ~ Bernoulli(|g_i| / s)``, so
``E[decode(encode(g))] = g``: unbiased, no error feedback needed.

Wire layout of :meth:`TernGradCodec.encode` (sections in order)::

    0  uint8    ceil(n / 4)   2-bit codes, 4 per byte, first element in the two most
                              significant bits: 0 = zero, 1 = +s, 2 = -s (3 decodes to 0)
    1  float32  1             s (max|g| rounded up to float32, so |g_i| / s <= 1)

Summable path (:meth:`TernGradCodec.reduce_stages`; the paper's "scaler sharing"):
ranks first agree on a shared s = max over ranks of max|g| ("max" reduction of one
float32), then each quantizes with that s to int8 codes in {-1, 0, 1} (int16 above 127
ranks) which are summed across ranks without decoding; the result is
``prescale * s * sum(codes)``.

Random numbers: the counter-based stream of :mod:`hipress.codecs._kernels_quant`, keyed
by ``ops.rng_for(numpy, seed, name, step, rank)``; ``step`` counts the encodes of each
gradient name (saved by :meth:`state_dict`) and ``rank`` (attribute, default 0) is set by
the engine (``bind``) so that ranks draw independently.

NaN/Inf policy: s is computed from the gradient; ``ops.check_finite`` on it raises
:class:`~hipress.errors.NonFiniteGradientError`. In the summable path a rank with
non-finite values contributes s = +inf, so *every* rank raises after the "max" stage
instead of one rank leaving its peers waiting.
"""

from __future__ import annotations

from typing import Any, Dict, Generator, Sequence, Tuple

import numpy as np

from hipress.backend import array_module, check_gradient_dtype, compute_dtype
from hipress.codecs import _kernels_quant as kq
from hipress.codecs import ops
from hipress.codecs.base import Codec, Layout, Stage, register_codec
from hipress.codecs.state import SeededStreamMixin
from hipress.codecs.tbq import decode_ternary_codes
from hipress.errors import CodecError


def ternary_reference(flat: Any, scale: float, key: int, out_dtype: Any) -> Any:
    """Return TernGrad's ternary draws sign(g_i) * b_i as ``out_dtype`` (NumPy/CuPy).

    b_i = 1 exactly when ``u24_i * scale < |g_i| * 2**24`` (``kq.bernoulli_keep``).
    """
    xp = array_module(flat)
    u = kq.uniform_u24(xp, flat.size, key)
    keep = kq.bernoulli_keep(xp, xp.abs(flat.astype(compute_dtype(flat.dtype))), scale, u)
    sign = xp.where(flat > 0, 1, -1).astype(out_dtype)
    return xp.where(keep, sign, 0).astype(out_dtype)


def encode_reference(flat: Any, scale: float, key: int) -> Any:
    """Return TernGrad's packed 2-bit codes of a 1-D array for scale ``scale`` (NumPy/CuPy)."""
    t = ternary_reference(flat, scale, key, np.int8)
    codes = (t == 1).astype(np.uint8) | ((t == -1).astype(np.uint8) << np.uint8(1))
    return ops.pack_codes(codes, 2)


def _local_absmax(flat: Any, fast: Any, xin: Any) -> float:
    """Return max|flat| (NaN or Inf when the array holds one)."""
    if fast is not None:
        return kq.fast_absmax(fast, xin)
    xp = array_module(flat)
    return float(xp.abs(flat).max())


@register_codec("terngrad", codec_id=12)
class TernGradCodec(SeededStreamMixin, Codec):
    """TernGrad (Wen et al., NeurIPS 2017): unbiased ternary {-s, 0, s} with s = max|g|.

    Algorithm (encode, gradient g of n elements):
        1. m = max|g|; ``ops.check_finite(m)`` raises
           :class:`~hipress.errors.NonFiniteGradientError` on NaN/Inf.
        2. s = m rounded up to float32 (s >= |g_i| for every i).
        3. Draw u_i (24-bit) from the stream keyed by (seed, name, step, rank); advance step.
        4. b_i = [u_i * s < |g_i| * 2**24], i.e. Bernoulli(|g_i| / s) to within 2**-24.
        5. code_i = 1 (g_i > 0) or 2 (g_i < 0) if b_i else 0; pack 4 per byte.

    Decode: 0, +s, -s for codes 0, 1, 2 in the gradient's dtype. An element with
    |g_i| = s always decodes to itself, a zero always to zero.

    On NumPy input Numba kernels do step 1 in one pass and steps 3-5 in a second, drawing
    exactly the numbers of :func:`encode_reference` (bit-identical payloads); the reference
    runs on CuPy and when Numba is missing (``use_fast_path = False`` forces it).

    Args:
        seed: integer in [0, 2**32) keying the random streams (same on every rank).

    Raises:
        CodecError: bad seed.
    """

    summable = True
    stochastic = True
    device_kernels = "terngrad"
    use_fast_path = True

    def __init__(self, seed: int = 0) -> None:
        self._init_stream(seed, "terngrad")

    def params(self) -> Dict[str, Any]:
        """Return the constructor parameters."""
        return {"seed": self.seed}

    def _encode(self, flat: Any, shape: Tuple[int, ...], name: str) -> Sequence[Any]:
        xp = array_module(flat)
        fast, xin = kq.fast_input(flat) if self.use_fast_path else (None, flat)
        m = _local_absmax(flat, fast, xin)
        ops.check_finite(m, name, "scale max|g|")
        s = kq.round_up_float32(m)
        key = self._next_key(name)
        nbytes = -(-flat.size // 4)
        if s == 0:
            codes = xp.zeros(nbytes, dtype=np.uint8)
        elif fast is not None:
            codes = np.empty(nbytes, dtype=np.uint8)
            fast.terngrad_encode(xin, s, np.uint64(key), codes)
        else:
            codes = encode_reference(flat, float(s), key)
        scale = np.array([s], dtype=np.float32)
        return [codes, scale if xp is np else xp.asarray(scale)]

    def _decode(self, sections: Sequence[Any], shape: Tuple[int, ...], dtype: np.dtype) -> Any:
        codes, scale = sections
        (s,) = kq.host_floats(scale)
        return decode_ternary_codes(codes, int(np.prod(shape)), s, dtype, self.use_fast_path)

    def _layout(self, shape: Tuple[int, ...], dtype: np.dtype) -> Layout:
        n = int(np.prod(shape))
        return [(np.dtype(np.uint8), -(-n // 4)), (np.dtype(np.float32), 1)]

    def reduce_stages(
        self, x: Any, name: str, world_size: int, prescale: float = 1.0
    ) -> Generator[Stage, Any, Any]:
        """Sum ternary codes across ranks under a shared scale, never decoding a payload.

        Steps:
            1. Yield ``(float32 [max|x| rounded up], "max")``; a rank with NaN/Inf yields
               +inf. The reduced value is the shared s; ``ops.check_finite(s)`` then raises
               :class:`~hipress.errors.NonFiniteGradientError` on every rank alike.
            2. Draw t_i = sign(x_i) * Bernoulli(|x_i| / s) in {-1, 0, 1} from this rank's
               stream (advancing the step of ``name``); yield ``(t, "sum")`` as int8 when
               ``world_size <= 127`` (|sum| <= world_size), else int16.
            3. Return ``(prescale * s * sum_t, None)`` in x's shape and dtype (computed in
               float32, float64 for float64 x); unbiased, so no error feedback.

        Args:
            x: this rank's gradient (NumPy or CuPy, any shape, float16/bfloat16/float32/64).
            name: the gradient's stable name.
            world_size: number of ranks taking part (>= 1).
            prescale: factor applied to the sum (1/world_size for an average).
        """
        dt = check_gradient_dtype(x.dtype, f"gradient {name!r}")
        if int(world_size) < 1:
            raise CodecError(f"world_size must be >= 1, got {world_size!r}")
        xp = array_module(x)
        flat = xp.ascontiguousarray(x).reshape(-1)
        fast, xin = kq.fast_input(flat) if self.use_fast_path else (None, flat)
        m = _local_absmax(flat, fast, xin) if flat.size else 0.0
        local = kq.round_up_float32(m) if np.isfinite(m) else np.float32(np.inf)
        shared = yield (xp.asarray(np.array([local], dtype=np.float32)), "max")
        (s,) = kq.host_floats(shared)
        ops.check_finite(s, name, "shared scale (max|g| over ranks)")
        key = self._next_key(name)
        wire = np.dtype(np.int8) if int(world_size) <= 127 else np.dtype(np.int16)
        if s == 0 or flat.size == 0:
            t = xp.zeros(flat.size, dtype=wire)
        elif fast is not None:
            t = np.empty(flat.size, dtype=wire)
            fast.terngrad_ternary(xin, s, np.uint64(key), t)
        else:
            t = ternary_reference(flat, s, key, wire)
        total = yield (t, "sum")
        cd = compute_dtype(dt)
        result = total.astype(cd) * cd.type(float(prescale) * s)
        return result.astype(dt, copy=False).reshape(x.shape), None
