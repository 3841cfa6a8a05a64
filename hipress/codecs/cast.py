"""Casting codecs: fp16 and bf16 (2 bytes per element, 2x smaller than float32).

Wire layout: one section, the gradient's elements cast to float16 (or bfloat16),
row-major. Decoding casts back to the gradient's dtype.

Casting is elementwise, so NaN and Inf propagate faithfully; a float32 value beyond
float16's range (65504) becomes ±Inf, which is why the summable path scales by
``prescale`` (1/N for an average) *before* the cast and the sum, as PyTorch's
``fp16_compress_hook`` does.
"""

from __future__ import annotations

from typing import Any, Generator, Sequence, Tuple

import numpy as np

from hipress.backend import bfloat16
from hipress.codecs._kernels_cast import float16_to_float32, float32_to_float16
from hipress.codecs.base import Codec, Layout, Stage, register_codec


class _CastCodec(Codec):
    """Cast to a 2-byte float for the wire and back."""

    summable = True
    wire_dtype: np.dtype

    def _encode(self, flat: Any, shape: Tuple[int, ...], name: str) -> Sequence[Any]:
        if self.wire_dtype == np.float16 and type(flat) is np.ndarray and flat.dtype == np.float32:
            return [float32_to_float16(flat)]  # same bits as astype, 4x faster on the CPU
        return [flat.astype(self.wire_dtype)]

    def _decode(self, sections: Sequence[Any], shape: Tuple[int, ...], dtype: np.dtype) -> Any:
        wire = sections[0]
        if (wire.dtype == np.float16 and type(wire) is np.ndarray
                and dtype in (np.float32, np.float64)):
            return float16_to_float32(wire).astype(dtype, copy=False)  # float64: exact
        return wire.astype(dtype)

    def _layout(self, shape: Tuple[int, ...], dtype: np.dtype) -> Layout:
        return [(self.wire_dtype, int(np.prod(shape)))]

    def reduce_stages(
        self, x: Any, name: str, world_size: int, prescale: float = 1.0
    ) -> Generator[Stage, Any, Any]:
        """Scale by ``prescale`` in float32, cast, sum the casts, cast back.

        Scaling first keeps an average of values near the format's limit finite: four
        ranks each holding 30000 would overflow float16 if summed before dividing.
        """
        scaled = x.astype(np.float32) * np.float32(prescale) if prescale != 1.0 else x
        total = yield (scaled.astype(self.wire_dtype), "sum")
        return total.astype(x.dtype), None


@register_codec("fp16", codec_id=2)
class FP16Codec(_CastCodec):
    """Cast gradients to IEEE float16 for the wire (10-bit mantissa, max 65504)."""

    wire_dtype = np.dtype(np.float16)


@register_codec("bf16", codec_id=3)
class BF16Codec(_CastCodec):
    """Cast gradients to bfloat16 for the wire (float32's range, 7-bit mantissa)."""

    wire_dtype = bfloat16
