"""Follow ``sync.plan`` at run time: no plan, a plan file, or a plan made at ``init``.

The engine asks :class:`PlanFollower` about every compressed gradient when it is
submitted: compress it or not, into how many partitions, on which path.

- ``sync.plan: none`` — the engine's fixed policy: compress gradients of at least
  ``compression.min_compress_bytes`` bytes, in ``sync.partitions`` or
  ``ceil(bytes / sync.partition_bytes)`` partitions, with the configured strategy.
- ``sync.plan: <path>`` — the plan file (``hipress plan -o``): rank 0 reads it and
  broadcasts it, so every rank follows the same plan. Gradients the plan does not name,
  or names with another element count, fall back to the fixed policy (with a warning).
- ``sync.plan: auto`` — at setup every rank takes part in a brief
  :func:`~hipress.secopa.profile.run_profile` of the configured codecs on a duplicate of
  ``MPI.COMM_WORLD`` (budget ``sync.plan_profile_s`` if the config has it, else
  :data:`AUTO_PROFILE_S` seconds, plus the codecs' warm-up); each gradient is then
  planned by :func:`~hipress.secopa.planner.decide` when it first arrives (cached by
  name, size, codec and strategy). The profile is identical on every rank, so every rank
  decides the same.

Decisions must agree across ranks (the partitions of a gradient are not negotiated);
everything here is deterministic given the broadcast profile or plan.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Callable, Dict, List, Optional, Tuple

from hipress.codecs import Codec, get_codec
from hipress.engine.planning import Decision, FixedPolicy
from hipress.secopa.cost import CostModel
from hipress.secopa.errors import PlanError, ProfileError
from hipress.secopa.planner import DEFAULT_MAX_PARTITIONS, Plan, decide
from hipress.secopa.profile import Profile, codec_key, run_profile

logger = logging.getLogger(__name__)
#: gradients missing from a plan file named one by one before a single summary warning
_UNPLANNED_SHOWN = 3

#: measurement budget (seconds) of the profile made for ``sync.plan: auto``
AUTO_PROFILE_S = 5.0


class PlanFollower:
    """Decides compress / partitions / strategy per gradient from ``sync.plan``.

    The engine's :class:`~hipress.engine.planning.GradientPlanner` for ``sync.plan``
    other than ``none`` (``hipress.init`` builds it); ``none`` is the engine's own
    :class:`~hipress.engine.planning.FixedPolicy`, which this class also applies where
    the plan has no answer.

    Args:
        cfg: the :class:`hipress.config.HiPressConfig`.
        world: the :class:`hipress.comm.World` (``rank``, ``size``, ``mpi``).
        codec_lookup: ``(algorithm, params) -> Codec`` to build the configured codecs
            for ``auto`` (the engine passes its builder, which also knows CompLL
            ``.hpc`` specs); default :func:`hipress.codecs.get_codec`.

    Call :meth:`setup` once on every rank (collective for ``auto`` and plan files at
    world size > 1) before :meth:`decide`.
    """

    def __init__(self, cfg: Any, world: Any,
                 codec_lookup: Optional[Callable[[str, Dict[str, Any]], Codec]] = None) -> None:
        self.cfg = cfg
        self.world = world
        self.rank, self.size = int(world.rank), int(world.size)
        self._lookup = codec_lookup or (lambda algo, params: get_codec(algo, **params))
        spec = str(cfg.sync.plan).strip()
        self.mode = "none" if spec.lower() == "none" else "auto" if spec.lower() == "auto" \
            else "file"
        self.path = spec if self.mode == "file" else None
        self.profile_s = float(getattr(cfg.sync, "plan_profile_s", None) or AUTO_PROFILE_S)
        self.max_partitions = int(getattr(cfg.sync, "plan_max_partitions", None)
                                  or DEFAULT_MAX_PARTITIONS)
        self.profile: Optional[Profile] = None
        self.plan: Optional[Plan] = None
        self._model: Optional[CostModel] = None
        self._cache: Dict[Tuple[str, Tuple[int, ...], str, str], Decision] = {}
        self._warned: set = set()
        #: names submitted that the plan file has no matching entry for
        self._unplanned: set = set()
        self._ready = False
        self._policy = FixedPolicy(cfg)

    @property
    def active(self) -> bool:
        """True when a plan (file or auto) decides instead of the fixed policy."""
        return self.mode != "none"

    # ------------------------------------------------------------------ setup
    def setup(self) -> None:
        """Load the plan or profile the cluster (collective: every rank calls it).

        Raises:
            PlanError: the plan file is missing or invalid (every rank raises it).
            ProfileError: profiling failed (every rank raises it).
        """
        if self._ready:
            return
        tx = getattr(self.world, "tx", None)
        if self.mode != "none" and self.size > 1 and getattr(tx, "name", "mpi") != "mpi":
            from hipress.errors import ConfigError

            raise ConfigError(
                f"sync.plan={self.cfg.sync.plan!r} needs the MPI transport (SeCoPa profiles "
                f"and shares plans over MPI) but this job runs over {tx.name!r}: launch it "
                "with hipressrun/mpirun, or set sync.plan: none")
        if self.mode == "file":
            self.plan = self._load_plan()
            if self.plan.world_size != self.size and self.rank == 0:
                logger.warning(
                    "SeCoPa plan %s was made for world size %d but this job has %d ranks; "
                    "following it anyway (re-run `hipress plan --world-size %d` for a plan "
                    "that fits)", self.path, self.plan.world_size, self.size, self.size)
        elif self.mode == "auto":
            codecs = self._configured_codecs()
            if codecs:
                comm = self.world.mpi.COMM_WORLD.Dup()
                try:
                    self.profile = run_profile(comm, codecs, time_budget_s=self.profile_s,
                                               blas_threads=self.cfg.sync.blas_threads)
                finally:
                    comm.Free()
                self._model = CostModel(self.profile, self.size,
                                        self.cfg.sync.fusion_threshold_bytes)
                if self.rank == 0:
                    logger.info("SeCoPa: profiled %d codec(s) on %d rank(s) in %.1f s; "
                                "planning each gradient on arrival", len(codecs), self.size,
                                self.profile.elapsed_s)
        self._ready = True

    def _configured_codecs(self) -> List[Codec]:
        comp = self.cfg.compression
        specs = [(comp.algorithm, dict(comp.params))]
        specs += [(r.algorithm, dict(r.params)) for r in comp.rules]
        out: Dict[str, Codec] = {}
        for algo, params in specs:
            if algo == "none":
                continue
            codec = self._lookup(algo, params)
            out.setdefault(codec_key(codec.name, codec.params()), codec)
        return list(out.values())

    def _load_plan(self) -> Plan:
        """Rank 0 reads the plan file and broadcasts its text; every rank parses it."""
        if self.size == 1:
            return Plan.load(self.path)
        comm = self.world.mpi.COMM_WORLD.Dup()
        try:
            msg: Tuple[str, str] = ("", "")
            if self.rank == 0:
                try:
                    with open(self.path, encoding="utf-8") as f:
                        msg = ("ok", f.read())
                except OSError as exc:
                    msg = ("error", f"cannot read SeCoPa plan {self.path}: {exc.strerror}")
            status, text = comm.bcast(msg if self.rank == 0 else None, root=0)
        finally:
            comm.Free()
        if status != "ok":
            raise PlanError(text)
        return Plan.from_json(text, str(self.path))

    # ------------------------------------------------------------------ decide
    def decide(self, name: str, array: Any, codec: Optional[Codec],
               strategy: Optional[str]) -> Decision:
        """Return ``(compress, partitions, strategy)`` for one submitted gradient.

        Args:
            name: the gradient's name.
            array: the gradient (only ``size`` and ``dtype`` are used).
            codec: the codec the policy resolved for it (None: uncompressed).
            strategy: the strategy asked for (``auto``, ``ps``, ``ring``, ``allreduce``,
                ``gather``; None means the config's ``sync.strategy``).

        Returns:
            compress: False means send it uncompressed (fused);
            partitions: K (>= 1) for CaSync-PS / Ring;
            strategy: the path to force (ps, ring, allreduce, gather), or ``strategy``
            unchanged when not compressing or following the fixed policy.
        """
        strategy = strategy or self.cfg.sync.strategy
        numel = int(array.size)
        if codec is None or codec.name == "none":
            return Decision(False, 1, strategy)
        if self.mode == "file" and self.plan is not None:
            entry = self.plan.entry(name)
            if entry is not None and entry.numel == numel:
                if codec.name != self.plan.codec:
                    self._warn(("codec", codec.name),
                               "SeCoPa plan %s was made for codec %r; gradient %r uses %r",
                               self.path, self.plan.codec, name, codec.name)
                if not entry.compress:
                    return Decision(False, 1, strategy)
                return Decision(True, entry.partitions, entry.strategy)
            why = "is not in" if entry is None else f"has {numel} elements, not {entry.numel}, in"
            self._unplanned.add(name)
            if len(self._unplanned) <= _UNPLANNED_SHOWN:
                self._warn(("entry", name), "gradient %r %s SeCoPa plan %s; using the fixed "
                           "policy for it", name, why, self.path)
            elif len(self._unplanned) == _UNPLANNED_SHOWN + 1:
                self._warn("unplanned", "more gradients (%r, ...) are not in SeCoPa plan %s "
                           "as this job names and sizes them: was it made for another model, "
                           "or from other names (`hipress plan --gradients` takes your "
                           "model's names and shapes as JSON)? Using the fixed policy for "
                           "them; not naming further ones", name, self.path)
            return self._fixed(numel, array, strategy)
        if self.mode == "auto" and self._model is not None:
            shape = tuple(int(d) for d in getattr(array, "shape", (numel,)))
            key = (name, shape, codec_key(codec.name, codec.params()), strategy)
            got = self._cache.get(key)
            if got is not None:
                return got
            try:
                entry = decide(self._model, numel, shape, codec, strategy, self.size, name=name,
                               memory=self.cfg.compression.memory,
                               max_partitions=self.max_partitions)
            except ProfileError as exc:
                self._warn(("profile", codec.name), "SeCoPa cannot plan %r (%s); using the "
                           "fixed policy for it", name, exc)
                return self._fixed(numel, array, strategy)
            got = Decision(True, entry.partitions, entry.strategy) if entry.compress else \
                Decision(False, 1, strategy)
            self._cache[key] = got
            if self.rank == 0:
                logger.debug("SeCoPa: %s (%d elements): %s", name, numel, json.dumps(
                    entry.model_dump(exclude={"name", "numel"})))
            return got
        return self._fixed(numel, array, strategy)

    def _fixed(self, numel: int, array: Any, strategy: str) -> Decision:
        """Apply the engine's fixed policy (:class:`~hipress.engine.planning.FixedPolicy`)."""
        return self._policy.by_size(array, strategy)

    def _warn(self, key: Any, msg: str, *args: Any) -> None:
        if key in self._warned:
            return
        self._warned.add(key)
        if self.rank == 0:
            logger.warning(msg, *args)
