"""1-bit SGD: one sign bit per element plus two reconstruction values.

Paper: F. Seide, H. Fu, J. Droppo, G. Li, D. Yu, "1-Bit Stochastic Gradient Descent and its
Application to Data-Parallel Distributed Training of Speech DNNs", Interspeech 2014. As in
the paper and CNTK's implementation, each side of zero is reconstructed by the mean of the
elements that fell on it, and the quantization error is carried to the next step by error
feedback (the engine's residual memory).

Wire layout (sections in order)::

    0  uint8    ceil(n / 8)   sign bits, 8 per byte, most significant bit first
                              (element i -> bit 7 - i % 8 of byte i // 8); 1 = negative
    1  float32  2             [mean of the non-negative elements, mean of the negative ones]

Eight float32 elements cost one byte of sign bits plus the 8-byte scale section (each
section is padded to 8 bytes on the wire).

Zero (and -0.0) belongs to the non-negative side. A side with no elements has mean 0, so an
all-zero gradient decodes to exact zeros, never to ±scale.
"""

from __future__ import annotations

import math
from typing import Any, Dict, Optional, Sequence, Tuple

import numpy as np

from hipress.backend import array_module
from hipress.codecs import _kernels_quant as kq
from hipress.codecs import ops
from hipress.codecs.base import Codec, Layout, Payload, register_codec


def sign_sums(flat: Any, use_fast_path: bool = True) -> Tuple[Any, float, float, int]:
    """Pack the sign bits of a 1-D array and sum each side of zero, in one pass.

    Shared by onebit, signSGD and EF-signSGD.

    Steps:
        1. neg_i = flat_i < 0 (zero, -0.0 and NaN are on the non-negative side).
        2. bits = pack_bits(neg) (8 per byte, MSB first).
        3. Sum the non-negative and the negative elements in float64, each in the fixed
           16-lane order of :func:`hipress.codecs._kernels_quant.lane_sums`, lanes added
           left to right.

    On NumPy input one fused Numba pass does all three (float16/bfloat16 upcast to float32
    first), bit-identical to the NumPy/CuPy reference used otherwise.

    Args:
        flat: 1-D float array (NumPy or CuPy), non-empty.
        use_fast_path: allow the Numba kernel.

    Returns:
        (uint8 bits of ceil(n/8) bytes, sum of non-negatives, sum of negatives, count of
        negatives); the sums are NaN/±Inf when ``flat`` holds NaN/Inf.
    """
    fast, xin = kq.fast_input(flat) if use_fast_path else (None, flat)
    if fast is not None:
        bits = np.empty(-(-flat.size // 8), dtype=np.uint8)
        acc, n_neg = fast.onebit_encode(xin, bits)
        return bits, kq.combine_lanes(acc[0]), kq.combine_lanes(acc[1]), int(n_neg)
    xp = array_module(flat)
    x64 = flat.astype(np.float64)
    neg = x64 < 0
    bits = ops.pack_bits(neg)
    pos_sum = kq.combine_lanes(kq.lane_sums(xp.where(neg, 0.0, x64)))
    neg_sum = kq.combine_lanes(kq.lane_sums(xp.where(neg, x64, 0.0)))
    return bits, pos_sum, neg_sum, int(xp.count_nonzero(neg))


def decode_sign_bits(
    bits: Any, n: int, pos_value: float, neg_value: float, dtype: Any, fast_ok: bool = True
) -> Any:
    """Decode packed sign bits: bit 0 -> ``pos_value``, bit 1 -> ``neg_value``.

    Shared by onebit, signSGD and EF-signSGD. The values are first rounded to ``dtype``.
    Uses the Numba kernel for NumPy sections when allowed (16-bit floats through float32),
    else the (256, 8) lookup table of :func:`hipress.codecs._kernels_quant.decode_1bit`.

    Returns:
        1-D array of ``n`` elements of ``dtype``.
    """
    dtype = np.dtype(dtype)
    pos, neg = float(dtype.type(pos_value)), float(dtype.type(neg_value))
    fast = kq.fast_output(bits) if fast_ok else None
    if fast is not None:
        wd = kq.work_dtype(dtype)
        out = np.empty(n, dtype=wd)
        fast.decode_1bit(bits, wd.type(pos), wd.type(neg), out)
        return out if wd == dtype else out.astype(dtype)
    return kq.decode_1bit(bits, n, pos, neg, dtype)


def encode_reference(flat: Any) -> Tuple[Any, np.ndarray]:
    """Return onebit's (sign bits, float32 [mean_nonneg, mean_neg]) with NumPy/CuPy only."""
    bits, pos_sum, neg_sum, n_neg = sign_sums(flat, use_fast_path=False)
    return bits, _means(pos_sum, neg_sum, n_neg, flat.size)


def _means(pos_sum: float, neg_sum: float, n_neg: int, n: int) -> np.ndarray:
    n_pos = n - n_neg
    return np.array(
        [pos_sum / n_pos if n_pos else 0.0, neg_sum / n_neg if n_neg else 0.0], dtype=np.float32
    )


@register_codec("onebit", codec_id=10)
class OneBitCodec(Codec):
    """1-bit SGD (Seide et al., Interspeech 2014): sign bits plus two means.

    Algorithm (encode, for the compensated gradient g of n elements):
        1. b_i = 1 if g_i < 0 else 0 (zero and NaN on the non-negative side).
        2. pos = mean{g_i : b_i = 0}, neg = mean{g_i : b_i = 1} (float64 sums in the fixed
           16-lane order, 0 for an empty side), rounded to float32.
        3. Refuse NaN/Inf: ``ops.check_finite`` on both means raises
           :class:`~hipress.errors.NonFiniteGradientError` naming the gradient.
        4. Pack b 8 per byte, MSB first.

    Decode: element i = neg if b_i else pos, in the gradient's dtype.

    On NumPy input a fused single-pass Numba kernel does steps 1, 2 and 4 (and the decode;
    float16/bfloat16 go through float32, exactly), bit-identical to
    :func:`encode_reference`, which runs on CuPy and when Numba is missing. Set
    ``use_fast_path = False`` on an instance to force the reference.

    The codec is biased; run it with residual error feedback (``error_feedback = True``).
    """

    error_feedback = True
    use_fast_path = True
    device_kernels = "onebit"

    def params(self) -> Dict[str, Any]:
        """Return the constructor parameters (none)."""
        return {}

    def _encode(self, flat: Any, shape: Tuple[int, ...], name: str) -> Sequence[Any]:
        bits, pos_sum, neg_sum, n_neg = sign_sums(flat, self.use_fast_path)
        scales = _means(pos_sum, neg_sum, n_neg, flat.size)
        ops.check_finite(scales[0], name, "non-negative mean")
        ops.check_finite(scales[1], name, "negative mean")
        xp = array_module(flat)
        return [bits, scales if xp is np else xp.asarray(scales)]

    def _decode(self, sections: Sequence[Any], shape: Tuple[int, ...], dtype: np.dtype) -> Any:
        bits, scales = sections
        pos, neg = kq.host_floats(scales)
        return decode_sign_bits(bits, math.prod(shape), pos, neg, dtype, self.use_fast_path)

    def _layout(self, shape: Tuple[int, ...], dtype: np.dtype) -> Layout:
        n = math.prod(shape)
        return [(np.dtype(np.uint8), -(-n // 8)), (np.dtype(np.float32), 2)]

    # ------------------------------------------------------------ fused kernels
    def encode_residual(self, x: Any, residual: Any, name: str = "") -> Optional[Payload]:
        """Two passes: signs and sums of ``x + e``; then ``e = (x + e) - decoded``.

        NumPy float32/float64 with a residual of the same dtype only (else None).
        """
        fast = _fast_same_dtype(self, x, residual)
        if fast is None or x.size == 0:
            return None
        xf, ef = x.reshape(-1), residual.reshape(-1)
        bits = np.empty(-(-xf.size // 8), dtype=np.uint8)
        acc, n_neg = fast.onebit_encode_ef(xf, ef, bits)
        scales = _means(kq.combine_lanes(acc[0]), kq.combine_lanes(acc[1]), int(n_neg), xf.size)
        ops.check_finite(scales[0], name, "non-negative mean")
        ops.check_finite(scales[1], name, "negative mean")
        dt = x.dtype.type
        fast.onebit_residual(xf, ef, bits, dt(scales[0]), dt(scales[1]))
        return Payload(self.codec_id, x.dtype, tuple(int(d) for d in x.shape), (bits, scales))

    def encode_residual_deferred(self, x: Any, state: Any, pending: Any,
                                 name: str = "") -> Optional[Tuple[Payload, Any]]:
        """One pass: settle the previous step's bits, compensate, sign-pack and sum.

        The pending value is (sign bits, value of the non-negative side, value of the
        negative side), the values in ``x``'s dtype; ``state`` keeps the compensated
        gradient c, so the pass reads x, c and one bit per element and writes c and the
        new bits (12 bytes per float32 element against the 20 of
        :meth:`encode_residual`'s two passes). NumPy float32/float64 with a state of the
        same dtype only (else None).
        """
        fast = _fast_same_dtype(self, x, state)
        if fast is None or x.size == 0:
            return None
        xf, cf = x.reshape(-1), state.reshape(-1)
        bits = np.empty(-(-xf.size // 8), dtype=np.uint8)
        dt = x.dtype.type
        if pending is None:
            acc, n_neg = fast.onebit_encode_ef_deferred(xf, cf, bits, dt(0), dt(0), False, bits)
        else:
            pbits, v0, v1 = pending
            acc, n_neg = fast.onebit_encode_ef_deferred(xf, cf, pbits, v0, v1, True, bits)
        return self._deferred_result(acc, n_neg, bits, x.dtype,
                                     tuple(int(d) for d in x.shape), name)

    def merge_encode_residual_deferred(self, payloads: Sequence[Payload], state: Any,
                                       pending: Any, name: str = ""
                                       ) -> Optional[Tuple[Payload, Any]]:
        """One pass over the payloads' bits and ``state``: sum, settle, compensate, encode.

        The kernel adds up to 4 payloads in its pass; with more (world size > 4), the
        first ones are summed beforehand by decode and :meth:`decode_add`, in the same
        order. NumPy float32/float64 payloads of ``state``'s dtype and size only (else
        None).
        """
        fast = _fast_same_dtype(self, state, state)
        n = state.size
        if fast is None or n == 0 or not payloads or any(
                p.codec_id != self.codec_id or np.dtype(p.dtype) != state.dtype
                or p.numel != n or type(p.sections[0]) is not np.ndarray for p in payloads):
            return None
        for p in payloads:
            self._check_sections(p)
        dt = state.dtype.type
        head, tail = payloads[:-4], payloads[-4:]  # the kernel takes 4 at a time
        x = np.zeros(1, state.dtype)
        if head:  # the partial sum of the first ones, as the separate steps compute it
            x = self.decode(head[0]).reshape(-1).astype(state.dtype, copy=False)
            for p in head[1:]:
                self.decode_add(p, x)
        # read-only views: payloads from received bytes are read-only, this rank's own
        # is writable, and each mix (by the rank's position) compiled the kernel anew
        bs = [_readonly(p.sections[0]) for p in tail]
        vals = np.zeros((4, 2), state.dtype)
        vals[:len(tail)] = [kq.host_floats(p.sections[1]) for p in tail]
        bs += [bs[0]] * (4 - len(bs))
        cf = state.reshape(-1)
        bits = np.empty(-(-n // 8), dtype=np.uint8)
        sbits, v0, v1, settle = (bits, dt(0), dt(0), False) if pending is None else (
            *pending, True)
        kernel = fast.onebit_merge_encoders[len(tail), bool(head)]
        acc, n_neg = kernel(x, bs[0], bs[1], bs[2], bs[3], vals, cf, sbits, v0, v1, settle,
                            bits)
        return self._deferred_result(acc, n_neg, bits, state.dtype, (n,), name)

    def _deferred_result(self, acc: Any, n_neg: Any, bits: np.ndarray, dtype: Any,
                         shape: Tuple[int, ...], name: str) -> Tuple[Payload, Any]:
        """(payload, pending) of a deferred kernel's lane sums and sign bits.

        Raises:
            NonFiniteGradientError: a side's mean is not finite.
        """
        n = math.prod(shape)
        scales = _means(kq.combine_lanes(acc[0]), kq.combine_lanes(acc[1]), int(n_neg), n)
        ops.check_finite(scales[0], name, "non-negative mean")
        ops.check_finite(scales[1], name, "negative mean")
        dt = np.dtype(dtype).type
        return (Payload(self.codec_id, dtype, shape, (bits, scales)),
                (bits, dt(scales[0]), dt(scales[1])))

    def settle_residual(self, state: Any, pending: Any) -> None:
        """``state -= v1 if bit else v0`` for each element, in place (one pass)."""
        bits, v0, v1 = pending
        kq.fast_kernels().onebit_settle(bits, v0, v1, state.reshape(-1))

    def decode_add(self, payload: Payload, acc: Any) -> None:
        """``acc += decode(payload)`` in one pass (NumPy, payload dtype = acc dtype)."""
        fast = _fast_decode(self, payload, acc)
        if fast is None:
            return super().decode_add(payload, acc)
        bits, scales = payload.sections
        dt = acc.dtype.type
        fast.decode_1bit_add(bits, dt(scales[0]), dt(scales[1]), acc)

    def decode_into(self, payload: Payload, out: Any, divisor: int = 1) -> None:
        """Decode straight into ``out``, both values divided once (NumPy, same dtype)."""
        fast = _fast_decode(self, payload, out)
        if fast is None:
            return super().decode_into(payload, out, divisor)
        bits, scales = payload.sections
        dt = out.dtype.type
        fast.decode_1bit(bits, dt(scales[0]) / dt(divisor), dt(scales[1]) / dt(divisor), out)


def _readonly(a: np.ndarray) -> np.ndarray:
    """Return a read-only view of ``a`` (one Numba signature whatever the source)."""
    v = a.view()
    v.flags.writeable = False
    return v


def _fast_same_dtype(codec: Codec, x: Any, residual: Any) -> Any:
    """Return the Numba kernels if ``x`` and ``residual`` can take the fused path."""
    if (not codec.use_fast_path or type(x) is not np.ndarray or type(residual) is not np.ndarray
            or x.dtype not in (np.float32, np.float64) or residual.dtype != x.dtype
            or x.shape != residual.shape or not x.flags.c_contiguous
            or not residual.flags.c_contiguous):
        return None
    return kq.fast_kernels()


def _fast_decode(codec: Codec, payload: Payload, out: Any) -> Any:
    """Return the Numba kernels if ``payload`` can be decoded straight into ``out``."""
    if (not codec.use_fast_path or payload.codec_id != codec.codec_id
            or type(out) is not np.ndarray or out.dtype not in (np.float32, np.float64)
            or np.dtype(payload.dtype) != out.dtype or out.ndim != 1
            or not out.flags.c_contiguous or payload.numel != out.size or out.size == 0
            or type(payload.sections[0]) is not np.ndarray):
        return None
    codec._check_sections(payload)
    return kq.fast_kernels()
