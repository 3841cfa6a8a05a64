"""SeCoPa's planner: compress or not, how many partitions and which path, per gradient.

For each gradient the planner evaluates the cost model (:mod:`hipress.secopa.cost`) for
every option and keeps the cheapest (Bai et al., SOSP'21, section 4):

1. Options: leave it uncompressed (fused allreduce), or compress it on each path the
   engine would allow for the codec and strategy (:func:`~hipress.secopa.cost.engine_paths`)
   with K partitions for every K in :func:`partition_candidates` (PS and Ring; the
   other paths take no partitions): every integer up to 32, then a geometric grid with
   ratio about 1.1 up to ``max_partitions`` (default 1024), all <= numel. Small K are
   where the optimum usually lies and where one partition more matters; for huge
   gradients (VGG-19's fc6 is 411 MB) the optimum can be in the hundreds, where a 10 %
   grid is as good as exhaustive for a model whose inputs are measured to a few percent.
2. Never compressed: a gradient with 0 elements, no codec or the ``none`` codec, and a
   gradient whose compression ratio for the codec (original bytes / payload bytes, from
   ``codec.compression_ratio`` at the gradient's shape; flat when unknown) is <= 1: the
   wire would not get smaller.
3. Ties go to the option listed first: uncompressed, then paths in the order ps, ring,
   allreduce, gather, then the smaller K.

The plan's total is the sum of the chosen options plus the fused allreduce's fixed cost
once if any gradient is uncompressed. Because that fixed cost is shared, the planner also
compares with the best all-compressed plan and keeps the cheaper, which makes the plan the
exact minimum of the model over every combination of per-gradient options. :func:`decide`
(one gradient at a time, used at run time) treats the shared fixed cost as already paid.

Given the gradients' arrival times over a backward pass (``hipress plan --timeline``), the
per-gradient sum is only a starting point: gradients overlap with each other and with
the backward pass, so the plan becomes the one with the least simulated delay per
iteration (:func:`hipress.secopa.pipeline.simulate`, exposed sync time plus the engine's
CPU taken from the backward pass): the best of the per-gradient optimum,
compress-everything and the ``threshold`` policy (both keeping rule 2) and
compress-nothing, improved by a local search over each gradient's options (uncompressed,
the cheapest few compressed ones, about half and twice their partitions), largest
gradients first. It is never predicted slower than those starting points. The plan
leaves the best fixed policy (compress-everything, threshold or compress-nothing) only
when the search predicts it at least ``min_gain`` (default :data:`DEFAULT_MIN_GAIN`, 3 %)
of the iteration faster, the iteration taken as the last arrival plus that policy's
delay: a smaller predicted gain is inside the model's error and the run-to-run spread of
a step (a measured ResNet-50 onebit plan predicted 2.5 % less delay than the threshold
policy ran 7 % slower, bench/README.md). :attr:`Plan.basis`
records which it is.

Baselines predicted alongside (same model): ``compress_everything`` (every gradient with
an element compressed, best path and K each), ``compress_nothing`` and ``threshold`` (the
engine's default policy: compress gradients of at least ``min_compress_bytes`` bytes, in
``ceil(bytes / partition_bytes)`` partitions, on the engine's default path).
"""

from __future__ import annotations

import json
import math
import os
from typing import Any, Callable, Dict, List, Literal, Optional, Sequence, Tuple

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    model_validator,
)

from hipress.codecs import Codec
from hipress.engine.planning import Decision
from hipress.secopa.cost import (
    DEFAULT_FUSION_BYTES,
    DEFAULT_PARTITION_BYTES,
    Cost,
    CostModel,
    engine_paths,
)
from hipress.secopa.errors import PlanError, SeCoPaError, format_validation_error
from hipress.secopa.pipeline import UNCOMPRESSED, Simulation, simulate
from hipress.secopa.profile import Profile

PLAN_VERSION = 1
#: default upper bound of partitions per gradient
DEFAULT_MAX_PARTITIONS = 1024
#: every K up to this is a candidate; above it a geometric grid (ratio _K_RATIO)
_K_DENSE = 32
_K_RATIO = 1.1
#: the engine's defaults, for the ``threshold`` baseline
DEFAULT_MIN_COMPRESS_BYTES = 65536
#: names of the predicted totals
TOTALS = ("plan", "compress_everything", "threshold", "compress_nothing")
#: least predicted gain, as a fraction of the iteration, for which a plan made with
#: arrival times leaves the best fixed policy (module docstring)
DEFAULT_MIN_GAIN = 0.03

_STRICT = ConfigDict(extra="forbid", strict=True)
Strategy = Literal["ps", "ring", "allreduce", "gather", "fused"]


class PlanEntry(BaseModel):
    """The decision for one gradient.

    Attributes:
        name: the gradient's name.
        numel: its number of elements.
        compress: compress it (else it goes uncompressed through fused buffers).
        partitions: partitions K (1 unless the strategy is ps or ring).
        strategy: the engine path: ps, ring, allreduce, gather, or fused (uncompressed).
        predicted_ms: the model's time for it, milliseconds.
    """

    model_config = _STRICT

    name: str = Field(min_length=1)
    numel: int = Field(ge=0)
    compress: bool
    partitions: int = Field(ge=1)
    strategy: Strategy
    predicted_ms: float = Field(ge=0)

    @model_validator(mode="after")
    def _consistent(self) -> PlanEntry:
        if self.partitions > max(self.numel, 1):
            raise ValueError(f"partitions ({self.partitions}) must be <= numel ({self.numel})")
        if not self.compress and self.strategy != "fused":
            raise ValueError(f"an uncompressed gradient has strategy 'fused', got "
                             f"{self.strategy!r}")
        if self.compress and self.strategy == "fused":
            raise ValueError("a compressed gradient needs strategy ps, ring, allreduce or gather")
        if self.strategy not in ("ps", "ring") and self.partitions != 1:
            raise ValueError(f"strategy {self.strategy!r} takes 1 partition, got "
                             f"{self.partitions}")
        return self


class Plan(BaseModel):
    """A per-gradient SeCoPa plan (the ``sync.plan`` file).

    Attributes:
        version: file format version (:data:`PLAN_VERSION`).
        codec: codec name the plan was made for; codec_params: its parameters.
        strategy: the strategy asked for (ps, ring or auto).
        world_size: N the plan was made for.
        feedback: residual error feedback was assumed on.
        max_partitions: the search bound for K.
        profile: where the costs came from (path, world size, hosts, created).
        predicted_ms: per-iteration totals: plan, compress_everything, threshold,
            compress_nothing (sums of per-gradient times).
        predicted_exposed_ms: the same policies' exposed sync time per iteration, from
            :func:`hipress.secopa.pipeline.simulate` over the gradients' arrival times
            (empty when the plan was made without them).
        predicted_delay_ms: the same simulations' delay per iteration (exposed time plus
            the engine's CPU during the backward pass,
            :attr:`~hipress.secopa.pipeline.Simulation.delay_s`): what the plan minimizes
            when arrival times are known.
        basis: ``search`` (the choices the planner searched for), or the fixed policy
            the plan is, ``threshold``, ``compress_everything`` or ``compress_nothing``,
            when the search predicted less than ``min_gain`` of the iteration over it
            (plans made with arrival times; module docstring).
        min_gain: the ``min_gain`` the plan was made with (fraction of the iteration).
        gradients: one :class:`PlanEntry` per gradient, names unique.
    """

    model_config = _STRICT

    version: Literal[1]
    codec: str = Field(min_length=1)
    codec_params: Dict[str, Any] = Field(default_factory=dict)
    strategy: Literal["ps", "ring", "auto"]
    world_size: int = Field(ge=1)
    feedback: bool = False
    max_partitions: int = Field(DEFAULT_MAX_PARTITIONS, ge=1)
    profile: Dict[str, Any] = Field(default_factory=dict)
    predicted_ms: Dict[str, float] = Field(default_factory=dict)
    predicted_exposed_ms: Dict[str, float] = Field(default_factory=dict)
    predicted_delay_ms: Dict[str, float] = Field(default_factory=dict)
    basis: Literal["search", "threshold", "compress_everything", "compress_nothing"] = "search"
    min_gain: float = Field(DEFAULT_MIN_GAIN, ge=0.0, lt=1.0)
    gradients: List[PlanEntry]
    _index: Optional[Dict[str, PlanEntry]] = PrivateAttr(default=None)

    @model_validator(mode="after")
    def _unique(self) -> Plan:
        seen: Dict[str, int] = {}
        for i, g in enumerate(self.gradients):
            if g.name in seen:
                raise ValueError(f"gradients.{i}.name: {g.name!r} repeats gradients."
                                 f"{seen[g.name]}.name; names must be unique")
            seen[g.name] = i
        return self

    def decisions(self) -> Dict[str, Decision]:
        """Return the engine's :class:`~hipress.engine.planning.Decision` per gradient name.

        This is what :func:`hipress.secopa.pipeline.simulate` takes as ``choices``.
        """
        return {g.name: Decision(g.compress, g.partitions, g.strategy) for g in self.gradients}

    def entry(self, name: str) -> Optional[PlanEntry]:
        """Return the entry of gradient ``name``, or None if the plan has none."""
        if self._index is None or len(self._index) != len(self.gradients):
            self._index = {g.name: g for g in self.gradients}
        return self._index.get(name)

    # ------------------------------------------------------------------ files
    @classmethod
    def from_json(cls, text: str, origin: str = "<memory>") -> Plan:
        """Parse and validate a plan from JSON text.

        Raises:
            PlanError: not JSON, or a field is missing or invalid; the message names the
                field (e.g. ``gradients.3.partitions``).
        """
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise PlanError(f"invalid SeCoPa plan {origin}: not JSON ({exc.msg} at line "
                            f"{exc.lineno} column {exc.colno}); write one with `hipress plan`"
                            ) from None
        if not isinstance(data, dict):
            raise PlanError(f"invalid SeCoPa plan {origin}: expect a JSON object, got "
                            f"{type(data).__name__}")
        if "version" in data and data["version"] != PLAN_VERSION:
            raise PlanError(f"invalid SeCoPa plan {origin}: version: {data['version']!r} is "
                            f"not supported (expect {PLAN_VERSION}); re-run `hipress plan`")
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            raise PlanError(format_validation_error("SeCoPa plan", origin, exc)) from None

    @classmethod
    def load(cls, path: Any) -> Plan:
        """Read a plan file written by :meth:`save` (or ``hipress plan``).

        Raises:
            PlanError: missing, not JSON, or invalid (names the field).
        """
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except OSError as exc:
            raise PlanError(f"cannot read SeCoPa plan {path}: {exc.strerror}") from None
        return cls.from_json(text, str(path))

    def to_json(self) -> str:
        """Return the plan as JSON text (one gradient per line)."""
        head = self.model_dump(mode="json", exclude={"gradients"})
        body = ",\n  ".join(json.dumps(g.model_dump(mode="json")) for g in self.gradients)
        text = json.dumps(head, indent=1)
        return text[:-2] + f',\n "gradients": [\n  {body}\n ]\n}}'

    def save(self, path: Any) -> None:
        """Write the plan as JSON (atomically)."""
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(self.to_json())
            f.write("\n")
        os.replace(tmp, path)


# ----------------------------------------------------------------------------- deciding
def _flat_numel(shape: Any) -> int:
    if isinstance(shape, int):
        return int(shape)
    return int(math.prod(int(d) for d in shape))


def _as_shape(shape: Any) -> Tuple[int, ...]:
    """A gradient's shape as a tuple: an int element count becomes a 1-D shape."""
    return (shape,) if isinstance(shape, int) else tuple(shape)


def may_compress(codec: Optional[Codec], numel: int, shape: Any = None) -> bool:
    """Return False when compressing cannot pay off whatever the costs (see module doc)."""
    if codec is None or codec.name == "none" or numel < 1:
        return False
    shp = (int(numel),) if shape is None or isinstance(shape, int) else tuple(shape)
    return codec.compression_ratio(shp) > 1.0


def partition_candidates(numel: int, max_partitions: int = DEFAULT_MAX_PARTITIONS
                         ) -> List[int]:
    """Return the partition counts K the planner tries for a gradient of ``numel`` elements.

    Every K in ``1 .. 32``, then ``round(32 * 1.1**i)`` (distinct values) up to
    ``max_partitions``, and ``max_partitions`` itself; all capped at ``numel``.
    """
    top = max(1, min(int(max_partitions), int(numel)))
    ks = list(range(1, min(top, _K_DENSE) + 1))
    k = float(_K_DENSE)
    while True:
        k *= _K_RATIO
        nxt = int(round(k))
        if nxt >= top:
            break
        if nxt > ks[-1]:
            ks.append(nxt)
    if ks[-1] != top:
        ks.append(top)
    return ks


def options(model: CostModel, codec: Optional[Codec], numel: int, strategy: str,
            feedback: bool = False, max_partitions: int = DEFAULT_MAX_PARTITIONS,
            allow_uncompressed: bool = True, force: bool = False,
            shape: Any = None) -> List[Tuple[bool, Cost]]:
    """Return every option the planner considers for one gradient, in tie-break order.

    Args:
        model: the cost model.
        codec: the codec (None: uncompressed only).
        numel: elements of the gradient.
        strategy: ps, ring or auto.
        feedback: residual error feedback on.
        max_partitions: largest K tried.
        allow_uncompressed: include the uncompressed option.
        force: include compressed options even when :func:`may_compress` says no.
        shape: the gradient's shape (the compressed allreduce encodes it unflattened).

    Returns:
        ``[(compress, Cost)]``.
    """
    out: List[Tuple[bool, Cost]] = []
    if allow_uncompressed:
        out.append((False, model.uncompressed(numel)))
    if codec is None or numel < 1 or not (force or may_compress(codec, numel, shape)):
        return out
    shp = None if shape is None or isinstance(shape, int) else tuple(shape)
    for path in engine_paths(codec, strategy):
        ks = partition_candidates(numel, max_partitions) if path in ("ps", "ring") else [1]
        for k in ks:
            out.append((True, model.compressed(codec, numel, path, k, feedback, shp)))
    return out


def _best(opts: Sequence[Tuple[bool, Cost]]) -> Tuple[bool, Cost]:
    best = opts[0]
    for o in opts[1:]:
        if o[1].total_s < best[1].total_s:
            best = o
    return best


#: compressed options per gradient the pipeline search tries: the cheapest by the
#: per-gradient model, then those with half and twice its partitions
_SEARCH_KEEP = 3


def _near_best(opts: Sequence[Tuple[bool, Cost]]) -> List[Tuple[bool, Cost]]:
    """Return a few compressed options for the pipeline search (see :data:`_SEARCH_KEEP`).

    The cheapest ``_SEARCH_KEEP`` by the per-gradient model (one per path and K), and the
    options of the best one's path with about half and twice its K: fewer partitions put
    less on the engine while the backward pass runs, more pipeline better after it.
    """
    if not opts:
        return []
    ranked = sorted(opts, key=lambda o: o[1].total_s)
    out = ranked[:_SEARCH_KEEP]
    best = ranked[0][1]
    same = [o for o in opts if o[1].path == best.path]
    for target in (best.partitions / 2, best.partitions * 2):
        near = min(same, key=lambda o: abs(o[1].partitions - target))
        if all(near is not o for o in out):
            out.append(near)
    return out


def _pipeline_search(run: Callable[[Sequence[Tuple[bool, Cost]]], Simulation],
                     starts: Sequence[Sequence[Tuple[bool, Cost]]],
                     alternatives: Sequence[Sequence[Tuple[bool, Cost]]],
                     numels: Sequence[int], passes: int = 2) -> List[Tuple[bool, Cost]]:
    """Return the choices with the least simulated delay found by a local search.

    Starts from the best of ``starts`` (the per-gradient optimum, the fixed policies) by
    :attr:`Simulation.delay_s`, then, largest gradient first, replaces one gradient's
    choice by each of its ``alternatives`` and keeps a change that lowers the delay by
    more than a microsecond; at most ``passes`` sweeps, fewer when one changes nothing.
    Never worse than the best start.
    """
    score, best = min(((run(c).delay_s, i) for i, c in enumerate(starts)))
    cur = list(starts[best])
    order = sorted(range(len(cur)), key=lambda i: -numels[i])
    for _ in range(passes):
        changed = False
        for i in order:
            keep = cur[i]
            for alt in alternatives[i]:
                if alt is keep:
                    continue
                cur[i] = alt
                got = run(cur).delay_s
                if got < score - 1e-6:
                    score, keep, changed = got, alt, True
            cur[i] = keep
        if not changed:
            break
    return cur


def _entry(name: str, numel: int, choice: Tuple[bool, Cost]) -> PlanEntry:
    compress, cost = choice
    return PlanEntry(name=name, numel=int(numel), compress=bool(compress),
                     partitions=cost.partitions if compress and cost.path in ("ps", "ring")
                     else 1,
                     strategy=cost.path if compress else "fused",
                     predicted_ms=max(cost.total_s, 0.0) * 1e3)


def _feedback(codec: Optional[Codec], memory: str) -> bool:
    if codec is None or memory == "none":
        return False
    return bool(codec.error_feedback) if memory == "auto" else True


def decide(profile: Any, numel: int, shape: Any, codec: Optional[Codec], strategy: str,
           world_size: int, name: str = "gradient", memory: str = "auto",
           max_partitions: int = DEFAULT_MAX_PARTITIONS,
           fusion_bytes: int = DEFAULT_FUSION_BYTES,
           partition_bytes: int = DEFAULT_PARTITION_BYTES) -> PlanEntry:
    """Decide compress / partitions / path for one gradient (the run-time entry point).

    Args:
        profile: a :class:`Profile` or an existing :class:`CostModel` for ``world_size``
            (pass the model to reuse its caches across gradients).
        numel: elements of the gradient.
        shape: its shape (the compressed allreduce path encodes it unflattened; the
            other paths encode flat partitions); None means ``(numel,)``.
        codec: the codec, or None.
        strategy: ps, ring or auto.
        world_size: N.
        name: the gradient's name, for the entry.
        memory: the config's ``compression.memory`` (auto, none, residual, dgc): whether
            the engine's encode step includes error feedback.
        max_partitions: largest K tried.
        fusion_bytes: the engine's fused-buffer size.
        partition_bytes: the engine's ``sync.partition_bytes`` (the gather path's
            partitions).

    Returns:
        The :class:`PlanEntry` minimizing the cost model (the shared fused fixed cost is
        taken as already paid).

    Raises:
        SeCoPaError: bad strategy or world size; ProfileError: the codec is not profiled.
    """
    if shape is not None and _flat_numel(shape) != int(numel):
        raise SeCoPaError(f"gradient {name!r}: shape {tuple(shape)} does not have {numel} "
                          "elements")
    model = profile if isinstance(profile, CostModel) else CostModel(
        profile, world_size, fusion_bytes, partition_bytes)
    if model.N != int(world_size):
        raise SeCoPaError(f"cost model is for world size {model.N}, not {world_size}")
    opts = options(model, codec, int(numel), strategy, _feedback(codec, memory), max_partitions,
                   shape=shape)
    return _entry(name, numel, _best(opts))


def load_gradients(spec: Any) -> List[Tuple[str, Tuple[int, ...]]]:
    """Return ``[(name, shape)]`` from a gradient-set JSON file or a shipped set's name.

    Args:
        spec: a path to a JSON file ``{"gradients": [{"name", "shape"}, ...]}`` (or a bare
            list of such objects), or the name of a shipped set (``vgg19``, ``resnet50``,
            ``bert-base``; see ``hipress/data/gradients``).

    Raises:
        SeCoPaError: unreadable file, unknown name, or malformed entries (names the
            entry and field).
    """
    here = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data", "gradients")
    path = str(spec)
    if not os.path.exists(path):
        shipped = os.path.join(here, f"{path}.json")
        if os.path.exists(shipped):
            path = shipped
        else:
            names = sorted(f[:-5] for f in os.listdir(here) if f.endswith(".json"))
            raise SeCoPaError(f"gradient set {spec!r} is neither a file nor a shipped set "
                              f"({', '.join(names)})")
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise SeCoPaError(f"cannot read gradient set {path}: {exc}") from None
    items = data.get("gradients") if isinstance(data, dict) else data
    if not isinstance(items, list):
        raise SeCoPaError(f"gradient set {path}: expect a list under 'gradients'")
    out = []
    for i, g in enumerate(items):
        if not isinstance(g, dict) or not isinstance(g.get("name"), str):
            raise SeCoPaError(f"gradient set {path}: gradients.{i}.name: expect a string")
        shape = g.get("shape")
        if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
            raise SeCoPaError(f"gradient set {path}: gradients.{i}.shape: expect a list of "
                              f"non-negative integers, got {shape!r}")
        out.append((g["name"], tuple(shape)))
    return out


def plan(profile: Profile, gradients: Sequence[Tuple[str, Any]], codec: Optional[Codec],
         strategy: str, world_size: int, max_partitions: int = DEFAULT_MAX_PARTITIONS,
         memory: str = "auto", fusion_bytes: int = DEFAULT_FUSION_BYTES,
         min_compress_bytes: int = DEFAULT_MIN_COMPRESS_BYTES,
         partition_bytes: int = DEFAULT_PARTITION_BYTES,
         profile_source: str = "",
         arrivals: Optional[Sequence[Tuple[str, int, float]]] = None,
         min_gain: float = DEFAULT_MIN_GAIN) -> Plan:
    """Plan a whole gradient set (see the module docstring for the rule and the totals).

    Args:
        profile: the measured profile.
        gradients: ``[(name, shape)]`` (shape a tuple, or an int element count).
        codec: the codec (None plans everything uncompressed).
        strategy: ps, ring or auto.
        world_size: N.
        max_partitions: largest K tried.
        memory: the config's ``compression.memory``.
        fusion_bytes: the engine's fused-buffer size (``sync.fusion_threshold_bytes``).
        min_compress_bytes: ``compression.min_compress_bytes``, for the ``threshold``
            baseline only.
        partition_bytes: ``sync.partition_bytes``, for the ``threshold`` baseline, the
            simulation's bulk groups and the gather path's partitions.
        profile_source: where the profile came from (recorded in the plan).
        arrivals: ``(name, numel, ready_s)`` of the gradients over a backward pass
            (:func:`hipress.secopa.pipeline.arrivals_from_timeline`); with them the plan
            minimizes the simulated delay (module docstring) and each policy's exposed
            time and delay are simulated into ``predicted_exposed_ms`` and
            ``predicted_delay_ms`` (gradients without an arrival are taken as ready at the
            end).
        min_gain: with ``arrivals``, the least predicted gain over the best fixed policy,
            as a fraction of the iteration (last arrival plus that policy's simulated
            delay, seconds), for which the plan leaves that policy; 0 keeps whatever the
            search found. Unused without arrivals.

    Returns:
        The :class:`Plan`, with totals in ``predicted_ms`` (and ``predicted_exposed_ms``).

    Raises:
        SeCoPaError: bad strategy, world size, gradients or ``min_gain`` (not in [0, 1));
            ProfileError: the codec is not in the profile or N > 1 with a one-rank
            profile.
    """
    if strategy not in ("ps", "ring", "auto"):
        raise SeCoPaError(f"strategy must be ps, ring or auto, got {strategy!r}")
    if not 0.0 <= float(min_gain) < 1.0:
        raise SeCoPaError(f"min_gain is a fraction of the iteration in [0, 1), got {min_gain!r}"
                          " (0.03 leaves a fixed policy for a predicted gain of 3 % or more)")
    if int(max_partitions) < 1:
        raise SeCoPaError(f"max_partitions must be >= 1, got {max_partitions}")
    model = CostModel(profile, world_size, fusion_bytes, partition_bytes)
    fb = _feedback(codec, memory)
    fixed = model.fused_fixed()
    names = [str(n) for n, _ in gradients]
    numels = [_flat_numel(s) for _, s in gradients]
    shapes = [_as_shape(s) for _, s in gradients]
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise SeCoPaError(f"gradient names must be unique; repeated: {dup}")

    best_any: List[Tuple[bool, Cost]] = []
    best_comp: List[Optional[Tuple[bool, Cost]]] = []
    forced: List[Tuple[bool, Cost]] = []
    #: per gradient, the options the pipeline search tries (uncompressed first)
    alternatives: List[List[Tuple[bool, Cost]]] = []
    for n, shp in zip(numels, shapes):
        unc = (False, model.uncompressed(n))
        comp = options(model, codec, n, strategy, fb, max_partitions,
                       allow_uncompressed=False, force=True, shape=shp)
        allowed = comp if may_compress(codec, n, shp) else []
        best_any.append(_best([unc] + allowed))
        best_comp.append(_best(allowed) if allowed else None)
        forced.append(_best(comp) if comp else unc)
        alternatives.append([unc] + _near_best(allowed))

    def total(choices: Sequence[Tuple[bool, Cost]]) -> float:
        t = sum(c.total_s for _, c in choices)
        return t + (fixed if any(not comp for comp, _ in choices) else 0.0)

    chosen = best_any
    if any(not c for c, _ in best_any) and all(b is not None for b in best_comp):
        alt = [b for b in best_comp if b is not None]
        if total(alt) < total(best_any):
            chosen = alt

    path0 = engine_paths(codec, strategy)
    default_path = ("allreduce" if codec is not None and codec.summable and "allreduce" in path0
                    else (path0[0] if path0 else "fused"))
    threshold: List[Tuple[bool, Cost]] = []
    for n, shp in zip(numels, shapes):
        nbytes = 4 * n
        if codec is None or codec.name == "none" or n < 1 or nbytes < min_compress_bytes:
            threshold.append((False, model.uncompressed(n)))
        else:
            k = max(1, math.ceil(nbytes / partition_bytes))
            threshold.append((True, model.compressed(codec, n, default_path, k, fb, shp)))

    nothing = [(False, model.uncompressed(n)) for n in numels]
    totals = {
        "plan": total(chosen),
        "compress_everything": total(forced),
        "threshold": total(threshold),
        "compress_nothing": total(nothing),
    }
    exposed: Dict[str, float] = {}
    delay: Dict[str, float] = {}
    basis = "search"
    if arrivals is not None:
        arr = _aligned_arrivals(names, numels, arrivals)
        end = max((float(a[2]) for a in arrivals), default=0.0)
        shape_of = dict(zip(names, shapes))

        def run(choices: Sequence[Tuple[bool, Cost]]) -> Simulation:
            ch = {nm: Decision(True, c.partitions, c.path) if comp else UNCOMPRESSED
                  for nm, (comp, c) in zip(names, choices)}
            return simulate(model, arr, ch, codec, fb, partition_bytes, shape_of)

        # the fixed policies as starts keep rule 2: what does not shrink stays fused
        def rule2(choices: Sequence[Tuple[bool, Cost]]) -> List[Tuple[bool, Cost]]:
            return [unc if c[0] and comp is None else c
                    for c, comp, unc in zip(choices, best_comp, nothing)]

        fixed_starts = {"compress_everything": rule2(forced), "threshold": rule2(threshold),
                        "compress_nothing": nothing}
        chosen = _pipeline_search(run, [chosen, *fixed_starts.values()], alternatives, numels)
        fixed_delay = {k: run(c).delay_s for k, c in fixed_starts.items()}
        best_fixed = min(fixed_delay, key=fixed_delay.__getitem__)  # the first of equals
        margin = float(min_gain) * (end + fixed_delay[best_fixed])
        if run(chosen).delay_s >= fixed_delay[best_fixed] - margin:
            chosen, basis = fixed_starts[best_fixed], best_fixed
        policies = {"plan": chosen, "compress_everything": forced, "threshold": threshold,
                    "compress_nothing": nothing}
        for key, choices in policies.items():
            sim = run(choices)
            exposed[key] = sim.exposed_s * 1e3
            delay[key] = sim.delay_s * 1e3
        totals["plan"] = total(chosen)
    entries = [_entry(name, n, ch) for name, n, ch in zip(names, numels, chosen)]
    return Plan(
        version=PLAN_VERSION,
        codec=codec.name if codec is not None else "none",
        codec_params=json.loads(json.dumps(codec.params())) if codec is not None else {},
        strategy=strategy, world_size=int(world_size), feedback=fb,
        max_partitions=int(max_partitions),
        profile={"source": profile_source, "world_size": profile.world_size,
                 "hosts": sorted(set(profile.hosts)), "created": profile.created},
        predicted_ms={k: v * 1e3 for k, v in totals.items()},
        predicted_exposed_ms=exposed, predicted_delay_ms=delay, basis=basis,
        min_gain=float(min_gain), gradients=entries)


def option_table(p: Plan, profile: Profile, gradients: Sequence[Tuple[str, Any]],
                 codec: Optional[Codec], fusion_bytes: int = DEFAULT_FUSION_BYTES,
                 arrivals: Optional[Sequence[Tuple[str, int, float]]] = None,
                 partition_bytes: int = DEFAULT_PARTITION_BYTES) -> str:
    """Return, per gradient, the predicted time of every option and why the plan chose one.

    ``hipress plan -v`` prints it. Columns: the uncompressed (fused) time, the best time
    of each compressed path with its partition count K (each alone, ms), with
    ``arrivals`` the iteration's simulated delay if this gradient alone took each of
    those options instead of the plan's, as a difference from the plan's delay (``+ms``
    columns: 0 for the option the plan took, positive for a slower iteration), then the
    plan's choice and why:
    ``fastest`` (the minimum of the row), ``not shrinkable`` (the codec does not make
    this gradient smaller, :func:`may_compress`), ``no fused buffer`` (compressed
    although slower alone, because then no gradient goes uncompressed and the fused
    buffer's fixed cost per iteration is saved), or, for a plan made with arrival times,
    ``least delay`` (slower alone, but the iteration's simulated delay is smaller: it
    overlaps the backward pass or other gradients) or, when the plan is a fixed policy
    (:attr:`Plan.basis`), that policy's name.

    Args:
        p: the plan :func:`plan` made from the same arguments.
        profile: the profile given to :func:`plan`.
        gradients: the ``[(name, shape)]`` given to :func:`plan`.
        codec: the codec given to :func:`plan`.
        fusion_bytes: the fused-buffer size given to :func:`plan`.
        arrivals: the arrivals given to :func:`plan` (None: no ``+ms`` columns).
        partition_bytes: the ``partition_bytes`` given to :func:`plan` (bulk groups,
            the gather path's partitions).

    Returns:
        The table, one line per gradient of ``p`` under a header line.
    """
    model = CostModel(profile, p.world_size, fusion_bytes, partition_bytes)
    paths = list(engine_paths(codec, p.strategy)) if codec is not None else []
    head = f"{'gradient':<40}{'numel':>11}{'fused ms':>10}" + "".join(
        f"{x + ' ms':>11}{'K':>5}" for x in paths)
    if arrivals is not None:
        head += f"{'fused +ms':>11}" + "".join(f"{x + ' +ms':>11}" for x in paths)
    lines = [head + f"  {'choice':<12}why"]
    entries = {g.name: g for g in p.gradients}
    delta = None if arrivals is None else _delay_deltas(p, model, gradients, codec, arrivals,
                                                        partition_bytes)
    for name, shape in gradients:
        n = _flat_numel(shape)
        shp = _as_shape(shape)
        unc = model.uncompressed(n).total_s
        best: Dict[str, Cost] = {}
        shrinks = codec is not None and may_compress(codec, n, shp)
        if codec is not None and n >= 1:
            for _, cost in options(model, codec, n, p.strategy, p.feedback,
                                      p.max_partitions, allow_uncompressed=False,
                                      force=True, shape=shp):
                if cost.path not in best or cost.total_s < best[cost.path].total_s:
                    best[cost.path] = cost
        cells = "".join(
            f"{best[x].total_s * 1e3:>11.3f}{best[x].partitions:>5}" if x in best
            else f"{'-':>11}{'-':>5}" for x in paths)
        e = entries.get(str(name))
        if e is None:
            continue
        if delta is not None:
            cells += f"{delta(str(name), UNCOMPRESSED):>+11.3f}" + "".join(
                f"{delta(str(name), Decision(True, best[x].partitions, x)):>+11.3f}"
                if x in best and shrinks else f"{'-':>11}" for x in paths)
        choice = f"{e.strategy}/{e.partitions}" if e.compress else "fused"
        fastest = min([unc] + [c.total_s for c in best.values()] if shrinks else [unc])
        if not e.compress and not shrinks and codec is not None:
            why = "not shrinkable"
        elif abs(e.predicted_ms - fastest * 1e3) <= 1e-9 + 1e-9 * abs(fastest * 1e3):
            why = "fastest"
        elif p.basis != "search":
            why = (f"{p.basis.replace('_', '-')} policy (no search beat it by "
                   f"{p.min_gain:.0%} of the iteration)")
        elif p.predicted_delay_ms:
            why = (f"least delay (iteration {p.predicted_delay_ms.get('plan', 0.0):.1f} ms "
                   "simulated; overlaps the backward pass)")
        else:
            why = f"no fused buffer (its {model.fused_fixed() * 1e3:.3f} ms saved)"
        lines.append(f"{str(name)[:40]:<40}{n:>11}{unc * 1e3:>10.3f}{cells}  {choice:<12}{why}")
    return "\n".join(lines)


def _aligned_arrivals(names: Sequence[str], numels: Sequence[int],
                      arrivals: Sequence[Tuple[str, int, float]]) -> List[Tuple[str, int, float]]:
    """``(name, numel, ready_s)`` of every gradient; one without an arrival is ready last."""
    ready = {str(a[0]): float(a[2]) for a in arrivals}
    end = max(ready.values(), default=0.0)
    return [(nm, n, ready.get(nm, end)) for nm, n in zip(names, numels)]


def _delay_deltas(p: Plan, model: CostModel, gradients: Sequence[Tuple[str, Any]],
                  codec: Optional[Codec], arrivals: Sequence[Tuple[str, int, float]],
                  partition_bytes: int) -> Callable[[str, Decision], float]:
    """Return ``delta(name, decision)``: how the plan's simulated delay changes, in ms.

    ``delta`` simulates the plan with one gradient's decision replaced and returns that
    delay less the plan's own (0.0 for the plan's own decision, without simulating).
    """
    names = [str(n) for n, _ in gradients]
    shapes = {str(n): _as_shape(s) for n, s in gradients}
    arr = _aligned_arrivals(names, [_flat_numel(s) for _, s in gradients], arrivals)
    base = p.decisions()

    def delay(choices: Dict[str, Decision]) -> float:
        return simulate(model, arr, choices, codec, p.feedback, partition_bytes,
                        shapes).delay_s * 1e3

    plan_ms = delay(base)

    def delta(name: str, decision: Decision) -> float:
        if base.get(name) == decision:
            return 0.0
        return delay(dict(base, **{name: decision})) - plan_ms

    return delta


def summary_table(p: Plan) -> str:
    """Return a text table of a plan's predicted totals (milliseconds per iteration)."""
    n = len(p.gradients)
    comp = sum(g.compress for g in p.gradients)
    mib = sum(g.numel for g in p.gradients) * 4 / 2**20
    lines = [
        f"SeCoPa plan: codec {p.codec}{' ' + json.dumps(p.codec_params) if p.codec_params else ''}"
        f", strategy {p.strategy}, world size {p.world_size}, {n} gradients "
        f"({mib:.1f} MiB float32), error feedback {'on' if p.feedback else 'off'}",
        f"{'policy':<22}{'predicted ms/iter':>18}{'compressed':>12}"
        + (f"{'exposed ms/iter':>17}" if p.predicted_exposed_ms else "")
        + (f"{'delay ms/iter':>15}" if p.predicted_delay_ms else ""),
    ]
    counts = {"plan": comp, "compress_everything": sum(g.numel > 0 for g in p.gradients),
              "compress_nothing": 0}
    for key in TOTALS:
        if key not in p.predicted_ms:
            continue
        c = counts.get(key)
        shown = f"{c}/{n}" if c is not None else "-"
        ex = p.predicted_exposed_ms.get(key)
        de = p.predicted_delay_ms.get(key)
        lines.append(f"{key.replace('_', '-'):<22}{p.predicted_ms[key]:>18.2f}{shown:>12}"
                     + (f"{ex:>17.2f}" if ex is not None else "")
                     + (f"{de:>15.2f}" if de is not None else ""))
    paths: Dict[str, int] = {}
    for g in p.gradients:
        paths[g.strategy] = paths.get(g.strategy, 0) + 1
    lines.append("plan paths: " + ", ".join(f"{k} {v}" for k, v in sorted(paths.items())))
    if p.basis != "search":
        lines.append(f"plan = the {p.basis.replace('_', '-')} policy: no searched plan was "
                     f"predicted at least {p.min_gain:.0%} of the iteration faster "
                     "(--min-gain)")
    return "\n".join(lines)
