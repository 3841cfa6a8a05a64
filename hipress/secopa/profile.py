"""Measure the cluster for SeCoPa: codec compute curves and the send costs of each strategy.

The original SeCoPa (Bai et al., SOSP'21, section 4) hard-coded its cost curves for 4, 8
and 16 nodes and a 1/16 compression ratio. This module measures them instead, on the
cluster and with the codecs at hand, and fits every primitive to a line with a floor::

    t(x) = max(floor, a + b * x)        x in bytes, t in seconds

Measured primitives (``x`` = bytes of float32 input for compute, bytes of one message for
communication):

- per codec: ``encode`` (``codec.encode(x).to_buffer()``, as the engine's encode step),
  ``decode`` (parse the wire buffer + ``codec.decode``), ``merge`` (decode one payload and
  add it into a float32 accumulator, as the aggregator and each ring hop do) and, for
  summable codecs, ``stages`` (driving ``codec.reduce_stages`` on a near-square matrix with
  the reductions replaced by the identity: the codec's compute on the compressed-allreduce
  path, which hands the codec the gradient's own shape);
- ``ef``: residual error feedback, ``compensate`` + ``update`` (codec independent);
- ``write``: storing a decoded result averaged into the output (the engine's ``_write``,
  after every final decode; codec independent);
- communication, the message patterns of the engine's task graphs, sent through the
  engine's own scheduler as its tasks send them (non-blocking point-to-point messages on
  the communicator given, tested in the engine's poll loop; every rank taking part):
  ``ring_step`` (every rank sends x to its successor and receives x from its
  predecessor: one CaSync-Ring hop), ``ps_gather`` (N-1 ranks send x to rank 0: the
  CaSync-PS incast), ``ps_bcast`` (rank 0 sends x to N-1 ranks), ``allgather`` (every rank
  sends x to every other: the ring's final allgather, the gather path, and N aggregators
  at once) and ``allreduce`` (x bytes through the engine's own
  :func:`hipress.engine.tasks.fused_task`: the whole uncompressed fused path, averaging
  included);
- ``step_overhead_s``: what one step of a task graph (a compute or a communication wait)
  costs the engine beyond its work, measured by running a chain of no-op steps through the
  engine's own scheduler, polled as the engine polls it (all ranks at once; median).

Fitting (:func:`fit_line`): a floor plus a line, ``max(floor, a + b*x)``, chosen to
minimize the *relative* error ``sum(((t_hat_i - t_i) / t_i)^2)``, so small sizes
(microseconds) weigh as much as large ones (hundreds of milliseconds). The floor is the
flat region of small sizes where fixed costs dominate (its extent is chosen by the data);
``b >= 0``. Where the data are convex (cache cliffs: encoding 16 MiB can cost 15x what
4 MiB does, not 4x) a second, steeper line ``a2 + b2*x`` covers the largest sizes if it
cuts the squared error by 30 %. Below the smallest profiled size a primitive costs the
floor; above the largest profiled size the steepest line is extrapolated. The fit error
is recorded as the relative RMS error and R^2 (of the curve against the measured
points).

Time bound: the default budget is :data:`DEFAULT_TIME_BUDGET_S` (20 s) of measurements.
It is split 40 % communication (when there are >= 2 ranks) and 60 % compute; within each
part the time left is shared evenly by the series still to measure (message patterns;
error feedback and one series per codec). Sizes are measured smallest first; a series
stops before a size whose predicted time (the previous size's, scaled by the size ratio)
would overrun its share, after at least two sizes. A message pattern's second size is its
largest of at most :data:`COMM_ANCHOR_BYTES` (4 MiB), whatever the budget: links shaped
by a token bucket (``tc tbf``, and switches with deep buffers) pass the first tens of KiB
at memory speed, so a sweep of small sizes alone fits no per-byte cost at all (a 5 s
profile of the emulated 1 Gbit/s cluster stopped at 64 KiB and priced 64 MiB like 64 B);
the other sizes follow, smallest first, while the share lasts. Each size is measured
with adaptive repetitions (>= 3, until ~30 ms of samples) and reduced to their 20th percentile
(:data:`FIT_PERCENTILE`: the undisturbed cost, not a neighbour's burst); the largest
relative spread of a series, ``(p80 - p20) / p20``, is kept as its fit's ``spread``.
The share of each host's cores that other programs kept busy meanwhile is recorded
(``Profile.host_load``: the host's busy CPU time from ``/proc/stat`` less the CPU time of
the profile's own ranks on it, over wall time times cores); above :data:`LOADED_SHARE`
the profile is flagged ``loaded`` and a warning says so. Before the budget
starts, each codec is used once (its Numba kernels load from the disk cache or compile:
about 0.1-2 s per codec family on a loaded two-core machine, recorded as ``warmup_s``);
a profile thus takes warm-up + budget + well under a second (overruns of the last size of
a series, the final broadcast).

While the ``allreduce`` pattern runs, each machine's busy CPU (``/proc/stat``) is read
too: ``wire_cpu_s_per_byte``, what moving a byte costs the cores training shares (on the
emulated cluster, whose hosts share one kernel, the TCP stack's work is all of it).

A job's timeline refines a measured profile (:func:`refit_from_timeline`, ``hipress profile
--from-timeline``): the codecs' CPU time in training, the engine's CPU per task step
(polling, message progress, the task graphs' Python: far more than the no-op chain shows),
and the share of a core its work got during and after the backward pass
(``cpu_share_backward``, ``cpu_share_tail``; 1 in a measured profile).

All ranks call :func:`run_profile` (collective). Every rank measures at the same time (so
contention for shared cores or links is what the engine sees), rank 0 combines the
ranks' numbers (median over ranks for compute, max over ranks for each communication
repetition: a message pattern is done when its slowest rank is), fits, and broadcasts the
profile: every rank holds the identical profile, so plans made from it agree across ranks.
"""

from __future__ import annotations

import bisect
import dataclasses
import datetime
import json
import logging
import math
import os
import socket
import statistics
import time
from typing import Any, Callable, Dict, List, Literal, Optional, Sequence, Tuple

import numpy as np
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from hipress.codecs import Codec, Payload, get_codec
from hipress.engine.blas import limit_numpy_blas
from hipress.secopa.errors import ProfileError, format_validation_error

logger = logging.getLogger(__name__)

PROFILE_VERSION = 1
#: default time budget of :func:`run_profile`, seconds
DEFAULT_TIME_BUDGET_S = 20.0
#: default codec input sizes (elements of float32): 256 .. 4 Mi, powers of 4
DEFAULT_SIZES = tuple(4**k for k in range(4, 12))
#: default message sizes (bytes): 64 B .. 64 MiB (the engine's largest fused buffer),
#: powers of 4
DEFAULT_COMM_SIZES = tuple(4**k for k in range(3, 14))
#: message patterns measured (see the module docstring)
COMM_PRIMITIVES = ("ring_step", "ps_gather", "ps_bcast", "allgather", "allreduce")
#: the engine's idle poll sleep (hipress.engine.engine: time.sleep(0.0002) while busy)
ENGINE_POLL_SLEEP_S = 0.0002
_COMM_SHARE = 0.4
#: a message pattern's second size, measured whatever the budget: the largest default
#: size of at most this (see the module docstring)
COMM_ANCHOR_BYTES = 4 << 20
#: allreduce sizes from which the machines' busy CPU counts for ``wire_cpu_s_per_byte``
#: (below, fixed costs and polling dominate)
_WIRE_CPU_MIN_BYTES = 1 << 20
#: shortest run of repetitions over which that busy CPU is read: /proc/stat counts in ticks
#: of 10 ms, so a 30 ms sample read 0-3 ticks (a profile on a fast machine measured 0)
_WIRE_CPU_MIN_WINDOW_S = 0.1
_MIN_POINTS = 2
_TARGET_SAMPLE_S = 0.03
_MIN_REPS, _MAX_REPS = 3, 25
#: percentile of the repetitions a size is reduced to: a low one, so that the fit follows
#: the undisturbed cost and not a neighbour's burst (the spread says how noisy it was)
FIT_PERCENTILE = 20.0
#: share of a host's cores busy with other programs (not the profile's own ranks) during
#: the measurements above which a profile is flagged as taken under load
LOADED_SHARE = 0.25

_STRICT = ConfigDict(extra="forbid", strict=True)


# ----------------------------------------------------------------------------- models
class Fit(BaseModel):
    """A fitted cost curve ``t(x) = max(floor, a + b * x[, a2 + b2 * x])``.

    Attributes:
        a: intercept, seconds (may be negative: the floor covers small sizes).
        b: slope, seconds per byte (>= 0).
        a2, b2: the line of large sizes where the data are convex (a cache or memory
            cliff: per-byte cost grows once arrays leave the cache), else None.
        floor: smallest time measured at any size, seconds (>= 0).
        x_min: smallest profiled size, bytes.
        x_max: largest profiled size, bytes (beyond it the line is extrapolated).
        rel_rms: relative RMS error of the fit over the measured points.
        r2: coefficient of determination of the fit (1 = perfect; may be < 0 for a
            flat, noisy series).
        spread: largest relative spread of the repetitions at any size,
            ``(p80 - p20) / p20`` (0 when unknown: fits from older files or timelines).
        points: the measured ``(bytes, seconds)`` (the :data:`FIT_PERCENTILE`-th
            percentile of the repetitions) the fit was made from.
    """

    model_config = _STRICT

    a: float
    b: float = Field(ge=0)
    a2: Optional[float] = None
    b2: Optional[float] = Field(None, ge=0)
    floor: float = Field(0.0, ge=0)
    x_min: float = Field(0.0, ge=0)
    x_max: float = Field(0.0, ge=0)
    rel_rms: float = Field(0.0, ge=0)
    r2: float = Field(1.0, le=1.0)
    spread: float = Field(0.0, ge=0)
    points: List[List[float]] = Field(default_factory=list)

    @field_validator("points")
    @classmethod
    def _pairs(cls, value: List[List[float]]) -> List[List[float]]:
        for i, p in enumerate(value):
            if len(p) != 2:
                raise ValueError(f"point {i} must be [bytes, seconds], got {p}")
        return value

    @field_validator("a", "b", "floor", "rel_rms", "spread")
    @classmethod
    def _finite(cls, value: float) -> float:
        if not math.isfinite(value):
            raise ValueError("must be a finite number")
        return value

    @model_validator(mode="after")
    def _second_line(self) -> Fit:
        if (self.a2 is None) != (self.b2 is None):
            raise ValueError("a2 and b2 go together: give both or neither")
        if self.a2 is not None and not math.isfinite(self.a2):
            raise ValueError("a2 must be a finite number")
        return self

    def __call__(self, x: float) -> float:
        """Return the predicted time in seconds for ``x`` bytes (any ``x`` >= 0)."""
        x = max(float(x), 0.0)
        t = max(self.floor, self.a + self.b * x)
        if self.b2 is not None:
            t = max(t, self.a2 + self.b2 * x)
        return t

    @classmethod
    def zero(cls) -> Fit:
        """Return the fit of a primitive that costs nothing (communication at world size 1)."""
        return cls(a=0.0, b=0.0)

    def scaled(self, factor: float) -> Fit:
        """Return this fit with its size-dependent part multiplied by ``factor``.

        ``t'(x) = max(floor, a + f * (t(x) - a))``: the intercept ``a`` (fixed cost) and the
        floor are kept, and both lines' growth above ``a`` is scaled. The second line is
        ``a2 + b2 * x`` with ``a2`` usually far below ``a`` (it starts at the cache cliff),
        so it becomes ``a + f * (a2 - a) + f * b2 * x``: scaling ``b2`` alone would have
        scaled it by much more than ``f`` near the cliff (an ``ef`` fit refitted by 1.85
        predicted 2.56 ms at 4 MiB instead of 0.94 ms).
        """
        f = float(factor)
        upd: Dict[str, Any] = {"b": self.b * f, "points": []}
        if self.b2 is not None and self.a2 is not None:
            upd.update(a2=self.a + f * (self.a2 - self.a), b2=self.b2 * f)
        return self.model_copy(update=upd)


class CommProfile(BaseModel):
    """Fitted costs of the engine's message patterns (``x`` = bytes of one message)."""

    model_config = _STRICT

    ring_step: Fit
    ps_gather: Fit
    ps_bcast: Fit
    allgather: Fit
    allreduce: Fit


class CodecProfile(BaseModel):
    """Fitted compute costs of one codec (``x`` = bytes of float32 input).

    Attributes:
        name: registered codec name.
        params: constructor parameters (``codec.params()``).
        encode, decode, merge: see the module docstring.
        stages: compute of ``reduce_stages`` (summable codecs only).
        n_stages: number of reductions ``reduce_stages`` asks for (0 if not summable).
    """

    model_config = _STRICT

    name: str = Field(min_length=1)
    params: Dict[str, Any] = Field(default_factory=dict)
    encode: Fit
    decode: Fit
    merge: Fit
    stages: Optional[Fit] = None
    n_stages: int = Field(0, ge=0)


class Profile(BaseModel):
    """A measured cluster profile: what :mod:`hipress.secopa.cost` predicts from.

    Attributes:
        version: file format version (:data:`PROFILE_VERSION`).
        world_size: ranks the profile was measured with.
        hosts: host name of each rank.
        created: ISO time of the measurement.
        time_budget_s: the budget it was measured under; elapsed_s: what it took in all;
            warmup_s: of which the codecs' first use (outside the budget).
        step_overhead_s: engine cost of one task-graph step beyond its work.
        ef: residual error feedback (compensate + update) vs float32 input bytes.
        write: averaged write of a decoded result into the output vs float32 bytes.
        comm: message-pattern fits (all zero at world size 1).
        codecs: per codec key (``name`` or ``name?{json params}``) its compute fits.
        host_load: per host, the share of its cores that other programs kept busy while
            the profile measured (0 = idle but for the profile; empty when unknown).
        loaded: the profile was taken under load (``host_load`` above
            :data:`LOADED_SHARE` on some host): its costs include other programs'.
        source: ``measured`` (:func:`run_profile`) or ``timeline:<path>``
            (:func:`refit_from_timeline`).
        round_s: the interval between the engine's negotiation rounds, seconds: how long
            a gradient waits after it is ready before work on it starts (from a job's
            timeline; 0 when unknown, as in a measured profile).
        cpu_share_backward: the share of a core the engine's work gets while the backward
            pass runs, in (0, 1]: CPU seconds per wall second of its work spans in a job's
            timeline (1 in a measured profile: the engine alone). Four ranks on two cores
            measured about 0.25.
        cpu_share_tail: the same after the backward pass has ended (the ranks' engines
            then share the cores only with each other).
        wire_cpu_s_per_byte: CPU seconds per byte a rank allreduces uncompressed, over
            all cores of its machine (MPI, the engine's polling, the kernel's TCP stack:
            busy time in ``/proc/stat`` while the ``allreduce`` pattern ran, at 1 MiB and
            up, each size repeated for at least 0.1 s): what moving bytes takes from
            training that shares the cores. Measured where ``/proc/stat`` exists and
            N > 1, else 0.
    """

    model_config = _STRICT

    version: Literal[1]
    world_size: int = Field(ge=1)
    hosts: List[str] = Field(default_factory=list)
    created: str = ""
    time_budget_s: float = Field(0.0, ge=0)
    elapsed_s: float = Field(0.0, ge=0)
    warmup_s: float = Field(0.0, ge=0)
    step_overhead_s: float = Field(0.0, ge=0)
    ef: Fit
    write: Fit
    comm: CommProfile
    codecs: Dict[str, CodecProfile] = Field(default_factory=dict)
    host_load: Dict[str, float] = Field(default_factory=dict)
    loaded: bool = False
    source: str = "measured"
    round_s: float = Field(0.0, ge=0)
    cpu_share_backward: float = Field(1.0, gt=0, le=1)
    cpu_share_tail: float = Field(1.0, gt=0, le=1)
    wire_cpu_s_per_byte: float = Field(0.0, ge=0)

    # ------------------------------------------------------------------ files
    @classmethod
    def from_json(cls, text: str, origin: str = "<memory>") -> Profile:
        """Parse and validate a profile from JSON text.

        Raises:
            ProfileError: not JSON, or a field is missing or invalid; the message names
                the field path (e.g. ``comm.ring_step.b``) and what was found.
        """
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ProfileError(
                f"invalid SeCoPa profile {origin}: not JSON ({exc.msg} at line {exc.lineno} "
                f"column {exc.colno}); write one with `hipress profile -o FILE`"
            ) from None
        if not isinstance(data, dict):
            raise ProfileError(
                f"invalid SeCoPa profile {origin}: expect a JSON object, got "
                f"{type(data).__name__}"
            )
        if "version" in data and data["version"] != PROFILE_VERSION:
            raise ProfileError(
                f"invalid SeCoPa profile {origin}: version: {data['version']!r} is not "
                f"supported (expect {PROFILE_VERSION}); re-run `hipress profile`"
            )
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            raise ProfileError(format_validation_error("SeCoPa profile", origin, exc)) from None

    @classmethod
    def load(cls, path: Any) -> Profile:
        """Read a profile file written by :meth:`save` (or ``hipress profile``).

        Raises:
            ProfileError: the file is missing, not JSON, or invalid (names the field).
        """
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except OSError as exc:
            raise ProfileError(f"cannot read SeCoPa profile {path}: {exc.strerror}") from None
        return cls.from_json(text, str(path))

    def to_json(self) -> str:
        """Return the profile as indented JSON text."""
        return json.dumps(self.model_dump(mode="json"), indent=1)

    def save(self, path: Any) -> None:
        """Write the profile as JSON (atomically: a temporary file renamed over ``path``)."""
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(self.to_json())
            f.write("\n")
        os.replace(tmp, path)

    # ------------------------------------------------------------------ lookups
    def codec(self, codec: Codec) -> CodecProfile:
        """Return the fits of ``codec``: by exact key, else by name alone.

        Raises:
            ProfileError: the profile has no entry for that codec (lists those it has).
        """
        key = codec_key(codec.name, codec.params())
        if key in self.codecs:
            return self.codecs[key]
        same = [k for k, v in self.codecs.items() if v.name == codec.name]
        if same:
            logger.debug("profile has %s for codec %s; using its compute fits", same[0], key)
            return self.codecs[same[0]]
        raise ProfileError(
            f"the SeCoPa profile has no measurements for codec {key!r} (it has: "
            f"{', '.join(sorted(self.codecs)) or 'none'}); re-run `hipress profile "
            f"--codecs {codec.name}`"
        )

    def comm_at(self, world_size: int) -> CommProfile:
        """Return the message-pattern fits for ``world_size`` ranks.

        At the profiled world size these are the measured fits. At another size the
        intercepts are kept and each slope is scaled by the bytes the busiest link carries
        per message byte (an alpha-beta model): ``ring_step`` x1; ``ps_gather``,
        ``ps_bcast`` and ``allgather`` x(N'-1)/(N-1); ``allreduce`` x(2(N'-1)/N') /
        (2(N-1)/N). World size 1 costs nothing.

        Raises:
            ProfileError: ``world_size`` > 1 but the profile was measured on one rank
                (it has no communication measurements).
        """
        if world_size < 1:
            raise ProfileError(f"world size must be >= 1, got {world_size}")
        if world_size == 1:
            z = Fit.zero()
            return CommProfile(ring_step=z, ps_gather=z, ps_bcast=z, allgather=z, allreduce=z)
        if world_size == self.world_size:
            return self.comm
        if self.world_size == 1:
            raise ProfileError(
                f"cannot plan for world size {world_size}: the profile was measured on one "
                "rank and has no communication costs; run `hipress profile` under "
                "hipressrun/mpirun with >= 2 ranks on the cluster in question"
            )
        n0, n1 = self.world_size, world_size
        fan = (n1 - 1) / (n0 - 1)
        ar = (2.0 * (n1 - 1) / n1) / (2.0 * (n0 - 1) / n0)
        c = self.comm
        return CommProfile(
            ring_step=c.ring_step.model_copy(update={"points": []}),
            ps_gather=c.ps_gather.scaled(fan),
            ps_bcast=c.ps_bcast.scaled(fan),
            allgather=c.allgather.scaled(fan),
            allreduce=c.allreduce.scaled(ar),
        )


def codec_key(name: str, params: Dict[str, Any]) -> str:
    """Return the key of a codec with parameters (the engine's convention)."""
    return name + ("?" + json.dumps(params, sort_keys=True) if params else "")


# ----------------------------------------------------------------------------- fitting
def _rel_line(x: np.ndarray, t: np.ndarray) -> Tuple[float, float]:
    """Least squares of a + b*x on relative error (weights 1/t), with b >= 0."""
    w = 1.0 / t
    if x.size >= 2 and np.ptp(x) > 0:
        mat = np.stack([w, x * w], axis=1)
        (a, b), *_ = np.linalg.lstsq(mat, np.ones_like(t), rcond=None)
        if b >= 0:
            return float(a), float(b)
    return float(np.sum(w) / np.sum(w * w)), 0.0


def _rel_const(t: np.ndarray) -> float:
    """The constant minimizing the relative squared error to ``t``."""
    w = 1.0 / t
    return float(np.sum(w) / np.sum(w * w))


#: a second line must cut the squared relative error by this factor to be kept
_SECOND_LINE_GAIN = 0.7


def fit_line(points: Sequence[Tuple[float, float]]) -> Fit:
    """Fit ``t(x) = max(floor, a + b*x)`` (plus a steeper line if the data need it).

    The floor is the flat part of small sizes (fixed costs dominate); the line is the
    part that grows with size. Where the data are convex, e.g. an encode that runs from
    the cache up to a few MiB and from memory beyond, one line under-predicts the large
    sizes that dominate synchronization time, so a second, steeper line ``a2 + b2*x`` for
    the largest sizes is added when it cuts the error enough. The curve is the maximum of
    floor and lines (a convex, piecewise-linear cost), extrapolated beyond the largest
    size along its steepest line.

    Algorithm:
        1. Sort the points by x. For each split into a floor region (the k smallest
           points, k = 0 .. n-2), a line region, and optionally a second-line region
           (the largest points; each line region >= 2 points):
           a. floor = the relative-error least-squares constant of its region
              (``sum(1/t)/sum(1/t^2)``); for k = 0 the smallest time measured;
           b. each line = relative-error least squares over its region (weights
              ``1/t_i``: minimize ``sum(((a + b*x_i - t_i)/t_i)^2)``), with ``b >= 0``
              (``a`` may be negative: the floor covers small sizes);
           c. score = ``sum(((t_hat_i - t_i)/t_i)^2)`` over all points.
           The constant model (floor only) is a candidate too.
        2. Keep the best one-line split; keep the best two-line split instead only if
           its score is below 0.7 times that (a second line must earn its parameters).
        3. Record the relative RMS error and R^2 of the chosen curve.

    Relative error makes microsecond and 100-millisecond points weigh alike.

    Args:
        points: at least one ``(x, t)`` with ``x >= 0`` and ``t > 0``.

    Returns:
        The :class:`Fit` (with the points).

    Raises:
        ValueError: no points, or a non-positive or non-finite time.
    """
    pts = sorted((float(x), float(t)) for x, t in points)
    if not pts:
        raise ValueError("cannot fit a cost curve to no points")
    if any(not (t > 0 and math.isfinite(t)) or x < 0 for x, t in pts):
        raise ValueError(f"cost curve points must have x >= 0 and finite t > 0: {pts}")
    x = np.array([p[0] for p in pts])
    t = np.array([p[1] for p in pts])
    n = x.size

    def score(floor: float, lines: List[Tuple[float, float]]) -> float:
        pred = np.full(n, floor)
        for a, b in lines:
            pred = np.maximum(pred, a + b * x)
        return float(np.sum(((pred - t) / t) ** 2))

    c = _rel_const(t)
    one = (score(c, []), c, [(c, 0.0)])
    two: Optional[Tuple[float, float, List[Tuple[float, float]]]] = None
    for k in range(max(n - 1, 0)):
        floor = float(t.min()) if k == 0 else _rel_const(t[:k])
        line1 = _rel_line(x[k:], t[k:])
        cand = (score(floor, [line1]), floor, [line1])
        if cand[0] < one[0] - 1e-15:
            one = cand
        for j in range(k + 2, n - 1):
            lines = [_rel_line(x[k:j], t[k:j]), _rel_line(x[j:], t[j:])]
            cand = (score(floor, lines), floor, lines)
            if two is None or cand[0] < two[0] - 1e-15:
                two = cand
    best = two if two is not None and two[0] < _SECOND_LINE_GAIN * one[0] else one
    _, floor, lines = best
    (a, b) = lines[0]
    a2, b2 = lines[1] if len(lines) > 1 else (None, None)
    fit = Fit(a=a, b=b, a2=a2, b2=b2, floor=floor, x_min=float(x.min()),
              x_max=float(x.max()), points=[list(p) for p in pts])
    pred = np.array([fit(v) for v in x])
    rel_rms = float(np.sqrt(np.mean(((pred - t) / t) ** 2)))
    ss_tot = float(np.sum((t - t.mean()) ** 2))
    ss_res = float(np.sum((pred - t) ** 2))
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else (1.0 if ss_res == 0 else 0.0)
    return fit.model_copy(update={"rel_rms": rel_rms, "r2": min(1.0, r2)})


# ----------------------------------------------------------------------------- measuring
class _Clock:
    """Rank 0's clock decides for everyone (broadcast), so all ranks loop identically."""

    def __init__(self, comm: Any) -> None:
        self.comm = comm
        self.root = comm.Get_rank() == 0

    def agree(self, flag: bool) -> bool:
        """Return rank 0's ``flag`` on every rank."""
        if self.comm.Get_size() == 1:
            return bool(flag)
        return bool(self.comm.bcast(bool(flag) if self.root else None, root=0))


def _low_time(fn: Callable[[], Any], deadline: float) -> Tuple[float, float]:
    """Time ``fn()`` over adaptive repetitions (one warm-up) on this rank.

    Returns:
        ``(t, spread)``: the :data:`FIT_PERCENTILE`-th percentile of the wall times and
        their relative spread ``(p80 - p20) / p20``.
    """
    fn()
    samples: List[float] = []
    spent = 0.0
    while len(samples) < _MIN_REPS or (spent < _TARGET_SAMPLE_S and len(samples) < _MAX_REPS
                                       and time.perf_counter() < deadline):
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        samples.append(dt)
        spent += dt
    return _low_and_spread(samples)


def _low_and_spread(samples: Sequence[float]) -> Tuple[float, float]:
    """Return the :data:`FIT_PERCENTILE`-th percentile of ``samples`` and their spread."""
    lo, hi = (float(v) for v in np.percentile(samples, [FIT_PERCENTILE, 100 - FIT_PERCENTILE]))
    lo = max(lo, 1e-9)
    return lo, max(hi - lo, 0.0) / lo


def cpu_sample() -> Tuple[float, float, float, int]:
    """Return ``(wall s, host busy CPU s, this process's CPU s, cores)`` now.

    The host's busy time comes from ``/proc/stat`` (all CPUs: total less idle and iowait);
    where there is none (not Linux) it is reported as -1.
    """
    wall, own = time.monotonic(), sum(os.times()[:2])
    cores = os.cpu_count() or 1
    try:
        with open("/proc/stat", encoding="ascii") as f:
            vals = [int(v) for v in f.readline().split()[1:9]]
        tick = os.sysconf("SC_CLK_TCK")
        busy = (sum(vals) - vals[3] - vals[4]) / tick
    except (OSError, ValueError, IndexError):
        busy = -1.0
    return wall, busy, own, cores


def others_share(start: Sequence[Tuple[float, float, float, int]],
                 end: Sequence[Tuple[float, float, float, int]]) -> float:
    """Return the share of a host's cores other programs used between two samples.

    Args:
        start: :func:`cpu_sample` of every rank of the profile on that host, before.
        end: the same ranks' samples after, in the same order.

    Returns:
        ``(host busy - the ranks' own CPU) / (wall * cores)``, clipped to [0, 1]; 0 when
        the host's busy time is unknown.
    """
    if not start or start[0][1] < 0 or end[0][1] < 0:
        return 0.0
    wall = max(end[0][0] - start[0][0], 1e-6)
    own = sum(e[2] - s[2] for s, e in zip(start, end))
    busy = end[0][1] - start[0][1]
    return min(max((busy - own) / (wall * end[0][3]), 0.0), 1.0)


def _step_overhead(comm: Any, mpi: Any) -> float:
    """Return the engine's cost per task-graph step (seconds), measured through its scheduler.

    A chain of no-op :class:`~hipress.engine.scheduler.Compute` steps runs on the engine's
    own :class:`~hipress.engine.scheduler.Scheduler` (one compute thread), driven the way
    the engine's loop drives it (poll; sleep 0.2 ms when nothing progressed). The time per
    step is what a step costs beyond its work: the thread-pool round trip, the poll
    latency, and the scheduling delays of a loaded machine.
    """
    from hipress.engine.scheduler import Compute, Scheduler

    steps = 40
    from hipress.comm import MpiTransport

    sched = Scheduler(MpiTransport(None, comm, mpi), 1, 60.0)

    def chain() -> Any:
        for _ in range(steps):
            yield Compute(int, ())

    try:
        t0 = time.perf_counter()
        sched.add(chain(), "secopa.step")
        while sched.busy:
            if not sched.poll():
                time.sleep(ENGINE_POLL_SLEEP_S)
        return (time.perf_counter() - t0) / steps
    finally:
        sched.shutdown()


def _codec_ops(codec: Codec, n: int, rng: np.random.Generator, world_size: int) -> Dict[str, Any]:
    """Return zero-argument callables for the compute primitives of ``codec`` at ``n``."""
    x = rng.standard_normal(n).astype(np.float32)
    name = f"secopa.profile/{n}"
    buf = codec.encode(x, name=name).to_buffer()
    acc = np.zeros(n, dtype=np.float32)

    def encode() -> Any:
        return codec.encode(x, name=name).to_buffer()

    def decode() -> Any:
        return codec.decode(Payload.from_bytes(buf))

    def merge() -> Any:
        v = codec.decode(Payload.from_bytes(buf)).astype(np.float32, copy=False)
        acc.__iadd__(v)

    ops: Dict[str, Any] = {"encode": encode, "decode": decode, "merge": merge}
    if codec.summable:
        # the compressed allreduce hands the codec the gradient's own shape: a near-square
        # matrix here, so low-rank codecs (PowerSGD) do their real work
        rows = 1 << (max(n.bit_length() - 1, 0) // 2)
        xm = x.reshape(rows, n // rows) if n % rows == 0 else x

        def stages() -> int:
            gen = codec.reduce_stages(xm, name + "/m", world_size, 1.0 / world_size)
            value, count = None, 0
            while True:
                try:
                    arr, _op = gen.send(value)
                except StopIteration:
                    return count
                value = np.asarray(arr).copy()
                count += 1

        ops["stages"] = stages
    return ops


def _host_ops(n: int, rng: np.random.Generator, world_size: int) -> Dict[str, Any]:
    """Return the codec-independent compute primitives: error feedback, result write."""
    from hipress.engine.tasks import TaskEnv, _write
    from hipress.memory import get_memory
    from hipress.timeline import Timeline

    mem = get_memory("residual")
    x = rng.standard_normal(n).astype(np.float32)
    dec = np.zeros(n, dtype=np.float32)
    job = _FakeJob(np.empty(n, dtype=np.float32))
    env = TaskEnv(0, world_size, Timeline(False, 0), {})

    def ef() -> None:
        c = mem.compensate("secopa.profile", x)
        mem.update("secopa.profile", c, dec)

    def write() -> None:
        _write(env, job, 0, n, x)

    return {"ef": ef, "write": write}


class _FakeJob:
    """What :func:`hipress.engine.tasks._write` needs of a job."""

    def __init__(self, out: np.ndarray) -> None:
        self.out = out
        self.average = True
        self.divisor = 0  # the world size


def _run_task(sched: Any, gen: Any) -> None:
    """Run one task coroutine on the engine's scheduler, polled as the engine polls it."""
    sched.add(gen, "secopa.profile")
    while sched.busy:
        if not sched.poll():
            time.sleep(ENGINE_POLL_SLEEP_S)


def _comm_op(comm: Any, sched: Any, pattern: str, nbytes: int) -> Callable[[], None]:
    """Return a callable that performs one repetition of ``pattern`` with ``nbytes``.

    The messages go through the engine's own scheduler (``Isend``/``Irecv`` tested in its
    poll loop, not a blocking ``Waitall``): MPI progresses large messages only inside MPI
    calls, so the engine's polling is part of what a message costs.
    """
    from hipress.engine.scheduler import Recv, Send

    N, me = comm.Get_size(), comm.Get_rank()
    sbuf = np.ones(nbytes, dtype=np.uint8)
    tag = 7000 + 4 * COMM_PRIMITIVES.index(pattern)
    nxt, prv = (me + 1) % N, (me - 1) % N
    if pattern == "allreduce":
        # the engine's whole uncompressed path: fused_task (allreduce_sum, then the
        # averaged write into the output)
        from hipress.engine import tasks as T
        from hipress.memory import get_memory
        from hipress.timeline import Timeline

        arr = np.ones(max(nbytes // 4, N), dtype=np.float32)
        env = T.TaskEnv(me, N, Timeline(False, me), {})
        nomem = get_memory("none")

        fields = {f.name for f in dataclasses.fields(T.Job)}

        def run() -> None:
            kw = dict(name="secopa.profile", flat=arr, out=np.empty_like(arr), average=True,
                      codec=None, memory=nomem, contributes=True)
            if "shape" in fields:
                kw["shape"] = arr.shape
            _run_task(sched, T.fused_task(env, [T.Job(**kw)], tag))

        return run

    ops: List[Any] = []
    if pattern == "ring_step":
        ops = [Send(nxt, sbuf, tag), Recv(prv, tag, nbytes)]
    elif pattern == "ps_gather":
        ops = ([Recv(r, tag, nbytes) for r in range(1, N)] if me == 0
               else [Send(0, sbuf, tag)])
    elif pattern == "ps_bcast":
        ops = ([Send(r, sbuf, tag) for r in range(1, N)] if me == 0
               else [Recv(0, tag, nbytes)])
    elif pattern == "allgather":
        ops = ([Send(r, sbuf, tag) for r in range(N) if r != me]
               + [Recv(r, tag, nbytes) for r in range(N) if r != me])

    def task() -> Any:
        yield list(ops)

    def run() -> None:  # noqa: F811 - one of two closures is returned
        _run_task(sched, task())

    return run


def _machine_id() -> str:
    """Return an id shared by the processes of one kernel (its boot id; else the host name).

    Ranks in network namespaces of one machine (the emulated cluster) have host names of
    their own but one ``/proc/stat``.
    """
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            return f.read().strip()
    except OSError:
        return socket.gethostname()


def comm_order(sizes: Sequence[int], anchor: int = COMM_ANCHOR_BYTES) -> List[int]:
    """Return the order message sizes are measured in: the smallest, the anchor, the rest.

    The anchor is the largest of ``sizes`` of at most ``anchor`` bytes (the smallest size
    if none is); the rest follow smallest first.

    Args:
        sizes: message sizes in bytes, ascending.
        anchor: bytes (:data:`COMM_ANCHOR_BYTES`).
    """
    sizes = list(sizes)
    if len(sizes) < 3:
        return sizes
    big = max((s for s in sizes if s <= anchor), default=sizes[0])
    if big == sizes[0]:
        return sizes
    return [sizes[0], big] + [s for s in sizes[1:] if s != big]


def _measure_comm(comm: Any, mpi: Any, sched: Any, clock: _Clock, pattern: str, nbytes: int,
                  deadline: float, min_window_s: float = 0.0
                  ) -> Optional[Tuple[float, float, float]]:
    """Time one pattern at one size on every rank.

    ``min_window_s``: repeat the pattern for at least this long (the deadline aside, at
    most 1000 times), so that the busy CPU read from ``/proc/stat`` spans enough ticks.

    Returns:
        On rank 0 ``(t, spread, cpu)`` of the per-repetition maxima over ranks (a pattern
        is done when its slowest rank is; see :func:`_low_and_spread`) and ``cpu``, the
        machines' busy CPU seconds per repetition and rank (``/proc/stat`` of each
        machine, the median over its ranks' readings, summed over machines, over N; -1
        where a machine has no ``/proc/stat``); None elsewhere.
    """
    op = _comm_op(comm, sched, pattern, nbytes)
    comm.Barrier()
    t0 = time.perf_counter()
    op()  # warm-up, also sizes the repetitions
    first = time.perf_counter() - t0
    first = comm.allreduce(first, op=mpi.MAX)
    reps = int(min(_MAX_REPS, max(_MIN_REPS, math.ceil(_TARGET_SAMPLE_S / max(first, 1e-6)))))
    left = deadline - time.perf_counter()
    if first * reps > left > 0:
        reps = max(_MIN_REPS, int(left / max(first, 1e-6)))
    if min_window_s > 0:  # ``first`` is every rank's maximum: the same count everywhere
        reps = max(reps, min(1000, math.ceil(min_window_s / max(first, 1e-6))))
    reps = int(clock.comm.bcast(reps if clock.root else None, root=0))
    samples = []
    comm.Barrier()
    busy0 = cpu_sample()[1]
    for _ in range(reps):
        comm.Barrier()
        t0 = time.perf_counter()
        op()
        samples.append(time.perf_counter() - t0)
    comm.Barrier()
    busy1 = cpu_sample()[1]
    busy = busy1 - busy0 if busy0 >= 0 and busy1 >= 0 else -1.0
    allsamples = comm.gather((samples, _machine_id(), busy), root=0)
    if not clock.root:
        return None
    per_rep = [max(s[0][i] for s in allsamples) for i in range(reps)]
    machines: Dict[str, List[float]] = {}
    for _, mid, b in allsamples:
        machines.setdefault(mid, []).append(b)
    cpu = (-1.0 if any(b < 0 for bs in machines.values() for b in bs) else
           sum(statistics.median(bs) for bs in machines.values()) / (reps * len(allsamples)))
    return (*_low_and_spread(per_rep), cpu)


def _as_codec(c: Any) -> Codec:
    if isinstance(c, Codec):
        return c
    if isinstance(c, (tuple, list)) and len(c) == 2:
        return get_codec(c[0], **dict(c[1]))
    return get_codec(str(c))


def _collect(comm: Any, clock: _Clock, value: Optional[float], error: str) -> Tuple[float, str]:
    """Rank 0: median of the ranks' values; every rank: the first error any rank hit."""
    if comm.Get_size() == 1:
        return (value or 0.0), error
    got = comm.gather((value, error), root=0)
    msg = ""
    med = 0.0
    if clock.root:
        errs = [f"rank {r}: {e}" for r, (_, e) in enumerate(got) if e]
        msg = errs[0] if errs else ""
        vals = [v for v, _ in got if v is not None]
        med = statistics.median(vals) if vals else 0.0
    msg = comm.bcast(msg if clock.root else None, root=0)
    return med, msg


def run_profile(
    comm: Any,
    codecs: Sequence[Any] = ("onebit",),
    sizes: Optional[Sequence[int]] = None,
    time_budget_s: float = DEFAULT_TIME_BUDGET_S,
    comm_sizes: Optional[Sequence[int]] = None,
    seed: int = 0,
    blas_threads: int = 1,
) -> Profile:
    """Measure codecs and message patterns on ``comm`` and fit them (collective).

    Args:
        comm: an mpi4py communicator (every rank of it must call this). Use a dup of
            ``MPI.COMM_WORLD`` so no message can match someone else's.
        codecs: codec names, ``(name, params)`` pairs or :class:`Codec` instances.
        sizes: codec input sizes in float32 elements (default :data:`DEFAULT_SIZES`).
        time_budget_s: the time to spend measuring, seconds (see the module docstring
            for how it is split and bounded).
        comm_sizes: message sizes in bytes (default :data:`DEFAULT_COMM_SIZES`).
        seed: seed of the random test gradients.
        blas_threads: threads of NumPy's BLAS while measuring, as the engine sets them
            (``sync.blas_threads``; 0 keeps the library's); restored afterwards.

    Returns:
        The :class:`Profile`, identical on every rank.

    Raises:
        ProfileError: a codec failed on some rank (the message names codec, size and
            rank; every rank raises it), or an argument is invalid.
    """
    restore = limit_numpy_blas(blas_threads)
    try:
        return _measure_and_fit(comm, codecs, sizes, time_budget_s, comm_sizes, seed)
    finally:
        restore()


def _measure_and_fit(comm: Any, codecs: Sequence[Any], sizes: Optional[Sequence[int]],
                     time_budget_s: float, comm_sizes: Optional[Sequence[int]],
                     seed: int) -> Profile:
    """The body of :func:`run_profile` (same arguments, BLAS threads already set)."""
    from mpi4py import MPI

    t_start = time.perf_counter()
    cpu_start = cpu_sample()
    if not time_budget_s > 0:
        raise ProfileError(f"time budget must be > 0 seconds, got {time_budget_s!r}")
    sizes = sorted({int(s) for s in (sizes or DEFAULT_SIZES)})
    comm_sizes = sorted({int(s) for s in (comm_sizes or DEFAULT_COMM_SIZES)})
    if not sizes or sizes[0] < 1 or not comm_sizes or comm_sizes[0] < 1:
        raise ProfileError(f"profile sizes must be >= 1, got {sizes} and {comm_sizes}")
    N, me = comm.Get_size(), comm.Get_rank()
    clock = _Clock(comm)
    codec_objs = [_as_codec(c) for c in codecs]
    for c in codec_objs:
        c.bind(me, N)
    rng = np.random.default_rng(seed)
    hosts = comm.allgather(MPI.Get_processor_name())

    comm.Barrier()
    overhead, _ = _collect(comm, clock, _step_overhead(comm, MPI), "")

    # ---- first use of each codec (Numba kernels load or compile, caches fill): outside
    # the budget, which covers the measurements
    err = ""
    for c in codec_objs:
        try:
            warm = _codec_ops(c, sizes[0], rng, N)
            for fn in warm.values():
                fn()
        except Exception as exc:  # noqa: BLE001 - reported collectively below
            err = err or f"codec {codec_key(c.name, c.params())!r}: {type(exc).__name__}: {exc}"
    _, err = _collect(comm, clock, None, err)
    if err:
        raise ProfileError(f"profiling failed on {err}")
    comm.Barrier()
    warmup_s = time.perf_counter() - t_start
    logger.debug("codec warm-up done, %.2f s since start", warmup_s)
    budget_end = time.perf_counter() + time_budget_s  # rank 0's clock decides

    def go_on(i: int, deadline: float, last_cost: float, ratio: float) -> bool:
        """Measure point i? Always the first _MIN_POINTS; then only if it fits the share."""
        if i < _MIN_POINTS:
            return True
        return clock.agree(time.perf_counter() + last_cost * max(ratio, 1.0) <= deadline)

    # ---- communication: 40 % of the budget, shared evenly by the patterns still to do
    comm_fits: Dict[str, Fit] = {}
    wire_cpu: List[float] = []  # rank 0: CPU s per byte allreduced, per size
    if N > 1:
        from hipress.comm import MpiTransport
        from hipress.engine.scheduler import Scheduler

        sched = Scheduler(MpiTransport(None, comm, MPI), 1, 120.0)
        comm_end = budget_end - (1.0 - _COMM_SHARE) * time_budget_s
        for j, pattern in enumerate(COMM_PRIMITIVES):
            now = time.perf_counter()
            deadline = now + max(comm_end - now, 0.0) / (len(COMM_PRIMITIVES) - j)
            pts: List[Tuple[float, float]] = []
            spread = 0.0
            last = 0.0
            prev = comm_sizes[0]
            for i, nbytes in enumerate(comm_order(comm_sizes)):
                if not go_on(i, deadline, last, nbytes / prev):
                    break
                prev = nbytes
                t0 = time.perf_counter()
                wire = pattern == "allreduce" and nbytes >= _WIRE_CPU_MIN_BYTES
                got = _measure_comm(comm, MPI, sched, clock, pattern, nbytes, deadline,
                                    _WIRE_CPU_MIN_WINDOW_S if wire else 0.0)
                last = time.perf_counter() - t0
                if clock.root and got is not None:
                    pts.append((float(nbytes), got[0]))
                    spread = max(spread, got[1])
                    if wire and got[2] > 0:  # 0: no tick counted, not free
                        wire_cpu.append(got[2] / nbytes)
            if clock.root:
                comm_fits[pattern] = fit_line(pts).model_copy(update={"spread": spread})
                logger.debug("profiled %s: %d sizes, %.2f s since start", pattern, len(pts),
                             time.perf_counter() - t_start)
        sched.shutdown()
    else:
        comm_fits = {p: Fit.zero() for p in COMM_PRIMITIVES}

    # ---- compute: the rest of the budget, shared evenly by the series still to do
    # (error feedback and result write + one per codec)
    series: Dict[str, Dict[str, List[Tuple[float, float]]]] = {}
    spreads: Dict[Tuple[str, str], float] = {}
    n_stages: Dict[str, int] = {}
    jobs: List[Tuple[str, Optional[Codec]]] = [("ef", None)] + [
        (codec_key(c.name, c.params()), c) for c in codec_objs]
    for j, (key, codec) in enumerate(jobs):
        now = time.perf_counter()
        deadline = now + max(budget_end - now, 0.0) / (len(jobs) - j)
        series[key] = {}
        last = 0.0
        for i, n in enumerate(sizes):
            if not go_on(i, deadline, last, n / sizes[max(i - 1, 0)]):
                break
            t0 = time.perf_counter()
            err = ""
            try:
                ops = _host_ops(n, rng, N) if codec is None else _codec_ops(codec, n, rng, N)
            except Exception as exc:  # noqa: BLE001 - reported collectively below
                ops, err = {}, f"{type(exc).__name__}: {exc}"
            _, err = _collect(comm, clock, None, err)
            if err:
                raise ProfileError(f"profiling codec {key!r} at {n} elements failed on {err}")
            for prim, fn in ops.items():
                comm.Barrier()
                err, t, sp = "", None, None
                try:
                    t, sp = _low_time(fn, deadline)
                    if prim == "stages":
                        n_stages[key] = int(fn())
                except Exception as exc:  # noqa: BLE001 - reported collectively below
                    err = f"{type(exc).__name__}: {exc}"
                med, err = _collect(comm, clock, t, err)
                if err:
                    raise ProfileError(
                        f"profiling {prim} of codec {key!r} at {n} elements failed on {err}")
                med_spread, _ = _collect(comm, clock, sp, "")
                series[key].setdefault(prim, []).append((4.0 * n, med))
                spreads[key, prim] = max(spreads.get((key, prim), 0.0), med_spread)
            last = time.perf_counter() - t0
        logger.debug("profiled %s: %d sizes, %.2f s since start (deadline %+.2f s)", key,
                     len(series[key].get("encode", series[key].get("ef", []))),
                     time.perf_counter() - t_start, time.perf_counter() - deadline)

    samples = [(cpu_start, cpu_sample())]
    if N > 1:
        samples = comm.gather(samples[0], root=0)

    def fitted(key: str, prim: str) -> Fit:
        return fit_line(series[key][prim]).model_copy(
            update={"spread": spreads.get((key, prim), 0.0)})

    text = ""
    if clock.root:
        load: Dict[str, float] = {}
        for host in sorted(set(hosts)):
            mine = [samples[r] for r in range(N) if hosts[r] == host]
            load[host] = round(others_share([a for a, _ in mine], [b for _, b in mine]), 3)
        loaded = any(v > LOADED_SHARE for v in load.values())
        if loaded:
            logger.warning(
                "SeCoPa profile taken under load (share of the cores other programs kept "
                "busy: %s; above %.2f counts as loaded): its costs include other programs' "
                "and plans made from it may be off; profile again on a quiet cluster",
                ", ".join(f"{h} {v:.2f}" for h, v in sorted(load.items())), LOADED_SHARE)
        codec_profiles = {}
        for key, codec in jobs[1:]:
            fits = {prim: fitted(key, prim) for prim in series[key]}
            codec_profiles[key] = CodecProfile(
                name=codec.name, params=json.loads(json.dumps(codec.params())),
                encode=fits["encode"], decode=fits["decode"], merge=fits["merge"],
                stages=fits.get("stages"), n_stages=n_stages.get(key, 0))
        prof = Profile(
            version=PROFILE_VERSION, world_size=N, hosts=list(hosts),
            created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            time_budget_s=float(time_budget_s), elapsed_s=time.perf_counter() - t_start,
            warmup_s=float(warmup_s),
            step_overhead_s=float(overhead), ef=fitted("ef", "ef"),
            write=fitted("ef", "write"),
            comm=CommProfile(**comm_fits), codecs=codec_profiles, host_load=load, loaded=loaded,
            wire_cpu_s_per_byte=float(statistics.median(wire_cpu)) if wire_cpu else 0.0)
        text = prof.to_json()
        logger.info("SeCoPa profile of %d rank(s), %d codec(s) took %.1f s (codec warm-up "
                    "%.1f s + measurements, budget %.0f s)", N, len(codec_profiles),
                    prof.elapsed_s, warmup_s, time_budget_s)
    if N > 1:
        text = comm.bcast(text if clock.root else None, root=0)
    return Profile.from_json(text, "<broadcast>")


# ----------------------------------------------------------------------------- timelines
#: timeline spans the refit reads, and the profile primitive each one measures
_SPAN_OPS = {"encode": "encode", "decode": "decode", "decode+merge": "merge",
             "merge+encode": "merge"}
#: timeline spans of work on the engine's thread or pool (codec kernels, sums, stages, a
#: compressed allreduce's error feedback and result write): what the cost model charges
#: as primitives (``ef``, ``write``), apart from its per-step overhead
_WORK_SPANS = frozenset(_SPAN_OPS) | {"merge", "stage", "feedback", "write"}


def fit_step_overhead(events: Sequence[Dict[str, Any]]) -> Optional[Dict[str, float]]:
    """Return the engine's CPU cost per task step measured in a job, or None if unknown.

    Reads the ``engine-cpu`` events (one per training step and rank: the engine's CPU
    seconds and task steps since the previous step) and the work spans' ``cpu_us``
    (codec kernels, sums: :data:`_WORK_SPANS`). Each rank's first step is left out (it
    includes start-up and kernel compilation), and so are the spans before its end. The
    engine's CPU not spent in work spans, per task step, is its overhead: polling,
    message progress, negotiation and the task graphs' own Python.

    Returns:
        ``{"steps": task steps, "cpu_s": engine CPU, "work_cpu_s": of it in work spans,
        "step_overhead_s": the rest per task step}`` (seconds of CPU), or None when the
        timeline has no usable ``engine-cpu`` events (written by an older HiPress, or one
        step per rank).
    """
    marks: Dict[Any, List[Tuple[float, float, int]]] = {}
    for ev in events:
        if ev.get("name") == "engine-cpu":
            a = ev.get("args") or {}
            marks.setdefault(ev.get("pid", 0), []).append(
                (float(ev.get("ts", 0.0)), float(a.get("cpu_s", 0.0)),
                 int(a.get("task_steps", 0))))
    window: Dict[Any, Tuple[float, float]] = {}
    cpu = 0.0
    steps = 0
    for pid, ms in marks.items():
        ms.sort()
        if len(ms) < 2:
            continue
        window[pid] = (ms[0][0], ms[-1][0])
        for _, c, n in ms[1:]:
            if c >= 0 and n >= 0:  # a pool thread that ended makes a negative delta
                cpu += c
                steps += n
    if steps <= 0:
        return None
    work_cpu = 0.0
    for ev in events:
        pid, a = ev.get("pid", 0), ev.get("args") or {}
        if ev.get("name") in _WORK_SPANS and pid in window and "cpu_us" in a and (
                window[pid][0] <= float(ev.get("ts", 0.0)) <= window[pid][1]):
            work_cpu += float(a["cpu_us"]) * 1e-6
    return {"steps": float(steps), "cpu_s": cpu, "work_cpu_s": work_cpu,
            "step_overhead_s": max(cpu - work_cpu, 0.0) / steps}


def fit_cpu_shares(events: Sequence[Dict[str, Any]]) -> Optional[Dict[str, float]]:
    """Return the share of a core the engine's work got during and after the backward pass.

    A work span (:data:`_WORK_SPANS`, with its ``cpu_us``) belongs to the step of the
    rank's latest ``submit`` event at or before it; it ran during the backward pass if it
    started before that step's last submission on that rank. Each share is the spans' CPU
    time over their wall time (capped at 1).

    Returns:
        ``{"backward": share, "tail": share, "spans_backward": n, "spans_tail": n}``, a
        share 1.0 where no span was seen; None when no span has ``cpu_us`` (a timeline
        of an older HiPress).
    """
    submits: Dict[Any, List[Tuple[float, int]]] = {}
    last: Dict[Tuple[Any, int], float] = {}
    for ev in events:
        if ev.get("name") == "submit":
            pid, ts = ev.get("pid", 0), float(ev.get("ts", 0.0))
            step = int((ev.get("args") or {}).get("step", 0))
            submits.setdefault(pid, []).append((ts, step))
            last[pid, step] = max(last.get((pid, step), ts), ts)
    for lst in submits.values():
        lst.sort()
    sums = {"backward": [0.0, 0.0, 0], "tail": [0.0, 0.0, 0]}
    for ev in events:
        a = ev.get("args") or {}
        if ev.get("name") not in _WORK_SPANS or "cpu_us" not in a:
            continue
        pid, ts = ev.get("pid", 0), float(ev.get("ts", 0.0))
        lst = submits.get(pid, [])
        i = bisect.bisect_right(lst, (ts, float("inf"))) - 1
        during = i >= 0 and ts < last[pid, lst[i][1]]
        acc = sums["backward" if during else "tail"]
        acc[0] += float(a["cpu_us"])
        acc[1] += float(ev.get("dur", 0.0))
        acc[2] += 1
    if not sums["backward"][2] and not sums["tail"][2]:
        return None
    out: Dict[str, float] = {}
    for key, (c, w, n) in sums.items():
        out[key] = min(c / w, 1.0) if n and c > 0 and w > 0 else 1.0
        out[f"spans_{key}"] = float(n)
    return out


def trace_events(trace: Any) -> List[Dict[str, Any]]:
    """Return the complete events of a HiPress timeline (Chrome trace).

    Args:
        trace: a path, or the parsed JSON (a list of events or ``{"traceEvents": [...]}``).

    Raises:
        ProfileError: the file cannot be read or is not a timeline.
    """
    if isinstance(trace, (str, os.PathLike)):
        try:
            with open(trace, encoding="utf-8") as f:
                data = json.load(f)
        except OSError as exc:
            raise ProfileError(f"cannot read timeline {trace}: {exc.strerror}") from None
        except json.JSONDecodeError as exc:
            raise ProfileError(f"timeline {trace} is not JSON: {exc}") from None
    else:
        data = trace
    events = data.get("traceEvents", []) if isinstance(data, dict) else data
    if not isinstance(events, list):
        raise ProfileError("a timeline is a JSON list of events or {\"traceEvents\": [...]}")
    return [e for e in events if isinstance(e, dict) and e.get("ph") == "X"]


def _codec_span(ev: Dict[str, Any]) -> Optional[Tuple[str, float, float]]:
    """Return ``(codec, numel, seconds)`` of a codec's work span, or None if it names none.

    The seconds are the span's CPU time where recorded (``cpu_us``: what the kernels
    cost; the wall time a shared core stretches it to is the ``cpu_share_*`` of
    :func:`fit_cpu_shares`), else its duration (timelines of older versions).
    """
    args = ev.get("args") or {}
    name, numel = args.get("codec"), args.get("numel")
    if not name or not isinstance(numel, (int, float)) or numel < 1:
        return None
    dur = float(args["cpu_us"] if "cpu_us" in args else ev.get("dur", 0.0)) * 1e-6
    return str(name), float(numel), dur


def refit_from_timeline(profile: Profile, trace: Any, source: str = "") -> Tuple[
        Profile, Dict[str, Dict[str, Any]]]:
    """Scale a profile's compute costs to what a real job's timeline measured.

    A profile is measured on its own, while in training the codecs share the cores with the
    backward pass and with the other ranks on the host: on this project's two-core machines
    they ran 2-4x slower there. This reads the job's ``encode``, ``decode``,
    ``decode+merge`` and ``merge+encode`` spans (a timeline written with ``timeline:
    trace.json``), divides each span's CPU time (its ``cpu_us``; its duration in timelines
    of older versions) by what ``profile`` predicts for it (encode:
    ``encode`` plus, with error feedback, ``decode`` and ``ef``; decode: ``decode`` +
    ``write``; decode+merge of P payloads: P ``merge``; the aggregator's fused
    ``merge+encode`` of P payloads: P ``merge`` and an encode, its ratio counted for
    ``merge``; the compressed allreduce's ``reduce_stages`` spans of one gradient and
    step, summed: ``stages``), and scales each codec's fits by the median of those ratios
    (:meth:`Fit.scaled`: the per-byte slopes, which dominate large gradients), ``ef`` and
    ``write`` by the encode and decode factors of the codec seen most. ``round_s`` becomes
    the median interval between the timeline's negotiation rounds (rank 0's),
    ``step_overhead_s`` the engine's measured CPU per task step (:func:`fit_step_overhead`,
    from the ``engine-cpu`` events a timeline of this version has: polling, message
    progress and the task graphs' Python, which a profile's short chain of no-op steps
    does not see), and ``cpu_share_backward`` / ``cpu_share_tail`` the share of a core the
    engine's work got during and after the backward pass (:func:`fit_cpu_shares`): the
    cost model stretches compute by the first, the pipeline simulation by each in its
    phase. Message costs are kept (the timeline's waits include time spent waiting for
    other ranks, not only the wire).

    Args:
        profile: the measured profile to start from.
        trace: a timeline path, or its parsed JSON (a list of events or a
            ``{"traceEvents": [...]}`` object).
        source: what to record as ``Profile.source`` (default ``timeline:<path>``).

    Returns:
        ``(refitted profile, report)``, the report per ``codec/primitive``:
        ``{"spans": count, "factor": median ratio, "p20": ..., "p80": ...}``; when
        measured, under ``engine/step`` :func:`fit_step_overhead`'s figures plus
        ``profiled_s`` (the profile's own ``step_overhead_s``), and under
        ``engine/cpu-share`` :func:`fit_cpu_shares`'.

    Raises:
        ProfileError: the timeline cannot be read, or has no codec spans this profile
            knows (it names the codecs it found).
    """
    ratios: Dict[Tuple[str, str], List[float]] = {}
    seen: Dict[str, int] = {}
    by_name: Dict[str, CodecProfile] = {}
    for cp in profile.codecs.values():  # the first entry of each name, as Profile.codec
        by_name.setdefault(cp.name, cp)
    events = trace_events(trace)
    rounds = sorted(float(e.get("ts", 0.0)) for e in events
                    if e.get("name") == "negotiate" and e.get("pid", 0) == 0)
    # a compressed allreduce's reduce_stages spans (``stage`` in their args), summed per
    # gradient and step: (rank, gradient) -> [codec, numel, CPU s] of the current step's
    stage_sums: Dict[Tuple[Any, str], List[Any]] = {}
    stage_groups: List[List[Any]] = []
    for ev in sorted(events, key=lambda e: (str(e.get("pid", 0)), float(e.get("ts", 0.0)))):
        args = ev.get("args") or {}
        span = _codec_span(ev)
        if ev.get("name") not in ("encode", "stage") or "stage" not in args or span is None:
            continue  # (span None: a timeline of an older version, its stages name no codec)
        name, numel, dur = span
        key = (ev.get("pid", 0), str(args.get("gradient")))
        if args.get("stage") == 0 or key not in stage_sums:
            stage_sums[key] = [name, numel, 0.0]
            stage_groups.append(stage_sums[key])
        stage_sums[key][2] += dur
    for name, numel, dur in stage_groups:
        seen[name] = seen.get(name, 0) + 1
        cp = by_name.get(name)
        pred = cp.stages(4.0 * numel) if cp is not None and cp.stages is not None else 0.0
        if pred > 0 and dur > 0:
            ratios.setdefault((name, "stages"), []).append(dur / pred)
    for ev in events:
        op = _SPAN_OPS.get(str(ev.get("name")))
        args = ev.get("args") or {}
        span = _codec_span(ev)
        if op is None or span is None or "stage" in args:
            continue
        name, numel, dur = span
        if op == "decode" and args.get("reused"):
            continue  # only stored: its own payload's decode was reused
        seen[name] = seen.get(name, 0) + 1
        cp = by_name.get(name)
        if cp is None:
            continue
        x = 4.0 * numel
        if op == "encode":
            pred = cp.encode(x) + (cp.decode(x) + profile.ef(x) if args.get("feedback") else 0.0)
        elif op == "decode":
            pred = cp.decode(x) + profile.write(x)
        else:
            pred = max(int(args.get("payloads", 1)), 1) * cp.merge(x)
            if ev.get("name") == "merge+encode":  # a fused pass: the re-encode too
                pred += cp.encode(x) + (cp.decode(x) + profile.ef(x)
                                        if args.get("feedback") else 0.0)
        if pred > 0 and dur > 0:
            ratios.setdefault((name, op), []).append(dur / pred)
    if not ratios:
        raise ProfileError(
            "the timeline has no codec spans (encode, decode, merge, stages) of a codec this "
            "profile knows (found "
            f"{', '.join(f'{k} x{v}' for k, v in sorted(seen.items())) or 'none'}; profile "
            f"has {', '.join(sorted({c.name for c in profile.codecs.values()})) or 'none'}). "
            "Write the timeline with this HiPress version (timeline: trace.json) and profile "
            "the codecs the job uses")
    report: Dict[str, Dict[str, Any]] = {}
    factor: Dict[Tuple[str, str], float] = {}
    for (name, op), rs in sorted(ratios.items()):
        p20, med, p80 = (float(v) for v in np.percentile(rs, [20, 50, 80]))
        factor[name, op] = med
        report[f"{name}/{op}"] = {"spans": len(rs), "factor": med, "p20": p20, "p80": p80}
    codecs = {}
    for key, cp in profile.codecs.items():
        upd = {op: getattr(cp, op).scaled(factor[cp.name, op])
               for op in ("encode", "decode", "merge", "stages")
               if (cp.name, op) in factor and getattr(cp, op) is not None}
        codecs[key] = cp.model_copy(update=upd)
    main = max((n for n, _ in factor), key=lambda n: sum(
        len(ratios.get((n, op), [])) for op in _SPAN_OPS.values()))
    upd_prof: Dict[str, Any] = {"codecs": codecs, "source": source or (
        f"timeline:{trace}" if isinstance(trace, (str, os.PathLike)) else "timeline")}
    if (main, "encode") in factor:
        upd_prof["ef"] = profile.ef.scaled(factor[main, "encode"])
    if (main, "decode") in factor:
        upd_prof["write"] = profile.write.scaled(factor[main, "decode"])
    if len(rounds) >= 2:
        upd_prof["round_s"] = float(np.median(np.diff(rounds))) * 1e-6
    overhead = fit_step_overhead(events)
    if overhead is not None:
        upd_prof["step_overhead_s"] = overhead["step_overhead_s"]
        report["engine/step"] = dict(overhead, profiled_s=profile.step_overhead_s)
    shares = fit_cpu_shares(events)
    if shares is not None:
        upd_prof["cpu_share_backward"] = shares["backward"]
        upd_prof["cpu_share_tail"] = shares["tail"]
        report["engine/cpu-share"] = shares
    return profile.model_copy(update=upd_prof), report
