"""Gradient Dropping: keep the elements above a sampled magnitude threshold.

Aji & Heafield, "Sparse Communication for Distributed Gradient Descent", EMNLP 2017: drop
the ``drop_ratio`` fraction of smallest-magnitude elements (99% by default) and keep the
rest in a residual that is added to the next gradient. The threshold is estimated from a
small sample (the paper samples 0.1%) instead of sorting the gradient, so the number of
kept elements is close to, not exactly, ``k = (1 - drop_ratio) * n`` and payloads differ in
size across ranks (``variable_size``: the engine gathers them).

Wire layout (variable size, at most ``bound = min(n, 2k)`` entries)::

    section 0: indices, int32 (int64 when n >= 2**31), m <= bound elements, ascending
    section 1: values,  the gradient's dtype,           m elements, bit-for-bit copies

This module also holds what DGC shares: :func:`threshold_indices`, the sampled-threshold
selection, and :class:`ThresholdSparsifier`, the codec body of both (they differ only in
how k is computed).

NaN/Inf policy: NaN and ±Inf have the largest magnitude keys and are always selected (see
:func:`threshold_indices`); the codec checks the largest selected magnitude and raises
:class:`~hipress.errors.NonFiniteGradientError` naming the gradient.
"""

from __future__ import annotations

import abc
import logging
import math
from typing import Any, Dict, Sequence, Tuple

import numpy as np

from hipress.backend import array_module
from hipress.codecs import ops
from hipress.codecs.base import Codec, Layout, register_codec
from hipress.codecs.state import StepCounterMixin, check_seed
from hipress.codecs.topk import (
    check_selected_finite,
    decode_sparse,
    index_dtype,
    magnitude_key,
    sampled_key_threshold,
    select_ge,
    topk_indices,
)
from hipress.errors import CodecError

logger = logging.getLogger(__name__)

#: A threshold selection may keep up to OVERSELECT * k elements; beyond that it falls back
#: to the exact top-k of what it selected. This factor is also the payload's size bound.
OVERSELECT = 2
#: Smallest sample drawn for a threshold; gradients this small or smaller are exact.
MIN_SAMPLE = 4096


def sample_size_for(n: int, sample_ratio: float) -> int:
    """Return the threshold sample size: clamp(ceil(sample_ratio * n), MIN_SAMPLE, n)."""
    return min(n, max(int(math.ceil(sample_ratio * n)), MIN_SAMPLE))


def selection_bound(k: int, n: int) -> int:
    """Return the most elements a threshold selection keeps: min(n, OVERSELECT * k)."""
    return min(n, OVERSELECT * k)


def threshold_indices(flat: Any, k: int, sample_size: int, rng: Any) -> Any:
    """Select about ``k`` of the largest-magnitude elements with a sampled threshold.

    Algorithm (DGC, Lin et al. ICLR 2018 section 3; GradDrop, Aji & Heafield 2017):
        1. If ``sample_size >= n``, return the exact top-k (:func:`topk_indices`).
        2. ``t`` = the ks-th largest magnitude key of ``sample_size`` elements drawn
           uniformly, ks = round(k / n * sample_size) (:func:`sampled_key_threshold`, the
           estimator of :func:`ops.sampled_threshold`). The expected fraction of elements
           at or above ``t`` is k/n, with relative spread about 1/sqrt(ks).
        3. Select the elements whose magnitude key is >= max(t, 1) (:func:`select_ge`:
           ``flatnonzero`` or a one-pass Numba kernel). ``t`` is raised to 1 so zeros never
           qualify: an all-zero gradient sends nothing instead of everything.
        4. If more than ``OVERSELECT * k`` qualify (many ties, or an unlucky sample), keep
           the exact top-k among them, so the count never exceeds the bound.

    The selection always includes the largest magnitude (``t`` is a sampled key), hence
    every NaN and Inf (their keys are the largest).

    Args:
        flat: 1-D gradient array of n elements.
        k: target count, 1 <= k <= n.
        sample_size: elements sampled for the threshold.
        rng: generator from :func:`ops.rng_for`.

    Returns:
        Ascending int positions, 0 <= count <= min(n, OVERSELECT * k) (0 only for an
        all-zero gradient).
    """
    n = int(flat.size)
    if sample_size >= n:
        return topk_indices(magnitude_key(flat), k)
    t = max(int(sampled_key_threshold(flat, k, sample_size, rng)), 1)
    bound = selection_bound(k, n)
    idx = select_ge(flat, t, bound)
    if idx is None:
        sel = select_ge(flat, t, n)
        logger.debug("threshold kept %d > %d of %d; exact top-%d of those", sel.size, bound,
                     n, k)
        idx = sel[topk_indices(magnitude_key(flat[sel]), k)]
    return idx


def check_sample_ratio(sample_ratio: float, what: str) -> float:
    """Return ``sample_ratio`` as a float if 0 < sample_ratio <= 1.

    Raises:
        CodecError: outside (0, 1]; the message gives the valid range.
    """
    return ops.check_ratio(sample_ratio, what)


class ThresholdSparsifier(StepCounterMixin, Codec):
    """Base of the sampled-threshold sparsifiers (DGC, GradDrop): they differ only in k.

    Encode keeps about k = :meth:`k_for` (n) elements, selected by
    :func:`threshold_indices` from a sample of ``sample_size_for(n, sample_ratio)``
    elements drawn from ``ops.rng_for(seed, name, step)`` (step: a per-gradient counter,
    checkpointed flat as ``{name: step}``), and refuses a non-finite largest selected
    magnitude. The wire layout is the module's (indices, then values, at most
    ``selection_bound(k, n)`` each); decode scatters the values into zeros.

    Subclasses set ``seed`` and ``sample_ratio``, call :meth:`_init_steps` and define
    :meth:`k_for`.
    """

    variable_size = True
    stochastic = True
    error_feedback = True
    #: A sum of sparse payloads is denser than one payload: the engine gathers them.
    mergeable = False
    sparse_payload = True
    #: the kept values travel in the gradient's dtype; the CompLL kernels send float32
    #: values, so only float32 gradients run them
    device_dtypes = ("float32",)

    seed: int
    sample_ratio: float

    @abc.abstractmethod
    def k_for(self, n: int) -> int:
        """Return the target number of kept elements out of ``n``."""

    def _layout(self, shape: Tuple[int, ...], dtype: np.dtype) -> Layout:
        n = int(np.prod(shape, dtype=np.int64))
        bound = selection_bound(self.k_for(n), n)
        return [(index_dtype(n), bound), (dtype, bound)]

    def _encode(self, flat: Any, shape: Tuple[int, ...], name: str) -> Sequence[Any]:
        xp = array_module(flat)
        n = int(flat.size)
        rng = ops.rng_for(xp, self.seed, name, self._next_step(name))
        idx = threshold_indices(flat, self.k_for(n), sample_size_for(n, self.sample_ratio),
                                rng)
        idx, values = ops.sparsify(flat, idx)
        check_selected_finite(values, name)
        return [idx, values]

    def _decode(self, sections: Sequence[Any], shape: Tuple[int, ...], dtype: np.dtype) -> Any:
        return decode_sparse(sections, int(np.prod(shape, dtype=np.int64)), dtype)


@register_codec("graddrop", codec_id=23)
class GradDropCodec(ThresholdSparsifier):
    """Drop the ``drop_ratio`` smallest-magnitude elements, found by a sampled threshold.

    Gradient Dropping (Aji & Heafield, EMNLP 2017), with residual error feedback: what is
    dropped is added to the next gradient by the engine's ``"residual"`` memory.

    Algorithm (encode):
        1. k = ops.k_for_ratio(1 - drop_ratio, n); bound = min(n, 2k).
        2. idx = threshold_indices(g, k, sample_size, rng) with
           sample_size = clamp(ceil(sample_ratio * n), 4096, n) and rng =
           ops.rng_for(seed, name, step) (step = per-gradient counter).
        3. values = g[idx]; raise if the largest selected magnitude is not finite.

    Wire layout: section 0 indices (int32; int64 if n >= 2**31, m <= bound, ascending);
    section 1 values (gradient dtype, m).

    Args:
        drop_ratio: fraction of elements dropped, in (0, 1) (paper: 0.99).
        sample_ratio: fraction of elements sampled for the threshold, in (0, 1]
            (paper: 0.001; at least 4096 elements are sampled).
        seed: seed of the sampling stream.

    Raises:
        CodecError: a parameter is out of range.
    """

    device_kernels = "graddrop"

    def __init__(self, drop_ratio: float = 0.99, sample_ratio: float = 0.001,
                 seed: int = 0) -> None:
        try:
            d = float(drop_ratio)
        except (TypeError, ValueError):
            d = float("nan")
        if not (0.0 < d < 1.0):
            raise CodecError(
                f"graddrop drop_ratio must be in (0, 1) (fraction of elements dropped, e.g. "
                f"0.99), got {drop_ratio!r}"
            )
        self.drop_ratio = d
        self.sample_ratio = check_sample_ratio(sample_ratio, "graddrop sample_ratio")
        self.seed = check_seed(seed, "graddrop")
        self._init_steps()

    def params(self) -> Dict[str, Any]:
        """Return the constructor parameters."""
        return {"drop_ratio": self.drop_ratio, "sample_ratio": self.sample_ratio,
                "seed": self.seed}

    def k_for(self, n: int) -> int:
        """Return the target number of kept elements out of ``n``."""
        # round() keeps 1 - 0.9 at 0.1 rather than 0.09999999999999998 (k of 100 is 10).
        return ops.k_for_ratio(round(1.0 - self.drop_ratio, 12), n)
