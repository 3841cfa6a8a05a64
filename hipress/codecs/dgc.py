"""Deep Gradient Compression: top-k by a sampled threshold, with momentum correction.

Lin, Han, Mao, Wang & Dally, "Deep Gradient Compression: Reducing the Communication
Bandwidth for Distributed Training", ICLR 2018. Each rank sends only the ~0.1% largest
elements of its accumulated gradient. The threshold is estimated from a sample (section 3:
"we sample only 0.1% to 1% of the gradients"), which is what makes DGC fast: on these
machines exact top-0.1% with argpartition runs at 0.3 GB/s, a sampled threshold plus
``flatnonzero`` at 4.4 GB/s.

The paper's other parts live in the memory, not in this codec: momentum correction,
accumulation, momentum factor masking and local gradient clipping are
:class:`hipress.memory.dgc.DGCMemory` (``memory: dgc``). The codec only carries their
parameters (``momentum``, ``clip_norm``) so a job configures DGC in one place; the engine
builds the memory from :meth:`DGCCodec.memory_params` plus the world size (clipping scales
the threshold by N^-1/2, section 3.2). Warm-up training (sparsity ramped from 75% to
99.9% over the first epochs) is a schedule of ``ratio`` and is left to the job.

Wire layout (variable size, at most ``bound = min(n, 2k)`` entries, k = ratio * n)::

    section 0: indices, int32 (int64 when n >= 2**31), m <= bound elements, ascending
    section 1: values,  the gradient's dtype,           m elements, bit-for-bit copies

NaN/Inf policy: NaN and ±Inf have the largest magnitude keys and are always selected; the
codec checks the largest selected magnitude and raises
:class:`~hipress.errors.NonFiniteGradientError` naming the gradient.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar, Dict, Optional

from hipress.codecs import ops
from hipress.codecs.base import register_codec
from hipress.codecs.graddrop import ThresholdSparsifier, check_sample_ratio
from hipress.codecs.state import check_seed
from hipress.errors import CodecError


def check_momentum(momentum: Any, what: str) -> float:
    """Return ``momentum`` as a float if 0 <= momentum < 1.

    Raises:
        CodecError: outside [0, 1); the message gives the valid range.
    """
    try:
        m = float(momentum)
    except (TypeError, ValueError):
        m = float("nan")
    if not (0.0 <= m < 1.0):
        raise CodecError(f"{what} momentum must be in [0, 1) (e.g. 0.9), got {momentum!r}")
    return m


def check_clip_norm(clip_norm: Any, what: str) -> Optional[float]:
    """Return ``clip_norm`` as a float (finite, > 0) or None (no clipping).

    Raises:
        CodecError: not None and not a finite number > 0.
    """
    if clip_norm is None:
        return None
    try:
        c = float(clip_norm)
    except (TypeError, ValueError):
        c = float("nan")
    if not (c > 0.0) or not math.isfinite(c):
        raise CodecError(
            f"{what} clip_norm must be None (no clipping) or a finite number > 0, got "
            f"{clip_norm!r}"
        )
    return c


@register_codec("dgc", codec_id=22)
class DGCCodec(ThresholdSparsifier):
    """Send about ``ratio * n`` largest-magnitude elements, chosen by a sampled threshold.

    The codec half of Deep Gradient Compression (Lin et al., ICLR 2018). Run it with the
    ``"dgc"`` memory (momentum correction, momentum factor masking, local clipping; see
    :mod:`hipress.memory.dgc`) and an optimizer *without* momentum, since the memory
    applies it before compression. With the ``"residual"`` memory it is plain threshold
    sparsification with error feedback.

    Algorithm (encode; g is the memory's accumulated velocity v):
        1. k = ops.k_for_ratio(ratio, n); bound = min(n, 2k).
        2. sample_size = clamp(ceil(sample_ratio * n), 4096, n); if it is n, the exact
           top-k; else the threshold t = the (1 - k/n) quantile of the sample's magnitudes
           (drawn with ops.rng_for(seed, name, step), step = a per-gradient counter), and
           the selection ``flatnonzero(|g| >= t)`` (see
           :func:`hipress.codecs.graddrop.threshold_indices`).
        3. If the selection exceeds bound = 2k, keep the exact top-k among it (section 3:
           "if the number of selected gradients exceeds the target much, exact top-k is
           performed on the selected"). The expected count is k with relative spread
           about 1/sqrt(ks), ks = round(k / n * sample_size) (10 for 1M elements at the
           defaults, so the count stays within [k/3, 2k] in all but ~0.3% of steps).
        4. values = g[idx]; raise if the largest selected magnitude is not finite.

    Wire layout: section 0 indices (int32; int64 if n >= 2**31, m <= bound, ascending);
    section 1 values (gradient dtype, m).

    Args:
        ratio: target fraction of elements sent, in (0, 1] (paper: 0.001).
        sample_ratio: fraction of elements sampled for the threshold, in (0, 1]
            (paper: 0.001 to 0.01; at least 4096 elements are sampled).
        momentum: momentum of the ``"dgc"`` memory's correction, in [0, 1) (0.9).
        clip_norm: local gradient clipping of the ``"dgc"`` memory: each rank clips its
            gradient to L2 norm ``clip_norm * N**-0.5`` (N ranks) before accumulating
            (section 3.2); None disables it.
        seed: seed of the sampling stream.

    Raises:
        CodecError: a parameter is out of range.
    """

    #: Memory the engine should pair with this codec under ``memory: auto``.
    default_memory: ClassVar[str] = "dgc"
    device_kernels = "dgc"
    device_params_skip = ("momentum", "clip_norm")

    def __init__(self, ratio: float = 0.001, sample_ratio: float = 0.01, momentum: float = 0.9,
                 clip_norm: Optional[float] = None, seed: int = 0) -> None:
        self.ratio = ops.check_ratio(ratio, "dgc ratio")
        self.sample_ratio = check_sample_ratio(sample_ratio, "dgc sample_ratio")
        self.momentum = check_momentum(momentum, "dgc")
        self.clip_norm = check_clip_norm(clip_norm, "dgc")
        self.seed = check_seed(seed, "dgc")
        self._init_steps()

    def params(self) -> Dict[str, Any]:
        """Return the constructor parameters."""
        return {"ratio": self.ratio, "sample_ratio": self.sample_ratio,
                "momentum": self.momentum, "clip_norm": self.clip_norm, "seed": self.seed}

    def memory_params(self) -> Dict[str, Any]:
        """Return the ``"dgc"`` memory's parameters (the engine adds ``world_size``)."""
        return {"momentum": self.momentum, "clip_norm": self.clip_norm}

    def k_for(self, n: int) -> int:
        """Return the target number of sent elements out of ``n``."""
        return ops.k_for_ratio(self.ratio, n)
