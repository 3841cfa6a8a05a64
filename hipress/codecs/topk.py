"""Top-k sparsification: send the k largest-magnitude elements exactly.

Top-k keeps the ``k = clamp(floor(ratio * n), 1, n)`` elements of largest magnitude and
drops the rest; with residual error feedback the dropped mass is sent later (Stich,
Cordonnier & Jaggi, "Sparsified SGD with Memory", NeurIPS 2018; Aji & Heafield, EMNLP 2017;
GRACE's ``compressor/topk.py``). The selection is exact: ties at the k-th magnitude are
broken arbitrarily but deterministically.

Wire layout (fixed size, ``k`` is known from the shape and ``ratio``)::

    section 0: indices, int32 (int64 when n >= 2**31), k elements, ascending
    section 1: values,  the gradient's dtype,           k elements, bit-for-bit copies

This module also holds the helpers the threshold sparsifiers (DGC, GradDrop) share:
:func:`magnitude_key`, an integer key that orders elements by magnitude;
:func:`sampled_key_threshold`, the sampled threshold on such keys; :func:`select_ge`, the
selection above a threshold (a one-pass Numba kernel on NumPy arrays); and
:func:`topk_indices`, exact top-k over keys.

NaN/Inf policy: NaN and ±Inf have the largest magnitude keys, so a gradient holding one
always has it among the selected elements; the codec checks the largest selected magnitude
and raises :class:`~hipress.errors.NonFiniteGradientError` naming the gradient. The check
costs O(k), not a pass over the gradient.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Dict, Optional, Sequence, Tuple

import numpy as np

from hipress.backend import array_module
from hipress.codecs import ops
from hipress.codecs.base import Codec, Layout, register_codec

logger = logging.getLogger(__name__)

_UINT_OF_SIZE = {2: np.dtype(np.uint16), 4: np.dtype(np.uint32), 8: np.dtype(np.uint64)}

#: Below this many elements top-k runs one argpartition over the whole gradient.
PREFILTER_MIN_NUMEL = 65536
#: The sampled prefilter is used only while k <= n / PREFILTER_MAX_FRACTION.
PREFILTER_MAX_FRACTION = 8
#: Elements sampled by the prefilter: max(n / PREFILTER_SAMPLE_DIVISOR, PREFILTER_MIN_SAMPLE).
PREFILTER_SAMPLE_DIVISOR = 128
PREFILTER_MIN_SAMPLE = 4096


def index_dtype(n: int) -> np.dtype:
    """Return the dtype of sparse indices into ``n`` elements: int32, or int64 if n >= 2**31."""
    return np.dtype(np.int32) if n < 2**31 else np.dtype(np.int64)


def magnitude_key(flat: Any) -> Any:
    """Return unsigned integer keys ordered exactly like the magnitudes of ``flat``.

    A float's bit pattern with the sign bit cleared, read as an unsigned integer, orders
    non-negative floats exactly like their values (IEEE 754 is sign-magnitude with a biased
    exponent), and puts +Inf above every finite value and NaN above +Inf. One pass, exact for
    float16, bfloat16, float32 and float64, and identical on NumPy and CuPy.

    Args:
        flat: 1-D array of a floating gradient dtype (n elements).

    Returns:
        uint16/uint32/uint64 array of n keys (same item size as ``flat``); a new array.
    """
    udt = _UINT_OF_SIZE[flat.dtype.itemsize]
    return flat.view(udt) & _sign_mask(udt)


def _sign_mask(udt: np.dtype) -> Any:
    return udt.type((1 << (8 * udt.itemsize - 1)) - 1)


def sampled_key_threshold(flat: Any, k: int, sample_size: int, rng: Any) -> Any:
    """Estimate the magnitude key above which about ``k`` of ``flat``'s n elements lie.

    The estimator of :func:`ops.sampled_threshold` (DGC, Lin et al. ICLR 2018 section 3;
    GradDrop, Aji & Heafield 2017): draw ``sample_size`` positions uniformly with
    ``rng.integers(0, n, size=sample_size)`` and return the ks-th largest sampled key,
    ks = max(1, round(k / n * sample_size)). Keys are computed for the sample only (no
    n-element array), and the result stays an exact key (no float rounding of uint64 keys).

    Args:
        flat: 1-D gradient array of n elements.
        k: elements wanted above the threshold, 1 <= k <= n.
        sample_size: positions sampled (with replacement), >= 1.
        rng: generator from :func:`ops.rng_for` (NumPy or CuPy, like ``flat``).

    Returns:
        The threshold as a scalar of :func:`magnitude_key`'s dtype.
    """
    xp = array_module(flat)
    n = int(flat.size)
    sample = magnitude_key(flat[rng.integers(0, n, size=sample_size)])
    ks = max(1, int(round(k / n * sample_size)))
    t = xp.partition(sample, sample_size - ks)[sample_size - ks]
    return sample.dtype.type(int(t))


def select_ge(flat: Any, t: Any, cap: int) -> Optional[Any]:
    """Return the ascending positions whose :func:`magnitude_key` is >= ``t``.

    The NumPy/CuPy reference is ``flatnonzero(magnitude_key(flat) >= t)`` (two passes and
    an n-element key array). On NumPy arrays a Numba kernel does the same in one pass
    without the key array, writing at most ``cap`` positions (4-5x faster on these
    machines).

    Args:
        flat: 1-D gradient array of n elements.
        t: threshold key (a :func:`magnitude_key` dtype scalar or int).
        cap: the most positions the caller accepts.

    Returns:
        1-D int array of the positions (int32 from the kernel, intp from the reference),
        or None when more than ``cap`` elements qualify.
    """
    udt = _UINT_OF_SIZE[flat.dtype.itemsize]
    t = udt.type(int(t))
    kernel = _select_kernel() if type(flat) is np.ndarray else None
    if kernel is not None:
        n = int(flat.size)
        out = np.empty(min(cap, n), dtype=index_dtype(n))
        m = kernel(flat.view(udt), _sign_mask(udt), t, out)
        return out[:m] if m <= cap else None
    xp = array_module(flat)
    idx = xp.flatnonzero(magnitude_key(flat) >= t)
    return idx if idx.size <= cap else None


def topk_indices(key: Any, k: int) -> Any:
    """Return the ascending positions of the ``k`` largest entries of ``key`` (exact).

    One partition over all n keys finds the k-th key; every position above it is kept and
    ties at it are broken by position (lowest first), so CPU and GPU select the same set.
    Positions come back ascending (canonical payloads, cache-friendly gathers).

    Args:
        key: 1-D array of n comparable keys (usually :func:`magnitude_key`).
        k: number of entries wanted, k >= 1.

    Returns:
        1-D int array (int32 if n < 2**31) of min(k, n) ascending positions on ``key``'s
        device.
    """
    xp = array_module(key)
    n = int(key.size)
    if k >= n:
        return xp.arange(n)
    return _top_lowest_ties(key, k).astype(index_dtype(n))


def _top_lowest_ties(key: Any, k: int) -> Any:
    """Return ascending positions of the k largest keys; ties at the k-th: lowest first."""
    xp = array_module(key)
    m = int(key.size)
    kth = xp.partition(key, m - k)[m - k]
    mask = key > kth
    ties = xp.flatnonzero(key == kth)[: k - int(mask.sum())]
    mask[ties] = True
    return xp.flatnonzero(mask)


def topk_positions(flat: Any, k: int, rng: Optional[Any] = None) -> Any:
    """Return the ascending positions of the ``k`` largest magnitudes of ``flat`` (exact).

    Algorithm:
        1. If k >= n, return every position.
        2. If ``rng`` is given, n >= PREFILTER_MIN_NUMEL and k <= n / 8, prefilter: ``t`` =
           :func:`sampled_key_threshold` for 2k elements (at least 1, so zeros never
           qualify), candidates = :func:`select_ge` (``flat``, t), at most n / 4 of them.
           If there are at least k candidates, the k-th largest key is >= t, so every
           top-k element is a candidate and the exact top-k of the candidates (an
           argpartition over ~2k keys) is the exact top-k of ``flat``.
        3. Otherwise (prefilter off, or it caught fewer than k or more than n / 4),
           :func:`topk_indices` over all n keys.

    Args:
        flat: 1-D gradient array of n elements.
        k: number of elements wanted, k >= 1.
        rng: generator for the prefilter's sample (:func:`ops.rng_for`); None disables it.
            The result does not depend on what it draws, except for the choice among ties.

    Returns:
        1-D int array of min(k, n) ascending positions on ``flat``'s device.
    """
    xp = array_module(flat)
    n = int(flat.size)
    if k >= n:
        return xp.arange(n)
    if rng is not None and n >= PREFILTER_MIN_NUMEL and k * PREFILTER_MAX_FRACTION <= n:
        sample = max(n // PREFILTER_SAMPLE_DIVISOR, PREFILTER_MIN_SAMPLE)
        t = max(int(sampled_key_threshold(flat, 2 * k, sample, rng)), 1)
        cand = select_ge(flat, t, n // 4)
        if cand is not None and cand.size >= k:
            m = int(cand.size)
            if m == k:
                return cand
            # cand is ascending, so lowest candidate position = lowest gradient position
            return cand[_top_lowest_ties(magnitude_key(flat[cand]), k)]
        logger.debug("top-k prefilter caught %s candidates for k=%d of %d; exact pass",
                     "too many" if cand is None else cand.size, k, n)
    return topk_indices(magnitude_key(flat), k)


# ------------------------------------------------------------------ Numba kernel
_KERNEL: Optional[Any] = None
_KERNEL_TRIED = False
_KERNEL_LOCK = threading.Lock()
#: Set to False to force the NumPy reference (tests compare both).
use_numba = True


def _select_kernel() -> Optional[Any]:
    """Return the compiled selection kernel, or None (Numba missing or disabled).

    Numba is imported on first use, never at module import; the kernel compiles once per
    key dtype and is cached on disk.
    """
    global _KERNEL, _KERNEL_TRIED
    if not use_numba:
        return None
    if _KERNEL_TRIED:
        return _KERNEL
    with _KERNEL_LOCK:
        if not _KERNEL_TRIED:
            try:
                _KERNEL = _build_kernel()
            except ImportError as exc:  # pragma: no cover - numba is a dependency
                logger.info("numba unavailable (%s); sparsifiers use NumPy", exc)
                _KERNEL = None
            _KERNEL_TRIED = True
    return _KERNEL


def _build_kernel() -> Any:
    import numba

    @numba.njit(cache=True, nogil=True, boundscheck=False)
    def select_ge_kernel(bits, mask, t, out):  # pragma: no cover - compiled
        # Same maths as flatnonzero((bits & mask) >= t); writes the first len(out) hits
        # and returns the total count.
        m = 0
        cap = out.size
        for i in range(bits.size):
            if (bits[i] & mask) >= t:
                if m < cap:
                    out[m] = i
                m += 1
        return m

    return select_ge_kernel


def check_selected_finite(values: Any, name: str) -> None:
    """Raise NonFiniteGradientError if a selected value is NaN or Inf (O(k) check).

    Valid as a check of the whole gradient when the selection always includes the largest
    magnitude keys, which every sparsifier here guarantees (NaN/Inf have the largest keys).
    """
    if values.size:
        xp = array_module(values)
        ops.check_finite(float(xp.abs(values).max()), name, "largest selected magnitude")


def decode_sparse(sections: Sequence[Any], n: int, dtype: np.dtype) -> Any:
    """Scatter an (indices, values) payload into a dense array of ``n`` ``dtype`` zeros.

    Raises:
        PayloadError: the sections differ in length, or an index is outside [0, n).
    """
    idx, values = sections
    return ops.desparsify(idx, values, n, dtype)


@register_codec("topk", codec_id=20)
class TopKCodec(Codec):
    """Send the ``k = clamp(floor(ratio * n), 1, n)`` largest-magnitude elements.

    Exact top-k (Stich et al., NeurIPS 2018; GRACE's top-k), biased, so it runs with
    residual error feedback. Selection follows :func:`topk_positions`: a sampled
    prefilter narrows the candidates and an argpartition over them gives the exact
    answer, instead of an argpartition over all n elements.

    Algorithm (encode):
        1. k = ops.k_for_ratio(ratio, n).
        2. idx = topk_positions(g, k) (ascending): a sampled prefilter, then an exact
           argpartition over the ~2k candidates.
        3. values = g[idx] (bit-for-bit); raise if the largest selected magnitude is
           not finite (NaN/Inf would be selected first).
    Decode scatters the values at the indices into zeros.

    Wire layout: section 0 indices (int32; int64 if n >= 2**31, k, ascending);
    section 1 values (gradient dtype, k).

    Args:
        ratio: fraction of elements kept, in (0, 1]; k is clamped to [1, n].

    Raises:
        CodecError: ``ratio`` is outside (0, 1].
    """

    error_feedback = True
    #: A sum of sparse payloads is denser than one payload: the engine gathers them.
    mergeable = False
    sparse_payload = True

    def __init__(self, ratio: float = 0.01) -> None:
        self.ratio = ops.check_ratio(ratio, "topk ratio")

    def params(self) -> Dict[str, Any]:
        """Return the constructor parameters."""
        return {"ratio": self.ratio}

    def k_for(self, n: int) -> int:
        """Return the number of elements kept out of ``n``."""
        return ops.k_for_ratio(self.ratio, n)

    def _layout(self, shape: Tuple[int, ...], dtype: np.dtype) -> Layout:
        n = int(np.prod(shape, dtype=np.int64))
        k = self.k_for(n)
        return [(index_dtype(n), k), (dtype, k)]

    def _encode(self, flat: Any, shape: Tuple[int, ...], name: str) -> Sequence[Any]:
        xp = array_module(flat)
        n = int(flat.size)
        k = self.k_for(n)
        # The prefilter's sample only speeds the search up; the result is exact whatever
        # it draws, so a fixed stream per gradient keeps the codec deterministic.
        rng = ops.rng_for(xp, 0, name, 0) if n >= PREFILTER_MIN_NUMEL else None
        idx = topk_positions(flat, k, rng)
        idx, values = ops.sparsify(flat, idx)
        check_selected_finite(values, name)
        return [idx, values]

    def _decode(self, sections: Sequence[Any], shape: Tuple[int, ...], dtype: np.dtype) -> Any:
        return decode_sparse(sections, int(np.prod(shape, dtype=np.int64)), dtype)
