"""The ``hipress profile`` and ``hipress plan`` commands (registered by :mod:`hipress.cli`).

Usage::

    hipressrun -np 8 -- hipress profile -o profile.json
    hipress plan --profile profile.json --gradients resnet50 --strategy ps
        --world-size 8 --codec onebit -o plan.json
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Any, Dict, List

from hipress.errors import ConfigError

logger = logging.getLogger(__name__)


class _DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Show ``(default: X)`` only for options with a real default (not None or False)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default in (None, False, argparse.SUPPRESS) or action.required \
                or "default" in text:
            return text
        return super()._get_help_string(action) or text


def add_commands(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``profile`` and ``plan`` commands to the ``hipress`` parser."""
    from hipress.secopa.planner import DEFAULT_MAX_PARTITIONS, DEFAULT_MIN_GAIN
    from hipress.secopa.profile import DEFAULT_TIME_BUDGET_S

    p = subparsers.add_parser(
        "profile", help="measure codec and network costs of this cluster for SeCoPa",
        description="Measure encode/decode/merge time per codec and the send costs of the "
                    "engine's message patterns (PS gather/broadcast, ring step, allgather, "
                    "allreduce) over a range of sizes, fit t(x) = max(floor, a + b*x) and "
                    "write a profile file. Run it under hipressrun/mpirun on the cluster in "
                    "question (every rank takes part); at one rank it profiles the codecs "
                    "and records zero communication cost. It measures for --time-budget "
                    f"seconds (default {DEFAULT_TIME_BUDGET_S:g}), plus the codecs' first "
                    "use (kernel loading, typically 0.1-2 s per codec). With "
                    "--from-timeline it measures nothing: it rescales --profile to a job's "
                    "timeline.",
        formatter_class=_DefaultsFormatter)
    p.add_argument("--codecs", nargs="+", metavar="NAME", default=None,
                   help="codecs to profile (default: every registered codec that builds "
                        "without parameters)")
    p.add_argument("--params", default="{}", metavar="JSON",
                   help='constructor parameters per codec, e.g. \'{"topk": {"ratio": 0.001}}\'')
    p.add_argument("--sizes", nargs="+", type=int, metavar="N", default=None,
                   help="codec input sizes in float32 elements (default 4^4 .. 4^11)")
    p.add_argument("--comm-sizes", nargs="+", type=int, metavar="BYTES", default=None,
                   help="message sizes in bytes (default 4^3 .. 4^13)")
    p.add_argument("--time-budget", type=float, default=DEFAULT_TIME_BUDGET_S, metavar="S",
                   help="seconds of measurements")
    p.add_argument("--blas-threads", type=int, default=1, metavar="N",
                   help="threads of NumPy's BLAS while measuring, as the engine runs them "
                        "(sync.blas_threads; 0 = the library's own)")
    p.add_argument("-o", "--output", default="profile.json", metavar="FILE",
                   help="profile file to write (rank 0)")
    p.add_argument("--from-timeline", default=None, metavar="TRACE",
                   help="instead of measuring: scale --profile's compute costs to what a "
                        "job's timeline (timeline: trace.json) measured under training load")
    p.add_argument("--profile", default=None, metavar="FILE",
                   help="the measured profile to refit (with --from-timeline)")
    p.set_defaults(func=_profile)

    q = subparsers.add_parser(
        "plan", help="plan selective compression and partitioning for a gradient set",
        description="Choose per gradient: compress or not, partitions K and path, minimizing "
                    "SeCoPa's cost model for the profile, codec, strategy and world size; "
                    "print the predicted per-iteration sync time of the plan, of compressing "
                    "everything, of the engine's fixed threshold and of compressing nothing.",
        formatter_class=_DefaultsFormatter)
    q.add_argument("--profile", required=True, metavar="FILE", help="from `hipress profile`")
    q.add_argument("--gradients", required=True, metavar="G",
                   help="gradient-set JSON ({'gradients': [{'name', 'shape'}]}) or a shipped "
                        "set: vgg19, resnet50, bert-base")
    q.add_argument("--strategy", default="ps", choices=("ps", "ring", "auto"),
                   help="CaSync strategy (auto: the planner picks per gradient)")
    q.add_argument("--world-size", type=int, default=None, metavar="N",
                   help="ranks to plan for (default: the profile's)")
    q.add_argument("--codec", required=True, metavar="NAME", help="codec name")
    q.add_argument("--params", default="{}", metavar="JSON", help="codec parameters")
    q.add_argument("--memory", default="auto", choices=("auto", "none", "residual", "dgc"),
                   help="compression.memory of the job (error feedback in the encode step)")
    q.add_argument("--max-partitions", type=int, default=DEFAULT_MAX_PARTITIONS, metavar="K",
                   help="largest number of partitions tried per gradient")
    q.add_argument("--fusion-bytes", type=int, default=64 * 1024 * 1024, metavar="B",
                   help="sync.fusion_threshold_bytes")
    q.add_argument("--min-compress-bytes", type=int, default=65536, metavar="B",
                   help="compression.min_compress_bytes, for the threshold baseline")
    q.add_argument("--partition-bytes", type=int, default=4 * 1024 * 1024, metavar="B",
                   help="sync.partition_bytes, for the threshold baseline and bulk groups")
    q.add_argument("--timeline", default=None, metavar="TRACE",
                   help="a job's timeline (timeline: trace.json): simulate each policy's "
                        "exposed sync time over its gradients' arrival times (the median "
                        "step after --skip-steps) and print the step's measured one")
    q.add_argument("--skip-steps", type=int, default=2, metavar="N",
                   help="warm-up steps of the timeline to leave out")
    q.add_argument("--min-gain", type=float, default=DEFAULT_MIN_GAIN, metavar="F",
                   help="with --timeline: leave the best fixed policy only for a plan "
                   "predicted at least this fraction of the iteration faster (0 keeps what "
                   "the search found)")
    q.add_argument("-o", "--output", default=None, metavar="FILE", help="plan file to write")
    q.add_argument("-v", "--verbose", action="store_true",
                   help="also print every gradient: the predicted time of each option and "
                   "why the plan chose one")
    q.set_defaults(func=_plan)


def _json_arg(text: str, what: str) -> Dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{what} must be a JSON object: {exc.msg} in {text!r}") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{what} must be a JSON object, got {text!r}")
    return value


def _default_codecs(params: Dict[str, Any]) -> List[Any]:
    from hipress.codecs import codec_names, get_codec

    out = []
    for name in codec_names():
        if name == "none":
            continue
        try:
            out.append(get_codec(name, **params.get(name, {})))
        except Exception as exc:  # noqa: BLE001 - a codec that needs parameters is skipped
            logger.info("not profiling codec %r by default: %s", name, exc)
    return out


def _refit(args: argparse.Namespace) -> int:
    from hipress.secopa.profile import Profile, refit_from_timeline

    if not args.profile:
        raise ConfigError("--from-timeline needs --profile FILE: the measured profile whose "
                          "compute costs the timeline rescales (make one with `hipress "
                          "profile` under hipressrun)")
    prof, report = refit_from_timeline(Profile.load(args.profile), args.from_timeline)
    step = report.pop("engine/step", None)
    share = report.pop("engine/cpu-share", None)
    print(f"SeCoPa refit of {args.profile} from {args.from_timeline}: measured / predicted "
          "CPU time per span (median scales the fits)")
    print(f"  {'codec/primitive':<28}{'spans':>7}{'p20':>8}{'median':>8}{'p80':>8}")
    for key, r in report.items():
        print(f"  {key:<28}{r['spans']:>7}{r['p20']:>8.2f}{r['factor']:>8.2f}{r['p80']:>8.2f}")
    if step is None:
        print("  engine CPU per task step: not in the timeline (written by an older "
              f"HiPress); kept at {prof.step_overhead_s * 1e3:.3f} ms")
    else:
        print(f"  engine CPU per task step: {step['step_overhead_s'] * 1e3:.3f} ms (profiled "
              f"{step['profiled_s'] * 1e3:.3f} ms), over {int(step['steps'])} steps outside "
              "codec work")
    if share is not None:
        print(f"  share of a core for the engine's work: {share['backward']:.2f} during the "
              f"backward pass ({int(share['spans_backward'])} spans), {share['tail']:.2f} "
              f"after it ({int(share['spans_tail'])} spans)")
    print(f"  negotiation round interval (median, rank 0): {prof.round_s * 1e3:.2f} ms")
    prof.save(args.output)
    print(f"wrote {args.output}")
    return 0


def _profile(args: argparse.Namespace) -> int:
    if args.from_timeline:
        return _refit(args)
    import mpi4py

    mpi4py.rc.thread_level = "multiple"
    from mpi4py import MPI

    from hipress.codecs import get_codec
    from hipress.secopa.profile import run_profile

    params = _json_arg(args.params, "--params")
    if args.codecs:
        codecs = [get_codec(n, **params.get(n, {})) for n in args.codecs]
    else:
        codecs = _default_codecs(params)
    comm = MPI.COMM_WORLD.Dup()
    try:
        prof = run_profile(comm, codecs, sizes=args.sizes, comm_sizes=args.comm_sizes,
                           time_budget_s=args.time_budget, blas_threads=args.blas_threads)
    finally:
        comm.Free()
    if MPI.COMM_WORLD.Get_rank() == 0:
        prof.save(args.output)
        print(_profile_table(prof))
        print(f"wrote {args.output}")
    return 0


def _profile_table(prof: Any) -> str:
    def row(label: str, f: Any) -> str:
        slope = max(f.b, f.b2 or 0.0)  # the large-size slope
        gbs = f"{1e-9 / slope:9.2f}" if slope > 0 else f"{'inf':>9}"
        return (f"  {label:<34}{f.floor * 1e6:9.1f}{f.a * 1e6:9.1f}{gbs}{f.rel_rms * 100:7.1f}%"
                f"{f.r2:7.3f}{f.spread * 100:7.0f}%{int(f.x_max):>12}")

    head = (f"  {'primitive':<34}{'floor us':>9}{'a us':>9}{'GB/s*':>9}{'relRMS':>8}{'R2':>7}"
            f"{'spread':>8}{'max bytes':>12}")
    load = ", ".join(f"{h} {v:.2f}" for h, v in sorted(prof.host_load.items())) or "unknown"
    lines = [f"SeCoPa profile: {prof.world_size} rank(s) on {', '.join(sorted(set(prof.hosts)))}"
             f"; {prof.elapsed_s:.1f} s ({prof.warmup_s:.1f} s codec warm-up, budget "
             f"{prof.time_budget_s:g} s); step overhead {prof.step_overhead_s * 1e6:.0f} us",
             f"  cores busy with other programs: {load}" + (
                 "  ** TAKEN UNDER LOAD: costs include other programs'; profile again on a "
                 "quiet cluster **" if prof.loaded else ""),
             head, "  (* bytes per second at large sizes: input bytes for compute, message bytes "
             "for comm)"]
    if prof.world_size > 1:
        for name, f in prof.comm:
            lines.append(row(f"comm {name}", f))
    else:
        lines.append("  (world size 1: communication costs recorded as zero)")
    lines.append(row("error feedback", prof.ef))
    for key, c in prof.codecs.items():
        for prim in ("encode", "decode", "merge", "stages"):
            f = getattr(c, prim)
            if f is not None:
                lines.append(row(f"{key[:26]} {prim}", f))
    return "\n".join(lines)


def _plan(args: argparse.Namespace) -> int:
    from hipress.codecs import get_codec
    from hipress.secopa.planner import load_gradients, option_table, plan, summary_table
    from hipress.secopa.profile import LOADED_SHARE, Profile

    prof = Profile.load(args.profile)
    if prof.loaded:
        busy = ", ".join(f"{h} {v:.2f}" for h, v in sorted(prof.host_load.items()))
        print(f"note: {args.profile} was taken under load (share of the cores other "
              f"programs kept busy: {busy}; above {LOADED_SHARE:.2f} counts as loaded): its "
              "costs include other programs', so this plan may be off; profile again on a "
              "quiet cluster", file=sys.stderr)
    grads = load_gradients(args.gradients)
    codec = get_codec(args.codec, **_json_arg(args.params, "--params"))
    n = args.world_size or prof.world_size
    arrivals, measured = None, None
    if args.timeline:
        from hipress.secopa.pipeline import arrivals_from_timeline, median_step

        steps, meas = arrivals_from_timeline(args.timeline)
        mid = median_step(meas, args.skip_steps)
        arrivals, measured = steps[mid], (mid, meas[mid])
        known = {a[0] for a in arrivals} & {str(g[0]) for g in grads}
        if args.skip_steps >= len(meas):
            print(f"note: {args.timeline} has {len(meas)} step(s), not more than "
                  f"--skip-steps {args.skip_steps}; using its last step", file=sys.stderr)
        if len(known) < len(grads):
            seen = sorted(a[0] for a in arrivals)[:2]
            print(f"note: {len(grads) - len(known)} of {len(grads)} gradients have no "
                  f"arrival in {args.timeline} (other names? it has e.g. {seen}, the set "
                  f"has e.g. {[str(g[0]) for g in grads[:2]]}); taken as ready at the end "
                  "of the backward pass", file=sys.stderr)
    p = plan(prof, grads, codec, args.strategy, n, max_partitions=args.max_partitions,
             memory=args.memory, fusion_bytes=args.fusion_bytes,
             min_compress_bytes=args.min_compress_bytes, partition_bytes=args.partition_bytes,
             profile_source=str(args.profile), arrivals=arrivals, min_gain=args.min_gain)
    if n != prof.world_size:
        print(f"note: profile measured on {prof.world_size} rank(s); message costs scaled to "
              f"{n} ranks (alpha-beta model)", file=sys.stderr)
    print(summary_table(p))
    if measured is not None:
        i, m = measured
        print(f"measured in {args.timeline} (its median step {i}, every rank, under the "
              f"job's own policy): last gradient ready {m['backward_s'] * 1e3:.2f} ms, last "
              f"done {m['end_s'] * 1e3:.2f} ms, exposed {m['exposed_s'] * 1e3:.2f} ms")
    if args.verbose:
        print(option_table(p, prof, grads, codec, args.fusion_bytes, arrivals=arrivals,
                           partition_bytes=args.partition_bytes))
    if args.output:
        p.save(args.output)
        print(f"wrote {args.output}")
    return 0
