"""What the engine asks a planner per gradient, and its answer when nothing plans.

The engine decides per compressed gradient whether to compress it, into how many
partitions and on which path. Without a plan (``sync.plan: none``) it follows
:class:`FixedPolicy`; with one, a :class:`GradientPlanner` given at construction answers
(SeCoPa's :class:`hipress.secopa.runtime.PlanFollower`, which ``hipress.init`` builds).
This module sits below both, so the engine never imports SeCoPa while SeCoPa's profiler
drives the engine's task graphs.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple, Optional, Protocol

from hipress.codecs import Codec


class Decision(NamedTuple):
    """A planner's answer for one gradient.

    Attributes:
        compress: False sends the gradient uncompressed (fused).
        partitions: K >= 1, the partitions of CaSync-PS and CaSync-Ring (other paths
            ignore it: gather is cut by ``sync.partition_bytes`` as without a plan).
        strategy: the path to take (ps, ring, allreduce, gather), or the strategy asked
            for, unchanged, when not compressing or following the fixed policy.
    """

    compress: bool
    partitions: int
    strategy: str


class GradientPlanner(Protocol):
    """The interface the engine plans through (one per engine, on every rank)."""

    #: True when the planner decides instead of the fixed policy (the engine then skips
    #: its own ``compression.min_compress_bytes`` check)
    active: bool

    def setup(self) -> None:
        """Prepare (collective: every rank calls it once, before the engine thread runs)."""

    def decide(self, name: str, array: Any, codec: Optional[Codec],
               strategy: Optional[str]) -> Decision:
        """Return the :class:`Decision` for one submitted gradient (same on every rank)."""

    def step_done(self, engine: Any) -> None:
        """Called by :meth:`Engine.step` on every rank after each training step.

        ``engine.step_count`` is this rank's number of steps finished (a checkpoint
        loaded on some ranks only makes it differ between ranks; the calls themselves
        come alike on every rank). A planner may run the engine's collectives here and
        change its decisions from the next step on.
        """


class FixedPolicy:
    """The engine's policy without a plan.

    Compress gradients of at least ``compression.min_compress_bytes`` bytes, in
    ``sync.partitions`` partitions or, when that is 0, ``ceil(bytes /
    sync.partition_bytes)``, with the strategy asked for.

    Args:
        cfg: the :class:`hipress.config.HiPressConfig`.
    """

    active = False

    def __init__(self, cfg: Any) -> None:
        self.cfg = cfg

    def setup(self) -> None:
        """Nothing to prepare."""

    def step_done(self, engine: Any) -> None:
        """Nothing changes between steps."""

    def decide(self, name: str, array: Any, codec: Optional[Codec],
               strategy: Optional[str]) -> Decision:
        """Apply the policy to ``array`` (its ``size`` and ``dtype.itemsize`` are used)."""
        strategy = strategy or self.cfg.sync.strategy
        if codec is None or codec.name == "none":
            return Decision(False, 1, strategy)
        return self.by_size(array, strategy)

    def by_size(self, array: Any, strategy: str) -> Decision:
        """The policy's size rule for a gradient that has a codec."""
        numel = int(array.size)
        nbytes = numel * int(getattr(getattr(array, "dtype", None), "itemsize", 4) or 4)
        if nbytes < self.cfg.compression.min_compress_bytes:
            return Decision(False, 1, strategy)
        sync = self.cfg.sync
        parts = int(sync.partitions) if sync.partitions else max(
            1, math.ceil(nbytes / sync.partition_bytes))
        return Decision(True, parts, strategy)
