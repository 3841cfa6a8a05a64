"""Per-gradient step counters and seed checks shared by the stochastic codecs.

A stochastic codec draws its random numbers from a stream keyed by (seed, gradient name,
step), where ``step`` counts the encodes of that gradient. Every rank must agree on the
counters, and a checkpoint must carry them so that a resumed job continues the same
streams (PyTorch's ``PowerSGDState`` keeps its RNG state for the same reason).
:class:`StepCounterMixin` is the one implementation of those counters;
:class:`SeededStreamMixin` adds the rank and the counter-based stream key of
:mod:`hipress.codecs._kernels_quant` (TernGrad, QSGD).

Checkpoint layouts (fixed per codec, so existing checkpoints stay loadable):

- ``steps_key = None`` (random-k, DGC, GradDrop): ``{gradient name: next step}``;
- ``steps_key = "steps"`` (TernGrad, QSGD, CompLL codecs):
  ``{"steps": {gradient name: next step}}``.
"""

from __future__ import annotations

import numbers
import threading
from typing import Any, ClassVar, Dict, Optional

import numpy as np

from hipress.codecs import _kernels_quant as kq
from hipress.errors import CodecError


def check_seed(seed: Any, what: str, bits: Optional[int] = None) -> int:
    """Return ``seed`` as an int, optionally checking it lies in [0, 2**bits).

    Args:
        seed: the seed given to a codec.
        what: what the seed belongs to, for the message (e.g. ``"dgc"``).
        bits: if set, the seed must be in [0, 2**bits) (32 for the counter-based streams).

    Returns:
        The seed as a Python int.

    Raises:
        CodecError: ``seed`` is not an integer (bools are refused), or out of range.
    """
    where = f" in [0, 2**{bits})" if bits is not None else ""
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise CodecError(f"{what} seed must be an integer{where}, got {seed!r}")
    if bits is not None and not 0 <= int(seed) < 2**bits:
        raise CodecError(f"{what} seed must be an integer{where}, got {seed!r}")
    return int(seed)


def check_step(name: Any, value: Any) -> int:
    """Return one checkpointed step counter as an int.

    Args:
        name: the gradient name the counter belongs to (for the message).
        value: an integer >= 0 (Python or NumPy, a 0-d array included).

    Returns:
        The step as a Python int.

    Raises:
        CodecError: ``value`` is not a non-negative integer.
    """
    if isinstance(value, np.ndarray) and value.ndim == 0:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise CodecError(
            f"step counter of {name!r} must be a non-negative integer, got {value!r} "
            "(was the checkpoint made by another codec?)"
        )
    return int(value)


class StepCounterMixin:
    """Per-gradient step counters that key random streams, checkpointed by :meth:`state_dict`.

    Each encode of gradient ``name`` takes step ``k`` (0, 1, 2, ...) and advances it, so
    repeated encodes draw fresh numbers and a checkpoint that restores the counters resumes
    the same streams. The counters are guarded by a lock (the engine encodes from several
    threads); the lock is dropped when pickled and recreated when unpickled.

    Subclasses call :meth:`_init_steps` in ``__init__`` and set ``steps_key`` to choose the
    checkpoint layout (see the module docstring).
    """

    #: Key under which :meth:`state_dict` nests the counters; None keeps them flat.
    steps_key: ClassVar[Optional[str]] = None

    _steps: Dict[str, int]
    _steps_lock: Any

    def _init_steps(self) -> None:
        """Start every counter at 0."""
        self._steps = {}
        self._steps_lock = threading.Lock()

    def _next_step(self, name: str) -> int:
        """Return the step to use for ``name`` now and advance its counter."""
        with self._steps_lock:
            step = self._steps.get(name, 0)
            self._steps[name] = step + 1
        return step

    def state_dict(self) -> Dict[str, Any]:
        """Return the counters (plain ints, picklable): ``{name: step}`` or ``{steps_key: ...}``."""
        with self._steps_lock:
            steps = dict(self._steps)
        return steps if self.steps_key is None else {self.steps_key: steps}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore the step counters saved by :meth:`state_dict`.

        Args:
            state: the mapping :meth:`state_dict` returned (possibly unpickled).

        Raises:
            CodecError: unknown keys (nested layout), or a step that is not a non-negative
                integer.
        """
        if self.steps_key is None:
            saved = state
        else:
            extra = set(state) - {self.steps_key}
            if extra:
                raise CodecError(f"unknown codec state keys {sorted(extra)}; expect only "
                                 f"{self.steps_key!r}")
            saved = dict(state.get(self.steps_key, {}))
        steps = {str(k): check_step(k, v) for k, v in saved.items()}
        with self._steps_lock:
            self._steps = steps

    def __getstate__(self) -> Dict[str, Any]:
        """Return the instance's attributes without the lock (locks do not pickle)."""
        d = dict(self.__dict__)
        d.pop("_steps_lock", None)
        return d

    def __setstate__(self, d: Dict[str, Any]) -> None:
        """Restore the attributes of :meth:`__getstate__` with a fresh lock."""
        self.__dict__.update(d)
        self._steps_lock = threading.Lock()


class SeededStreamMixin(StepCounterMixin):
    """Step counters plus the rank, keying the counter-based streams of TernGrad and QSGD.

    The key of each encode is ``kq.stream_key(seed, name, step, rank)``. ``rank`` (int >= 0,
    default 0) is set by the engine through :meth:`bind` (or assigned directly) so that
    ranks draw independent numbers. Checkpoints use the nested layout
    ``{"steps": {name: step}}``.
    """

    steps_key: ClassVar[Optional[str]] = "steps"

    seed: int
    rank: int

    def _init_stream(self, seed: Any, what: str) -> None:
        """Set ``seed`` (an integer in [0, 2**32)), rank 0 and fresh counters.

        Raises:
            CodecError: bad seed; the message names ``what``.
        """
        self.seed = check_seed(seed, what, bits=32)
        self.rank = 0
        self._init_steps()

    def bind(self, rank: int, world_size: int) -> None:
        """Set the rank mixed into the random streams (the engine calls this once).

        Raises:
            CodecError: ``rank`` is not an integer in [0, world_size).
        """
        if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)):
            raise CodecError(f"rank must be an integer, got {rank!r}")
        if not 0 <= int(rank) < max(int(world_size), 1):
            raise CodecError(f"rank {rank} is outside [0, {world_size})")
        self.rank = int(rank)

    def _next_key(self, name: str) -> int:
        """Return the stream key of this encode of ``name`` and advance its step."""
        return kq.stream_key(self.seed, name, self._next_step(name), self.rank)
