"""8-bit min-max (affine) quantization: 256 evenly spaced levels between min(g) and max(g).

The uniform quantizer used for gradient and activation compression alike (e.g. the 8-bit
scheme of Dettmers, "8-Bit Approximations for Parallelism in Deep Learning", ICLR 2016,
and the min/max "asymmetric" quantization of TensorFlow Lite / PyTorch quantization).
Each element keeps its position in [min, max] to 1/255 of the range: 4x smaller than
float32, deterministic and nearly unbiased, so it runs without error feedback.

Wire layout (sections in order)::

    0  float32  2             [min, max] (min rounded down, max rounded up to float32)
    1  uint8    n             codes round((g_i - min) / (max - min) * 255)

Rounding is to nearest, ties to even (``rint``); codes are clipped to [0, 255]. When
max == min every code is 0 and the decode is the constant itself: exactly for float16,
bfloat16 and float32 gradients; a float64 constant comes back rounded to float32 (the
bounds travel as float32).

NaN/Inf policy: min and max are computed from the gradient; ``ops.check_finite`` on them
raises :class:`~hipress.errors.NonFiniteGradientError`.
"""

from __future__ import annotations

from typing import Any, Dict, Sequence, Tuple

import numpy as np

from hipress.backend import array_module, compute_dtype
from hipress.codecs import _kernels_quant as kq
from hipress.codecs import ops
from hipress.codecs.base import Codec, Layout, register_codec


@register_codec("minmax8", codec_id=16)
class MinMax8Codec(Codec):
    """8-bit min-max quantization.

    Algorithm (gradient g):
        1. lo = min(g), hi = max(g) (NaN propagates); ``ops.check_finite`` on both raises
           :class:`~hipress.errors.NonFiniteGradientError`. lo is rounded down and hi up
           to float32 (exact for float32 and narrower gradients); a constant gradient
           (lo == hi) is sent as the nearest float32.
        2. If hi == lo: codes are all 0. Else code_i = rint((g_i - lo) / (hi - lo) * 255)
           in float64, clipped to [0, 255], as uint8.

    Decode: lo + code_i * ((hi - lo) / 255), in float32 (float64 for float64 gradients,
    or when hi - lo overflows float32), cast to the gradient's dtype. The error per
    element is at most (hi - lo) / 510 plus float rounding.
    """

    def params(self) -> Dict[str, Any]:
        """Return the constructor parameters (none)."""
        return {}

    def _encode(self, flat: Any, shape: Tuple[int, ...], name: str) -> Sequence[Any]:
        xp = array_module(flat)
        xc = flat.astype(compute_dtype(flat.dtype), copy=False)
        lo_v, hi_v = float(xc.min()), float(xc.max())
        ops.check_finite(lo_v, name, "minimum")
        ops.check_finite(hi_v, name, "maximum")
        if lo_v == hi_v:  # a constant: send it (nearest float32), every code 0
            lo = hi = np.float32(lo_v)
        else:
            lo, hi = kq.round_down_float32(lo_v), kq.round_up_float32(hi_v)
        ops.check_finite(lo, name, "minimum as float32")
        ops.check_finite(hi, name, "maximum as float32")
        if hi == lo:
            codes = xp.zeros(flat.size, dtype=np.uint8)
        else:
            span = float(hi) - float(lo)
            t = (xc.astype(np.float64) - float(lo)) / span * 255.0
            codes = xp.clip(xp.rint(t), 0, 255).astype(np.uint8)
        bounds = np.array([lo, hi], dtype=np.float32)
        return [bounds if xp is np else xp.asarray(bounds), codes]

    def _decode(self, sections: Sequence[Any], shape: Tuple[int, ...], dtype: np.dtype) -> Any:
        bounds, codes = sections
        lo, hi = kq.host_floats(bounds)
        span = hi - lo
        cd = compute_dtype(dtype)
        if span > float(np.finfo(np.float32).max):
            cd = np.dtype(np.float64)
        out = codes.astype(cd) * cd.type(span / 255.0)
        out += cd.type(lo)
        return out.astype(dtype, copy=False)

    def _layout(self, shape: Tuple[int, ...], dtype: np.dtype) -> Layout:
        return [(np.dtype(np.float32), 2), (np.dtype(np.uint8), int(np.prod(shape)))]
