"""The iteration as it runs: gradients arrive over the backward pass and share resources.

:mod:`hipress.secopa.cost` predicts one gradient's synchronization time alone. In
training, gradients become ready one after another during the backward pass (the last
layer's first), each rank's engine runs encode, decode and merge steps on its compute
pool, and every transfer crosses the same link; the iteration's synchronization ends when
the last gradient is done. What training pays is the part after the backward pass ends:
the **exposed** sync time. This module simulates that, event by event:

- each gradient arrives at its ready time (seconds from the start of the backward pass:
  from a job's timeline, :func:`arrivals_from_timeline`, or spread over a measured
  backward time);
- a compressed gradient cut into K partitions is K jobs, each ``compute -> network ->
  compute`` (encode, then the transfers, then merge / decode: the cost model's compute
  split in half around its network time, per partition). On PS with fewer partitions
  than ranks, the aggregation the average rank leaves to other ranks
  (:attr:`~hipress.secopa.cost.Cost.remote_s`) is a wait after the transfers that delays
  the partition without loading this rank's compute server;
- every gradient waits one negotiation round after it arrives before any work on it
  starts (``Profile.round_s``: the interval between the engine's rounds, refitted from a
  job's timeline; 0 in a measured profile), but no later than the end of the backward
  pass: the rank then waits for its results, and a waiting rank's rounds go at once;
- compressed gradients the engine synchronizes in bulk (CaSync-PS, one partition, at most
  :data:`~hipress.engine.engine.BULK_MAX_BYTES`) are grouped as it groups them: those
  that arrive in the same negotiation round (a window of ``round_s``), up to
  ``bulk_bytes`` per group; a group costs what one gradient of all their elements costs
  (one set of steps and messages, :func:`~hipress.engine.tasks.ps_bulk_task`);
- uncompressed gradients are held, as the engine holds them, until
  :data:`hipress.engine.engine.FUSION_HOLD_BYTES` of them are waiting or the backward
  pass ends (the rank then waits and flushes, at once), and each release is one network
  job: their marginal fused-allreduce times plus one fused buffer's fixed cost;
- one compute server (the engine thread, ``sync.compute_threads`` = 0, or its one pool
  thread) and one network server per rank, each serving jobs first come, first served
  in order of the time they become ready;
- the compute server gets a share of a core: ``Profile.cpu_share_backward`` while the
  backward pass runs (the cost model's compute costs are already stretched by it) and
  ``Profile.cpu_share_tail`` for work that starts after the last arrival (both 1 in a
  measured profile; a refit from a job's timeline measures them);
- the engine thread also drives the transfers: a transfer that starts after the last
  arrival keeps the compute server busy for its wire CPU (``Profile.wire_cpu_s_per_byte``
  per byte, at the tail's share of a core), so 16 MiB sent uncompressed is not free
  while codec work waits (during the backward pass that CPU is charged as delay below).

Besides the exposed time, the engine's work during the backward pass costs training
something where the ranks share cores with compute: the CPU seconds it takes then
(``backward_cpu_s``: the compute server's busy time before the last arrival times the
backward share, plus the wire's CPU, ``Profile.wire_cpu_s_per_byte`` per byte
allreduced uncompressed or per payload byte, for the part of each transfer before it)
are taken from the backward pass, one second of delay per CPU second (the pass itself
is not re-simulated). ``delay_s``, exposed time plus that, is what the
iteration pays for synchronization and what the planner minimizes; on machines whose
training leaves cores idle it overstates the cost of overlapped work.

The simulation is deterministic and takes microseconds per gradient, so the planner can
score whole plans with it.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from hipress.codecs import Codec
from hipress.engine.engine import BULK_MAX_BYTES, FUSION_HOLD_BYTES
from hipress.engine.planning import Decision
from hipress.secopa.cost import CostModel, engine_paths
from hipress.secopa.errors import SeCoPaError
from hipress.secopa.profile import trace_events

#: ("name", numel, ready seconds from the first arrival)
Arrival = Tuple[str, int, float]
#: ``sync.partition_bytes``' default: the engine's bound on one bulk group's bytes
DEFAULT_BULK_BYTES = 4 << 20
#: what happens to a gradient not in a simulation's ``choices``: sent uncompressed
UNCOMPRESSED = Decision(False, 1, "fused")


@dataclasses.dataclass(frozen=True)
class Simulation:
    """The simulated iteration.

    Attributes:
        backward_s: when the last gradient arrived (the end of the backward pass), s.
        end_s: when the last gradient finished synchronizing, s (from the first arrival).
        exposed_s: ``max(0, end_s - backward_s)``: the sync time training waits for.
        backward_cpu_s: CPU seconds of engine work before ``backward_s`` (its busy wall
            time then, times ``Profile.cpu_share_backward``) plus the wire's CPU then
            (``Profile.wire_cpu_s_per_byte``, spread over each transfer): what
            synchronization takes from the backward pass.
        compute_busy_s: time the compute server worked.
        network_busy_s: time the network server worked.
        finish_s: per gradient name, its finish time.
    """

    backward_s: float
    end_s: float
    exposed_s: float
    backward_cpu_s: float
    compute_busy_s: float
    network_busy_s: float
    finish_s: Dict[str, float]

    @property
    def delay_s(self) -> float:
        """Seconds synchronization adds to the iteration: exposed plus ``backward_cpu_s``."""
        return self.exposed_s + self.backward_cpu_s


def simulate(model: CostModel, arrivals: Sequence[Arrival], choices: Dict[str, Decision],
             codec: Optional[Codec], feedback: bool = False,
             bulk_bytes: int = DEFAULT_BULK_BYTES,
             shapes: Optional[Mapping[str, Tuple[int, ...]]] = None) -> Simulation:
    """Simulate one iteration's synchronization (see the module docstring).

    Args:
        model: the cost model (profile and world size).
        arrivals: ``(name, numel, ready_s)`` of every gradient, any order.
        choices: per name, what the plan does with it: the engine's
            :class:`~hipress.engine.planning.Decision` (``compress``, ``partitions``, the
            path as ``strategy``); missing names go uncompressed. A strategy the codec
            cannot run is simulated on the path the engine takes instead
            (:func:`~hipress.secopa.cost.engine_paths`: PowerSGD asked for ``ps`` runs the
            compressed allreduce, as the engine's fixed policy has it run).
        codec: the codec of the compressed choices.
        feedback: residual error feedback on (the encode step's cost includes it).
        bulk_bytes: the engine's ``sync.partition_bytes``: the most float32 bytes of one
            bulk group.
        shapes: per name, the gradient's shape; the compressed allreduce encodes it
            unflattened (PowerSGD's payload is ``(m + n) * rank`` of its matrix view, the
            whole gradient for a flat vector), so without it a low-rank codec is priced
            as if it did not shrink anything.

    Returns:
        The :class:`Simulation`.

    Raises:
        SeCoPaError: a compressed choice without a codec, or a ready time that is
            negative or not finite.
    """
    # (ready, order, resource, duration, the phases after this one, gradient, wire CPU s)
    heap: List[Tuple[float, int, str, float, Tuple[Tuple[str, float, float], ...], str,
                     float]] = []
    seq = 0
    wire = float(getattr(model.profile, "wire_cpu_s_per_byte", 0.0) or 0.0)
    lag = float(getattr(model.profile, "round_s", 0.0) or 0.0)
    backward = 0.0
    for name, _, ready in arrivals:
        if not (math.isfinite(ready) and ready >= 0):
            raise SeCoPaError(f"gradient {name!r}: ready time {ready!r} must be finite, >= 0")
        backward = max(backward, ready)
    held: List[str] = []
    held_bytes = held_s = held_link = 0.0
    #: job label of each fused buffer -> the gradients it carries
    fused: Dict[str, List[str]] = {}

    #: job label of each bulk group -> the gradients it carries
    bulked: Dict[str, List[str]] = {}
    #: per negotiation round, its bulk groups: [names, elements, latest start]
    rounds: Dict[float, List[List[Any]]] = {}

    def push_compressed(label: str, numel: int, strategy: str, partitions: int,
                        start: float) -> None:
        nonlocal seq
        shape = (shapes or {}).get(label)
        cost = model.compressed(codec, numel, strategy, partitions, feedback,
                                tuple(shape) if shape is not None else None)
        k = max(1, cost.partitions)
        half = (cost.compute_s - cost.remote_s) / (2 * k)
        link = cost.network_s if cost.link_s is None else cost.link_s
        net_cpu = wire * model.payload(codec, numel) / k
        # the messages' latency and the aggregation other ranks run on average delay the
        # partition but hold neither the link nor this rank's engine
        after = tuple(phase for phase in (
            ("net", link / k, net_cpu), ("latency", (cost.network_s - link) / k, 0.0),
            ("wait", cost.remote_s / k, 0.0), ("cpu", half, 0.0)) if phase[1] > 0 or phase[2] > 0)
        for _ in range(k):
            heap.append((start, seq, "cpu", half, after, label, 0.0))
            seq += 1

    def release(at: float) -> None:
        nonlocal seq, held, held_bytes, held_s, held_link
        if held and model.N > 1:
            label = f"<fused {len(fused)}>"
            fused[label] = held
            lat = held_s + model.fused_fixed() - held_link
            heap.append((at, seq, "net", held_link, (("latency", lat, 0.0),) if lat > 0 else (),
                         label, wire * held_bytes))
            seq += 1
        held, held_bytes, held_s, held_link = [], 0.0, 0.0, 0.0

    for name, numel, ready in sorted(arrivals, key=lambda a: a[2]):
        ch = choices.get(name, UNCOMPRESSED)
        # one round after it arrives, but no later than the end of the backward pass: the
        # rank then waits for its results, and a waiting rank's rounds go at once
        start = min(ready + lag, backward)
        if ch.compress and int(numel) >= 1:
            if codec is None:
                raise SeCoPaError(f"gradient {name!r} is compressed but no codec was given")
            paths = engine_paths(codec, ch.strategy)
            if ch.strategy not in paths:
                ch = Decision(True, ch.partitions, paths[0])
            if (ch.strategy == "ps" and ch.partitions <= 1 and model.N > 1
                    and 4 * int(numel) <= BULK_MAX_BYTES):
                groups = rounds.setdefault(math.floor(ready / lag) if lag > 0 else ready, [])
                if not groups or 4 * (groups[-1][1] + int(numel)) > bulk_bytes:
                    groups.append([[], 0, 0.0])
                groups[-1][0].append(name)
                groups[-1][1] += int(numel)
                groups[-1][2] = max(groups[-1][2], start)
                continue
            push_compressed(name, int(numel), ch.strategy, ch.partitions, start)
        else:
            held.append(name)
            held_bytes += 4.0 * int(numel)
            unc = model.uncompressed(int(numel))
            held_s += unc.network_s
            held_link += unc.network_s if unc.link_s is None else unc.link_s
            if held_bytes >= FUSION_HOLD_BYTES:
                release(start)
    release(backward)  # the rank waits for its results: the flush, in the next round
    for groups in rounds.values():
        for names, numel, start in groups:
            label = names[0] if len(names) == 1 else f"<bulk {len(bulked)}>"
            if len(names) > 1:
                bulked[label] = names
            push_compressed(label, numel, "ps", 1, start)
    heapq.heapify(heap)
    free = {"cpu": 0.0, "net": 0.0}
    busy = {"cpu": 0.0, "net": 0.0}
    busy_backward = 0.0
    finish: Dict[str, float] = {}
    # the model's compute costs are stretched for the backward pass (CostModel.contention);
    # work that starts after it runs at the tail's share of a core instead
    share_tail = float(getattr(model.profile, "cpu_share_tail", 1.0) or 1.0)
    tail = model.contention * share_tail
    wire_backward = 0.0
    while heap:
        ready, _, res, dur, rest, name, cpu = heapq.heappop(heap)
        if res == "wait":  # another rank's engine: no queue here, no load on this rank
            end = ready + (dur / tail if ready >= backward else dur)
        elif res == "latency":  # messages' fixed latency: it does not hold the link
            end = ready + dur
        else:
            start = max(ready, free[res])
            if res == "cpu" and start >= backward:
                dur = dur / tail
            end = start + dur
            free[res] = end
            busy[res] += dur
            if res == "net" and cpu > 0 and start >= backward:
                # after the backward pass the wire's CPU (the engine thread drives MPI)
                # keeps the compute server from codec work: it is busy that long more (at
                # the tail's share of a core); during the pass it is in backward_cpu_s
                took = cpu / share_tail
                free["cpu"] = max(free["cpu"], start) + took
                busy["cpu"] += took
            if start < backward:
                if res == "cpu":
                    busy_backward += min(end, backward) - start
                elif cpu > 0:  # the wire's CPU, spread evenly over the transfer
                    wire_backward += (cpu * (min(end, backward) - start) / dur if dur > 0
                                      else cpu)
        if rest:
            nxt_res, nxt_dur, nxt_cpu = rest[0]
            heapq.heappush(heap, (end, seq, nxt_res, nxt_dur, rest[1:], name, nxt_cpu))
            seq += 1
        elif name in fused or name in bulked:
            for g in fused.get(name) or bulked[name]:
                finish[g] = max(finish.get(g, 0.0), end)
        else:
            finish[name] = max(finish.get(name, 0.0), end)
    end_s = max(finish.values(), default=backward)
    return Simulation(backward_s=backward, end_s=end_s, exposed_s=max(0.0, end_s - backward),
                      backward_cpu_s=busy_backward / model.contention + wire_backward,
                      compute_busy_s=busy["cpu"], network_busy_s=busy["net"], finish_s=finish)


def arrivals_from_timeline(trace: Any, rank: Optional[int] = None) -> Tuple[
        List[List[Arrival]], List[Dict[str, float]]]:
    """Return each step's arrivals and measured times from a job's timeline.

    Reads the ``submit`` and ``done`` events the engine records with a timeline on
    (``timeline: trace.json``). A gradient can be synchronized only once every rank has
    submitted it, and ranks that share cores end their backward passes at different
    times (here up to 0.2 s apart), so by default (``rank=None``) a gradient's arrival is
    its latest submission over the ranks and its end its latest completion; with
    ``rank`` only that rank's events count (its waits then include the other ranks'
    lateness). The ranks' clocks must be comparable (one machine, or synchronized).

    Returns:
        ``(steps, measured)``: per step, the arrivals ``(name, numel, ready_s)`` relative
        to the step's first arrival, and ``{"backward_s": last arrival, "end_s": last
        completion, "exposed_s": their difference}`` (seconds from the first arrival).

    Raises:
        ProfileError: the timeline cannot be read (:func:`~hipress.secopa.profile.trace_events`).
        SeCoPaError: it has no submit events (of ``rank``).
    """
    steps: Dict[int, Dict[str, Any]] = {}
    for e in trace_events(trace):
        if e.get("name") not in ("submit", "done") or (
                rank is not None and e.get("pid") != rank):
            continue
        a = e.get("args") or {}
        st = steps.setdefault(int(a.get("step", 0)), {"submit": {}, "done": {}})
        name, ts = a.get("gradient"), float(e["ts"]) * 1e-6
        old = st[e["name"]].get(name)
        st[e["name"]][name] = (max(ts, old[0]) if old else ts,
                               int(a.get("numel", 0)) or (old[1] if old else 0))
    who = "any rank" if rank is None else f"rank {rank}"

    def none_of(what: str) -> SeCoPaError:
        return SeCoPaError(f"the timeline has no submit events of {what}: is it a HiPress "
                           "timeline? Write one with this HiPress version (timeline: "
                           "trace.json, or HIPRESS_TIMELINE=trace.json)")

    if not steps:
        raise none_of(who)
    out_arrivals, out_measured = [], []
    for step in sorted(steps):
        sub, done = steps[step]["submit"], steps[step]["done"]
        names = [n for n in sub if not str(n).startswith("__")]
        if not names:
            continue
        t0 = min(sub[n][0] for n in names)
        out_arrivals.append([(n, sub[n][1], sub[n][0] - t0) for n in names])
        back = max(sub[n][0] for n in names) - t0
        end = max((done[n][0] for n in names if n in done), default=t0) - t0
        out_measured.append({"backward_s": back, "end_s": end, "exposed_s": max(0.0, end - back)})
    if not out_arrivals:  # done events only, or the engine's own names only
        raise none_of(f"{who} for a gradient")
    return out_arrivals, out_measured


def median_step(measured: Sequence[Dict[str, float]], skip: int) -> int:
    """Return the index of the step with the median exposed time, after ``skip`` steps.

    The lower median for an even count; at least the last step is kept whatever ``skip``.

    Args:
        measured: the second list :func:`arrivals_from_timeline` returns.
        skip: warm-up steps to leave out.
    """
    keep = list(range(min(max(skip, 0), len(measured) - 1), len(measured)))
    return sorted(keep, key=lambda i: measured[i]["exposed_s"])[(len(keep) - 1) // 2]


def step_vectors(events: Sequence[Dict[str, Any]], names: Sequence[str],
                 steps: Sequence[int]) -> np.ndarray:
    """Return one rank's arrival and completion times per step, for combining over ranks.

    ``sync.plan: auto`` plans from the steps a job observed
    (:class:`hipress.secopa.runtime.PlanFollower`); each rank reads its own in-memory
    timeline with this, the ranks take the element-wise maximum (an allreduce), and the
    result is what :func:`arrivals_from_timeline` gives for a whole job's timeline (a
    gradient arrives when its last rank submits it), except that each rank's times are
    relative to its own first submission, so clocks of different hosts need not agree.

    Args:
        events: the rank's timeline events (``submit`` and ``done``, as the engine
            records them; others are ignored).
        names: the gradients, in an order every rank shares.
        steps: the step numbers (the events' ``step`` argument) to read.

    Returns:
        float64 array of shape ``(len(steps), len(names) + 1)``: per step, each gradient's
        submission time in seconds from the step's first submission of one of ``names``,
        then the step's last completion of one of them from the same origin; -1.0 where
        the step has no such event (a step without submissions is all -1).
    """
    col = {str(n): i for i, n in enumerate(names)}
    row = {int(s): i for i, s in enumerate(steps)}
    sub = np.full((len(row), len(col)), np.nan)
    done = np.full((len(row), len(col)), np.nan)
    for e in events:
        kind = e.get("name")
        if kind not in ("submit", "done"):
            continue
        a = e.get("args") or {}
        i, j = row.get(int(a.get("step", -1))), col.get(str(a.get("gradient")))
        if i is None or j is None:
            continue
        target = sub if kind == "submit" else done
        ts = float(e["ts"]) * 1e-6
        target[i, j] = ts if np.isnan(target[i, j]) else max(target[i, j], ts)
    out = np.full((len(row), len(col) + 1), -1.0)
    for i in range(len(row)):
        if np.all(np.isnan(sub[i])):
            continue
        t0 = np.nanmin(sub[i])
        got = ~np.isnan(sub[i])
        out[i, :-1][got] = sub[i][got] - t0
        if not np.all(np.isnan(done[i])):
            out[i, -1] = max(np.nanmax(done[i]) - t0, 0.0)
    return out
