"""Identity codec: the gradient travels as it is (the uncompressed baseline).

Wire layout: one section, the gradient's elements in its own dtype (row-major).
"""

from __future__ import annotations

from typing import Any, Generator, Sequence, Tuple

import numpy as np

from hipress.codecs.base import Codec, Layout, Stage, register_codec


@register_codec("none", codec_id=1)
class IdentityCodec(Codec):
    """Send the gradient uncompressed; lossless and summable (plain allreduce)."""

    summable = True
    lossless = True

    def _encode(self, flat: Any, shape: Tuple[int, ...], name: str) -> Sequence[Any]:
        return [flat.copy()]

    def _decode(self, sections: Sequence[Any], shape: Tuple[int, ...], dtype: np.dtype) -> Any:
        return sections[0].copy()

    def _layout(self, shape: Tuple[int, ...], dtype: np.dtype) -> Layout:
        return [(dtype, int(np.prod(shape)))]

    def reduce_stages(
        self, x: Any, name: str, world_size: int, prescale: float = 1.0
    ) -> Generator[Stage, Any, Any]:
        """Reduce the gradient itself with one sum (prescale applied after the sum)."""
        total = yield (x, "sum")
        if prescale != 1.0:
            total = (total * prescale).astype(x.dtype, copy=False)
        return total, None
