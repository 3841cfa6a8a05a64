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
  ``MPI.COMM_WORLD`` (:data:`AUTO_PROFILE_S` seconds, plus the codecs' warm-up). Then,
  with ``sync.plan_observe_steps`` W > 0 (default 3), the job trains under the fixed
  policy while the engine records an in-memory timeline of W steps (the first compressed
  step, with its one-off costs, is left out), and at the end of the last of them every
  rank plans collectively (:meth:`PlanFollower.step_done`), as ``hipress profile
  --from-timeline`` and ``hipress plan --timeline`` do for a finished job:

  1. each rank reads its gradients' submission and completion times per step
     (:func:`~hipress.secopa.pipeline.step_vectors`), and an allreduce (max) makes each
     gradient's arrival that of its last rank;
  2. rank 0 refits the profile's compute costs, negotiation round and cores' shares to
     its own timeline (:func:`~hipress.secopa.profile.refit_from_timeline`), takes the
     observed step with the median exposed time, and plans the whole set of gradients of
     the job's codec (``compression.algorithm``) against those arrivals with the
     pipeline simulation (:func:`~hipress.secopa.planner.plan`, keeping the best fixed
     policy unless the search gains ``min_gain`` of the iteration);
  3. rank 0 broadcasts the plan, every rank follows it from the next step on; where it
     changes a gradient's partitions, the engine re-splits that gradient's error-feedback
     residuals at its next job;
  4. with ``sync.plan_verify_steps`` V > 0 (default 3) and a plan that is not the fixed
     policy (``Plan.basis`` other than ``threshold``), the job times V steps under the
     plan after one that settles it (V is rank 0's, sent with the plan). Each step is the
     time between two :meth:`PlanFollower.step_done` calls, maxed over the ranks by an
     allreduce, so every rank decides alike: the plan is kept unless the median of its
     V steps exceeds the median of the W observed fixed-policy steps by more than the
     plan's ``min_gain``; else every rank follows the fixed policy from the next step
     on, for good (:attr:`PlanFollower.verified` holds both medians). The model is fitted from
     a profile and the job's own steps, but it can still misprice what a plan changes:
     on 2 cores shared by 4 ranks its PowerSGD plans sent most gradients uncompressed
     and stepped 1.21-1.26x the fixed policy (bench/README.md), because the kernel's TCP
     work on the shared cores was underpriced. The check bounds what such a plan costs
     to V + 1 steps. Rank 0 writes a kept plan to ``sync.plan_save`` when set (at once
     when no check runs); a plan that lost is not written.

  Steps are counted by :meth:`PlanFollower.step_done` calls since ``init``, alike on
  every rank. A rank that calls ``join()`` during the observed or the timed steps makes
  the planning or the check fail on the others with a
  :class:`~hipress.errors.ConfigError` naming it and the fix (``join()`` once per
  uneven epoch therefore needs every rank to make the same number of steps until the
  check is over: ``compression.warmup_steps`` + W + V + 2 of them).

  Gradients the plan does not name (another codec, or first submitted later) are
  decided one by one by :func:`~hipress.secopa.planner.decide` from the profile (cached
  by name, size, codec and strategy), as every gradient is with W = 0. Without codec
  spans to refit from, rank 0 plans with the init-time profile and says so; if planning
  fails (no gradient of the codec was observed, ...) it says why and every rank goes on
  deciding gradient by gradient. The observation costs the timeline's recording for W
  steps and, once, the planning (about a second for VGG-19's 38 gradients) while the
  other ranks wait.

Decisions must agree across ranks (the partitions of a gradient are not negotiated);
everything here is deterministic given the broadcast profile or plan.
"""

from __future__ import annotations

import json
import logging
import statistics
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np

from hipress.codecs import Codec, get_codec
from hipress.engine.planning import Decision, FixedPolicy
from hipress.errors import CollectiveArgumentError, ConfigError
from hipress.secopa.cost import CostModel
from hipress.secopa.errors import PlanError, ProfileError, SeCoPaError
from hipress.secopa.pipeline import median_step, step_vectors
from hipress.secopa.planner import DEFAULT_MAX_PARTITIONS, Plan, decide, plan, summary_table
from hipress.secopa.profile import Profile, codec_key, refit_from_timeline, run_profile

logger = logging.getLogger(__name__)
#: gradients missing from a plan file named one by one before a single summary warning
_UNPLANNED_SHOWN = 3

#: measurement budget (seconds) of the profile made for ``sync.plan: auto``
AUTO_PROFILE_S = 5.0
#: the clock that times steps for ``sync.plan_verify_steps`` (tests replace it)
_clock = time.monotonic


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
        self.profile_s = AUTO_PROFILE_S
        self.max_partitions = DEFAULT_MAX_PARTITIONS
        #: steps observed before ``auto`` plans the whole set (0: per gradient at once)
        self.observe_steps = int(cfg.sync.plan_observe_steps)
        #: the first observed step (the first compressed one, with its one-off costs, is not)
        self.observe_from = int(cfg.compression.warmup_steps) + 1
        #: ``auto``: the observation is over (planned, or planning failed)
        self.observed = self.observe_steps == 0
        #: steps timed under a run-time plan before it is kept (0: not checked)
        self.verify_steps = int(cfg.sync.plan_verify_steps)
        #: step_done call at whose end the timed plan steps start (None: no check pending)
        self._verify_from: Optional[int] = None
        #: step_done times (``_clock``) of the observed steps, then of the timed plan steps
        self._marks: List[float] = []
        self._plan_marks: List[float] = []
        #: after the check: ``fixed_step_s``, ``plan_step_s`` (medians over the steps,
        #: slowest rank), ``steps`` timed and ``kept`` (1.0 or 0.0)
        self.verified: Optional[Dict[str, float]] = None
        #: the check found the plan slower: the fixed policy decides from then on
        self.reverted = False
        #: name -> shape of the gradients of the job's codec seen before planning
        self._seen: Dict[str, Tuple[int, ...]] = {}
        #: step_done calls so far: every rank makes as many (its step count may differ,
        #: e.g. after a checkpoint loaded on rank 0 only)
        self._steps = 0
        self._main_codec: Optional[Codec] = None
        #: its codec_key (compared on every decision, so computed once)
        self._main_key: Optional[str] = None
        self._events_from = 0
        self._first_step = self.observe_from
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
                                        self.cfg.sync.fusion_threshold_bytes,
                                        self.cfg.sync.partition_bytes)
                comp = self.cfg.compression
                if comp.algorithm != "none":
                    main = self._main_codec = self._lookup(comp.algorithm, dict(comp.params))
                    self._main_key = codec_key(main.name, main.params())
                if self._main_codec is None or self.size == 1:
                    self.observed = True
                if self.rank == 0:
                    logger.info(
                        "SeCoPa: profiled %d codec(s) on %d rank(s) in %.1f s; %s",
                        len(codecs), self.size, self.profile.elapsed_s,
                        "planning each gradient on arrival" if self.observed else
                        f"observing steps {self.observe_from}-"
                        f"{self.observe_from + self.observe_steps - 1} under the fixed "
                        "policy, then planning them all")
            else:
                self.observed = True
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
            if self.reverted:  # the plan lost to the fixed policy in this job's own steps
                return self._fixed(numel, array, strategy)
            shape = tuple(int(d) for d in getattr(array, "shape", (numel,)))
            ckey = codec_key(codec.name, codec.params())
            is_main = ckey == self._main_key
            if not self.observed:  # the fixed policy while the steps are observed
                if is_main:
                    self._seen[name] = shape
                return self._fixed(numel, array, strategy)
            entry = self.plan.entry(name) if self.plan is not None and is_main else None
            if entry is not None and entry.numel == numel:
                return (Decision(True, entry.partitions, entry.strategy) if entry.compress
                        else Decision(False, 1, strategy))
            key = (name, shape, ckey, strategy)
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

    # ------------------------------------------------------------------ auto: observe
    def step_done(self, engine: Any) -> None:
        """Observe, then plan, at step boundaries (``sync.plan: auto``; every rank).

        Steps are counted by these calls since ``init``, which every rank makes alike
        (not by ``engine.step_count``, which a checkpoint loaded on one rank changes).
        After call ``observe_from`` it turns on the engine's in-memory timeline (a
        timeline written to a file records anyway); after call ``observe_from +
        plan_observe_steps`` it plans (module docstring): an allreduce and a broadcast
        through ``engine``, which every rank reaches at the same call.

        With ``sync.plan_verify_steps`` V > 0 it then times the plan: the call after the
        planning one starts V timed steps, and the call that ends them compares them with
        the observed steps (an allreduce through ``engine``, module docstring, step 4).

        Raises:
            ConfigError: a rank had called ``join()`` (its data ran out) during the
                observed or timed steps: the ranks cannot plan together.
            HiPressError: the engine's collectives failed (a peer failed, ...). Planning
                errors are not raised: rank 0 logs them and every rank goes on deciding
                gradient by gradient.
        """
        if self.mode != "auto" or (self.observed and self._verify_from is None):
            return
        now = _clock()
        self._steps += 1
        if self._verify_from is not None:
            if self._steps >= self._verify_from:
                self._plan_marks.append(now)
            if self._steps == self._verify_from + self.verify_steps:
                self._verify_from = None
                self._check_plan(engine)
            return
        if self._steps >= self.observe_from:
            self._marks.append(now)
        if self._steps == self.observe_from:
            self._events_from = len(engine.timeline.events())
            self._first_step = int(engine.step_count)  # this rank's number of the next step
            engine.timeline.record_in_memory(True)
        elif self._steps >= self.observe_from + self.observe_steps:
            self.observed = True
            events = engine.timeline.events()[self._events_from:]
            engine.timeline.record_in_memory(False)
            self._plan_observed(engine, events)
            if (self.plan is not None and self.verify_steps > 0
                    and self.plan.basis != "threshold"):
                # this call's step ran under the fixed policy; the next one re-splits
                # residuals and compiles for new partitions: timed from its end
                self._verify_from = self._steps + 1
                if self.rank == 0:
                    nxt = int(engine.step_count)
                    logger.info("SeCoPa follows its plan from step %d and times steps %d-%d "
                                "against the observed fixed-policy steps before keeping it "
                                "(sync.plan_verify_steps)%s", nxt, nxt + 1,
                                nxt + self.verify_steps,
                                f"; {self.cfg.sync.plan_save} is written once it is kept"
                                if self.cfg.sync.plan_save else "")
            else:
                self._save_plan()

    def _check_plan(self, engine: Any) -> None:
        """Keep the plan or go back to the fixed policy, alike on every rank."""
        assert self.plan is not None
        fixed = np.diff(np.asarray(self._marks, dtype=np.float64))
        timed = np.diff(np.asarray(self._plan_marks, dtype=np.float64))
        try:
            got = engine.submit(np.concatenate([fixed, timed]), "__secopa.verify",
                                op="max").wait()
        except CollectiveArgumentError as exc:
            last = int(engine.step_count) - 1
            raise ConfigError(
                f"sync.plan: auto times its plan with every rank in steps "
                f"{last - self.verify_steps + 1}-{last} (sync.plan_verify_steps="
                f"{self.verify_steps}), but a rank has joined: {exc}. Give every rank data "
                f"for the first {last + 1} steps, set sync.plan_verify_steps: 0 to follow "
                "the plan unchecked, or plan from a file (sync.plan_save in a run with even "
                "data, then sync.plan: <that file>)") from exc
        both = np.asarray(got, dtype=np.float64)
        fixed_s = float(statistics.median(both[:fixed.size]))
        plan_s = float(statistics.median(both[fixed.size:]))
        kept = plan_s <= fixed_s * (1.0 + self.plan.min_gain)
        ratio = plan_s / fixed_s if fixed_s > 0 else float("inf") if plan_s > 0 else 1.0
        self.verified = {"fixed_step_s": fixed_s, "plan_step_s": plan_s,
                         "steps": float(timed.size), "kept": 1.0 if kept else 0.0}
        last = int(engine.step_count) - 1  # this rank's number of the step just ended
        first = last - self.verify_steps + 1
        if kept:
            if self.rank == 0:
                logger.info("SeCoPa kept its plan: steps %d-%d under it took %.3f s (median "
                            "of each step's slowest rank), the observed fixed-policy steps "
                            "%.3f s (%.2fx)", first, last, plan_s, fixed_s, ratio)
            self._save_plan()
            return
        self.reverted = True
        self._cache.clear()
        if self.rank == 0:
            logger.warning(
                "SeCoPa dropped its plan: steps %d-%d under it took %.3f s (median of each "
                "step's slowest rank) against %.3f s for the observed fixed-policy steps, "
                "%.2fx, more than "
                "its min_gain of %.0f %% allows; every rank follows the fixed policy from the "
                "next step on%s. The cost model mispriced this job (its profile or the "
                "shared cores); sync.plan: none skips the observation next time", first,
                last, plan_s, fixed_s, ratio, 100 * self.plan.min_gain,
                f" (the plan is not written to {self.cfg.sync.plan_save})"
                if self.cfg.sync.plan_save else "")
        self.plan = None

    def _save_plan(self) -> None:
        """Rank 0 writes the plan to ``sync.plan_save``, when set."""
        path = self.cfg.sync.plan_save
        if self.rank != 0 or not path or self.plan is None:
            return
        try:
            self.plan.save(path)
            logger.info("SeCoPa: wrote the plan to %s (sync.plan: %s reuses it)", path, path)
        except OSError as exc:
            logger.warning("SeCoPa could not write the plan to %s: %s", path, exc.strerror)

    def _plan_observed(self, engine: Any, events: List[Dict[str, Any]]) -> None:
        """Combine the ranks' arrivals, plan on rank 0 and broadcast the plan."""
        names = sorted(self._seen)
        steps = list(range(self._first_step, self._first_step + self.observe_steps))
        mine = step_vectors(events, names, steps)
        # the same name and size on every rank; a rank that saw other gradients fails
        # the allreduce on every rank with both sizes named
        try:
            both = engine.submit(mine.ravel(), "__secopa.arrivals", op="max").wait()
        except CollectiveArgumentError as exc:
            raise ConfigError(
                f"sync.plan: auto plans with every rank at the end of its observed steps "
                f"{steps[0]}-{steps[-1]}, but {exc}. Give every rank data for the first "
                f"{steps[-1] + 1} steps, lower sync.plan_observe_steps, or plan from a file "
                "(sync.plan_save in a run with even data, then sync.plan: <that file>)"
            ) from exc
        vec = np.asarray(both, dtype=np.float64).reshape(mine.shape)
        text = b""
        if self.rank == 0:
            try:
                # rank 0's plan_verify_steps goes with it: a rank with another would wait
                # at a different step for the check's allreduce
                text = json.dumps({"plan": json.loads(self._plan_on_rank0(
                    names, steps, vec, events)), "verify_steps": self.verify_steps}).encode()
            except Exception as exc:  # noqa: BLE001 - every rank must get an answer
                if not isinstance(exc, SeCoPaError):
                    logger.exception("SeCoPa's planning failed")
                text = json.dumps({"error": f"{type(exc).__name__}: {exc}"}).encode()
        raw = engine.broadcast(np.frombuffer(text, dtype=np.uint8), 0, "__secopa.plan").wait()
        got = json.loads(bytes(np.asarray(raw, dtype=np.uint8)).decode())
        if "error" in got:
            if self.rank == 0:
                logger.warning("SeCoPa could not plan from the observed steps (%s); deciding "
                               "each gradient from the profile instead", got["error"])
            return
        self.plan = Plan.from_json(json.dumps(got["plan"]), "sync.plan: auto")
        self.verify_steps = int(got["verify_steps"])
        self._cache.clear()

    def _plan_on_rank0(self, names: List[str], steps: List[int], vec: np.ndarray,
                       events: List[Dict[str, Any]]) -> str:
        """Refit, plan and return the plan's JSON (rank 0)."""
        measured = []
        for row in vec:
            got = row[:-1][row[:-1] >= 0]
            back = float(got.max()) if got.size else 0.0
            end = float(row[-1]) if row[-1] >= 0 else back
            measured.append({"backward_s": back, "end_s": end, "exposed_s": max(0.0, end - back)})
        if not names or not any(row[:-1].max() >= 0 for row in vec):
            raise SeCoPaError(f"no gradient of codec {self.cfg.compression.algorithm!r} was "
                              f"submitted in steps {steps[0]}-{steps[-1]}")
        mid = median_step(measured, 0)
        shapes = {n: self._seen[n] for n in names}
        arrivals = [(n, int(np.prod(shapes[n], dtype=np.int64)), float(t))
                    for n, t in zip(names, vec[mid, :-1]) if t >= 0]
        assert self.profile is not None
        try:
            prof, _ = refit_from_timeline(self.profile, events, source="sync.plan: auto")
            how = "refitted to the observed steps"
        except ProfileError as exc:
            prof, how = self.profile, f"not refitted ({exc})"
        comp, sync = self.cfg.compression, self.cfg.sync
        p = plan(prof, [(n, shapes[n]) for n in names], self._main_codec, sync.strategy,
                 self.size, max_partitions=self.max_partitions, memory=comp.memory,
                 fusion_bytes=sync.fusion_threshold_bytes,
                 min_compress_bytes=comp.min_compress_bytes,
                 partition_bytes=sync.partition_bytes, profile_source=f"auto: profile {how}",
                 arrivals=arrivals)
        m = measured[mid]
        logger.info("SeCoPa planned %d gradients from observed steps %d-%d (profile %s; "
                    "arrivals of step %d, the median of %d by exposed time: last gradient "
                    "ready %.1f ms, exposed %.1f ms):\n%s", len(names), steps[0], steps[-1],
                    how, steps[mid], len(measured), m["backward_s"] * 1e3,
                    m["exposed_s"] * 1e3, summary_table(p))
        return p.to_json()

    def _fixed(self, numel: int, array: Any, strategy: str) -> Decision:
        """Apply the engine's fixed policy (:class:`~hipress.engine.planning.FixedPolicy`)."""
        return self._policy.by_size(array, strategy)

    def _warn(self, key: Any, msg: str, *args: Any) -> None:
        if key in self._warned:
            return
        self._warned.add(key)
        if self.rank == 0:
            logger.warning(msg, *args)
