"""signSGD and EF-signSGD: one sign bit per element.

Papers:
    - signSGD: J. Bernstein, Y.-X. Wang, K. Azizzadenesheli, A. Anandkumar, "signSGD:
      Compressed Optimisation for Non-Convex Problems", ICML 2018. Each element is sent
      as its sign; the decoded gradient is ±1 (the learning rate sets the step size).
    - EF-signSGD: S. P. Karimireddy, Q. Rebjock, S. U. Stich, M. Jaggi, "Error Feedback
      Fixes SignSGD and other Gradient Compression Schemes", ICML 2019 (Algorithm 1): the
      sign is scaled by ||g||_1 / n = mean|g| and the error is fed back to the next step.

Wire layout of ``signsgd`` (one section)::

    0  uint8    ceil(n / 8)   sign bits, 8 per byte, MSB first; 1 = negative

Wire layout of ``efsignsgd`` (sections in order)::

    0  uint8    ceil(n / 8)   sign bits, as above
    1  float32  1             scale = mean|g| (sum in float64, rounded to float32)

Zero (and -0.0) has sign bit 0 and decodes to +1 (signSGD) or +scale (EF-signSGD), as
``sign(0) := +1`` in the EF-signSGD analysis; an all-zero gradient still decodes to exact
zeros under EF-signSGD because its scale is 0.

NaN/Inf policy: both codecs compute sum|g| (EF-signSGD's scale; signSGD gets it from the
same fused pass for free) and ``ops.check_finite`` on it raises
:class:`~hipress.errors.NonFiniteGradientError`: a NaN has no sign.
"""

from __future__ import annotations

from typing import Any, Dict, Sequence, Tuple

import numpy as np

from hipress.backend import array_module
from hipress.codecs import _kernels_quant as kq
from hipress.codecs import ops
from hipress.codecs.base import Codec, Layout, register_codec
from hipress.codecs.onebit import decode_sign_bits, sign_sums


@register_codec("signsgd", codec_id=14)
class SignSGDCodec(Codec):
    """signSGD (Bernstein et al., ICML 2018): sign bits only, decoded to ±1.

    Algorithm:
        1. b_i = 1 if g_i < 0 else 0; pack 8 per byte, MSB first.
        2. In the same pass sum|g| (float64); ``ops.check_finite`` refuses NaN/Inf.
        3. Decode: -1 where b_i = 1, +1 elsewhere (zero -> +1), in the gradient's dtype.

    The decoded magnitude is 1 regardless of the gradient's scale: pair it with a small
    learning rate (the paper uses signum with momentum, lr ~1e-4) or with a majority vote
    across workers. The codec is biased and not meant for error feedback (use
    ``efsignsgd`` for that).
    """

    use_fast_path = True

    def params(self) -> Dict[str, Any]:
        """Return the constructor parameters (none)."""
        return {}

    def _encode(self, flat: Any, shape: Tuple[int, ...], name: str) -> Sequence[Any]:
        bits, pos_sum, neg_sum, _ = sign_sums(flat, self.use_fast_path)
        ops.check_finite(pos_sum - neg_sum, name, "sum |g|")
        return [bits]

    def _decode(self, sections: Sequence[Any], shape: Tuple[int, ...], dtype: np.dtype) -> Any:
        return decode_sign_bits(sections[0], int(np.prod(shape)), 1.0, -1.0, dtype,
                                self.use_fast_path)

    def _layout(self, shape: Tuple[int, ...], dtype: np.dtype) -> Layout:
        return [(np.dtype(np.uint8), -(-int(np.prod(shape)) // 8))]


@register_codec("efsignsgd", codec_id=15)
class EFSignSGDCodec(Codec):
    """EF-signSGD (Karimireddy et al., ICML 2019): sign bits scaled by mean|g|.

    Algorithm (for the compensated gradient p = g + e of n elements):
        1. b_i = 1 if p_i < 0 else 0; pack 8 per byte, MSB first.
        2. scale = sum|p| / n (float64 sums in onebit's fixed lane order, rounded to
           float32); ``ops.check_finite`` refuses NaN/Inf.
        3. Decode: -scale where b_i = 1, +scale elsewhere.

    The residual e = p - decode(encode(p)) is kept by the engine's error-feedback memory
    (``error_feedback = True``), which is what makes the scaled sign converge like SGD.
    """

    error_feedback = True
    use_fast_path = True

    def params(self) -> Dict[str, Any]:
        """Return the constructor parameters (none)."""
        return {}

    def _encode(self, flat: Any, shape: Tuple[int, ...], name: str) -> Sequence[Any]:
        bits, pos_sum, neg_sum, _ = sign_sums(flat, self.use_fast_path)
        abs_sum = pos_sum - neg_sum
        ops.check_finite(abs_sum, name, "sum |g|")
        scale = np.array([abs_sum / flat.size], dtype=np.float32)
        xp = array_module(flat)
        return [bits, scale if xp is np else xp.asarray(scale)]

    def _decode(self, sections: Sequence[Any], shape: Tuple[int, ...], dtype: np.dtype) -> Any:
        bits, scale = sections
        (s,) = kq.host_floats(scale)
        return decode_sign_bits(bits, int(np.prod(shape)), s, -s, dtype, self.use_fast_path)

    def _layout(self, shape: Tuple[int, ...], dtype: np.dtype) -> Layout:
        return [(np.dtype(np.uint8), -(-int(np.prod(shape)) // 8)), (np.dtype(np.float32), 1)]
