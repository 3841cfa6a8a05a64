"""Threshold binary quantization (TBQ): send only the elements beyond ±tau, as ±tau.

Paper: N. Strom, "Scalable Distributed DNN Training Using Commodity GPU Cloud Computing",
Interspeech 2015. Each element whose magnitude reaches the threshold tau is sent as ±tau
and the rest (including the part of a large element beyond tau) stays in the residual,
which the engine's error-feedback memory adds to the next step's gradient.

Wire layout (sections in order)::

    0  uint8    ceil(n / 4)   2-bit codes, 4 per byte, first element in the two most
                              significant bits (ops.pack_codes): 0 = zero, 1 = +tau,
                              2 = -tau (3 is never produced and decodes to 0)
    1  float32  1             tau

Strom encodes the indices of the sent elements (sparse); a dense 2-bit code is the
HiPress choice (as in the HiPress paper's TBQ operator): its size is fixed, 16x smaller
than float32, and independent of how many elements pass the threshold.

NaN/Inf policy: tau is not computed from the gradient, but a NaN would silently land in
the residual and poison every later step, so non-finite gradients are refused with
:class:`~hipress.errors.NonFiniteGradientError` (``ops.check_finite`` on max|g|).
"""

from __future__ import annotations

from typing import Any, Dict, Sequence, Tuple

import numpy as np

from hipress.backend import array_module, compute_dtype
from hipress.codecs import _kernels_quant as kq
from hipress.codecs import ops
from hipress.codecs.base import Codec, Layout, register_codec
from hipress.errors import CodecError


def encode_reference(flat: Any, tau: np.float32) -> Any:
    """Return TBQ's packed 2-bit codes of a 1-D array with NumPy/CuPy.

    Args:
        flat: 1-D float array (float16/bfloat16 are compared in float32).
        tau: the float32 threshold (> 0).

    Returns:
        uint8 array of ceil(n / 4) bytes.
    """
    x = flat.astype(compute_dtype(flat.dtype), copy=False)
    t = x.dtype.type(tau)
    codes = (x >= t).astype(np.uint8) | ((x <= -t).astype(np.uint8) << np.uint8(1))
    return ops.pack_codes(codes, 2)


@register_codec("tbq", codec_id=11)
class TBQCodec(Codec):
    """Threshold binary quantization (Strom, Interspeech 2015).

    Algorithm (encode, for the compensated gradient g):
        1. code_i = 1 if g_i >= tau, 2 if g_i <= -tau, else 0 (compared in float32, or
           float64 for float64 gradients, against the float32 tau).
        2. Refuse NaN/Inf (``ops.check_finite`` on max|g| raises
           :class:`~hipress.errors.NonFiniteGradientError`).
        3. Pack the codes 4 per byte; send tau as float32.

    Decode: 0, +tau, -tau for codes 0, 1, 2, in the gradient's dtype.

    On NumPy input one fused Numba pass does steps 1-3 (and the decode), bit-identical to
    :func:`encode_reference`, which runs on CuPy and when Numba is missing
    (``use_fast_path = False`` forces it).

    Tuning: tau should sit in the tail of |g + residual|, where only a small fraction of
    elements reach it (Strom used a fixed tau tuned per model); too small a tau sends
    ±tau for nearly everything and the residual oscillates, too large sends nothing for
    many steps. The codec is biased: run it with error feedback (``error_feedback = True``).

    Args:
        threshold: tau, a finite float > 0 that is still > 0 as float32 (gradient units;
            default 0.01). Tune it to the model: about the typical gradient magnitude.

    Raises:
        CodecError: ``threshold`` is missing, not a number, not finite or not > 0.
    """

    error_feedback = True
    device_kernels = "tbq"
    use_fast_path = True

    def __init__(self, threshold: float = 0.01) -> None:
        try:
            t = float(threshold)
        except (TypeError, ValueError):
            raise CodecError(
                f"tbq threshold must be a finite number > 0 (gradient units), got {threshold!r}"
            ) from None
        if not (0.0 < t <= kq.F32_MAX) or not np.float32(t) > 0:
            raise CodecError(
                f"tbq threshold must be finite and > 0 as float32 (in (1.4e-45, 3.4e38]), got "
                f"{threshold!r}; pass e.g. params: {{threshold: 0.01}}"
            )
        self.threshold = t
        self.tau = np.float32(t)

    def params(self) -> Dict[str, Any]:
        """Return the constructor parameters."""
        return {"threshold": self.threshold}

    def _encode(self, flat: Any, shape: Tuple[int, ...], name: str) -> Sequence[Any]:
        xp = array_module(flat)
        fast, xin = kq.fast_input(flat) if self.use_fast_path else (None, flat)
        if fast is not None:
            codes = np.empty(-(-flat.size // 4), dtype=np.uint8)
            if not fast.tbq_encode(xin, xin.dtype.type(self.tau), codes):
                ops.check_finite(np.abs(xin).max(), name, "max |g|")
        else:
            ops.check_finite(xp.abs(flat).max(), name, "max |g|")
            codes = encode_reference(flat, self.tau)
        tau = np.array([self.tau], dtype=np.float32)
        return [codes, tau if xp is np else xp.asarray(tau)]

    def _decode(self, sections: Sequence[Any], shape: Tuple[int, ...], dtype: np.dtype) -> Any:
        codes, tau_sec = sections
        (tau,) = kq.host_floats(tau_sec)
        return decode_ternary_codes(codes, int(np.prod(shape)), tau, dtype, self.use_fast_path)

    def _layout(self, shape: Tuple[int, ...], dtype: np.dtype) -> Layout:
        n = int(np.prod(shape))
        return [(np.dtype(np.uint8), -(-n // 4)), (np.dtype(np.float32), 1)]


def decode_ternary_codes(codes: Any, n: int, scale: float, dtype: np.dtype, fast_ok: bool) -> Any:
    """Decode 2-bit codes (0 -> 0, 1 -> +scale, 2 -> -scale) into ``n`` elements of ``dtype``.

    Shared by TBQ and TernGrad. Uses the Numba kernel for NumPy sections when allowed,
    else the (256, 4) lookup table of :func:`hipress.codecs._kernels_quant.decode_2bit`.
    """
    dtype = np.dtype(dtype)
    v = float(dtype.type(scale))  # the value as the gradient's dtype holds it
    fast = kq.fast_output(codes) if fast_ok else None
    if fast is not None:
        wd = kq.work_dtype(dtype)
        out = np.empty(n, dtype=wd)
        fast.decode_2bit(codes, wd.type(v), wd.type(-v), out)
        return out if wd == dtype else out.astype(dtype)
    return kq.decode_2bit(codes, n, [0.0, v, -v, 0.0], dtype)
