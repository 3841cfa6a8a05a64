"""SeCoPa end to end: the pipeline model's predictions against training on the cluster.

One run, on the emulated cluster of ``bench/README.md`` (or ``--local``), for one model
and codec:

1. ``hipress profile`` on the cluster (``--profile-budget`` seconds, every rank);
2. train with the engine's fixed policy (``threshold``: compress gradients of >= 64 KiB,
   ``ceil(bytes / 4 MiB)`` partitions) with a timeline, and refit the profile's compute
   costs and negotiation round from it (``hipress profile --from-timeline``);
3. plan from the refitted profile and that timeline (``hipress plan --timeline``): the
   ``plan`` policy's file;
4. train with ``compress_everything`` (``compression.min_compress_bytes: 0``),
   ``compress_nothing`` (``--codec none``), ``plan`` (``sync.plan: <the file>``), each
   with a timeline,
   and ``auto`` (``sync.plan: auto``: the job profiles at init, observes its first steps
   and plans from them itself, :mod:`hipress.secopa.runtime`; its ``--warmup`` grows by
   the steps before its plan takes effect and those that time it against the fixed
   policy (``sync.plan_verify_steps``), and rank 0 saves the plan it kept, which the
   predictions for its row use; a job that dropped its plan, or made none, is predicted
   with the fixed policy's choices, basis ``dropped``);
5. with ``--repeats R``, R - 1 more rounds of all five policies, interleaved, so that a
   drift of the machine's speed hits every policy alike; the step of ``plan`` and of
   ``auto`` over the best fixed policy's step of the same round, per round and their
   median, is printed in the header (``plan_vs_best_fixed_per_round`` and
   ``auto_vs_best_fixed_per_round`` in the JSON);
6. for each policy: the **measured** exposed sync time per step (from the timeline: the
   last completion minus the last arrival, a gradient arriving when its last rank
   submits it; median over the timed steps) and step time (the workers' median; both
   the median over the policy's runs), against the **predicted** exposed time and delay
   of :func:`hipress.secopa.pipeline.simulate` (exposed time plus the CPU the
   synchronization takes from the backward pass) from the refitted profile, the
   policy's own choices and the arrival times of that job's median step. The predicted
   step time is a compute floor plus the predicted delay; the floor is calibrated once,
   on the ``threshold`` policy (its measured step less its predicted delay), so that
   row's step prediction is exact by construction and the others are predictions.

With ``--sync-only`` the jobs do not train: every step submits the gradients of one
backward pass all at once (last layer first, ``hipress.allreduce_async``) and waits for
them (``bench/train_e2e_worker.py --sync-only``), so the measured step is the
synchronization alone and the model predicts it from arrivals that all lie within the
submission loop's few milliseconds. Its files are named ``<model>-<codec>-<rate>-sync``
(``-ring-sync`` under ``--strategy ring``, whose files are otherwise ``...-<rate>-ring``).

Usage (root, for the network namespaces)::

    python bench/secopa_pipeline.py --model resnet50 --codec onebit
    python bench/secopa_pipeline.py --model vgg19 --codec onebit --iters 3
    python bench/secopa_pipeline.py --model vgg19 --codec onebit --sync-only

``--analyse-only`` (same arguments and ``--out``) runs nothing and analyses the jobs an
earlier run left there again.

Writes ``<out>/<model>-<codec>-<rate>[-ring][-sync].json`` and ``.md`` (default
``bench/results/secopa-pipeline``); every job's command and log lines go to
``<out>/jobs/``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

POLICIES = ("threshold", "compress_everything", "compress_nothing", "plan", "auto")
#: the policies that are not fixed rules (compared with the best fixed one of their round)
PLANNED = ("plan", "auto")


def parse(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="resnet50", help="resnet50, vgg19 or bert-base")
    p.add_argument("--codec", default="onebit")
    p.add_argument("--strategy", default="ps", choices=("ps", "ring"))
    p.add_argument("--hosts", type=int, default=4)
    p.add_argument("--rate", default="1gbit")
    p.add_argument("--local", action="store_true", help="localhost, no emulated links")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--image-size", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=64, help="tokens per sequence (bert-base)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--repeats", type=int, default=1,
                   help="rounds of the four policies (interleaved); medians over rounds")
    p.add_argument("--sync-only", action="store_true",
                   help="no training: each step synchronizes one backward pass's gradients")
    p.add_argument("--profile-budget", type=float, default=40.0)
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--job-timeout", type=float, default=900.0)
    p.add_argument("--analyse-only", action="store_true",
                   help="run nothing: analyse the jobs an earlier run left in --out")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "secopa-pipeline"))
    return p.parse_args(argv)


def plan_vs_best_fixed_per_round(jobs: Dict[str, List[Dict[str, Any]]],
                                  policy: str = "plan") -> List[float]:
    """Return, per round with a ``policy`` step, its step / the best fixed policy's step.

    A round's jobs run minutes apart, rounds tens of minutes apart: the machine's speed
    drifts between rounds more than between a round's jobs, so the ratio within a round
    tells the policies apart better than the ratio of medians over rounds.

    Args:
        jobs: per policy, its jobs, each with ``round``, ``rc`` and ``step_s``.
        policy: ``plan`` (the file ``hipress plan`` made) or ``auto`` (the plan the job
            made at run time); neither counts as a fixed policy.
    """
    steps: Dict[int, Dict[str, float]] = {}
    for name, runs in jobs.items():
        for j in runs:
            if j["rc"] == 0 and j["step_s"]:
                steps.setdefault(j["round"], {})[name] = j["step_s"]
    out = []
    for rnd in sorted(steps):
        fixed = [v for k, v in steps[rnd].items() if k not in PLANNED]
        if policy in steps[rnd] and fixed:
            out.append(steps[rnd][policy] / min(fixed))
    return out


def loadavg() -> List[float]:
    return [round(x, 2) for x in os.getloadavg()]


class Runner:
    """Runs commands on every rank of the cluster (or localhost), logging each job."""

    def __init__(self, args: argparse.Namespace, hosts: Optional[str], env: Dict[str, str],
                 jobdir: Path) -> None:
        self.args, self.hosts, self.env, self.jobdir = args, hosts, env, jobdir
        bindir = Path(sys.executable).parent
        self.mpirun = str(bindir / "mpirun") if (bindir / "mpirun").exists() else "mpirun"

    def mpirun_cmd(self, argv: Sequence[str], extra_env: Dict[str, str]) -> List[str]:
        """Return the mpirun command line running ``argv`` with ``extra_env`` exported."""
        n = self.args.hosts
        cmd = [self.mpirun, "-np", str(n)]
        cmd += ["-H", self.hosts] if self.hosts else ["--oversubscribe"]
        cmd += ["--bind-to", "none", "--map-by", "slot", "-x", "PYTHONUNBUFFERED"]
        for k in extra_env:
            cmd += ["-x", k]
        return cmd + list(argv)

    def run(self, tag: str, argv: Sequence[str], extra_env: Optional[Dict[str, str]] = None
            ) -> int:
        """Run ``argv`` on every rank, its output to ``<jobdir>/<tag>.log``; the exit code."""
        extra = dict(extra_env or {})
        cmd = self.mpirun_cmd(argv, extra)
        env = dict(self.env, PYTHONUNBUFFERED="1", **extra)
        print(f"=== {tag}: load {loadavg()}\n    {shlex.join(cmd)}", flush=True)
        t0 = time.time()
        with open(self.jobdir / f"{tag}.log", "w") as log:
            log.write(shlex.join(cmd) + "\n")
            log.flush()
            try:
                rc = subprocess.call(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                     timeout=self.args.job_timeout)
            except subprocess.TimeoutExpired:
                rc = 124
        print(f"    exit {rc} after {time.time() - t0:.0f} s", flush=True)
        return rc


def fixed_choices(grads: Sequence[Any], strategy: str, config: Dict[str, Any]) -> Dict[str, Any]:
    """What the engine's fixed policy does with each gradient under ``config``.

    :class:`hipress.engine.planning.FixedPolicy` itself, on the config the job ran with
    (its defaults plus ``config``): the decisions the timeline's job made.
    """
    import types

    import numpy as np

    from hipress.codecs import get_codec
    from hipress.config import config_from_dict
    from hipress.engine.planning import FixedPolicy

    policy = FixedPolicy(config_from_dict(config))
    codec = get_codec("fp16")  # any codec: the policy only asks whether there is one
    f32 = np.dtype(np.float32)
    return {name: policy.decide(name, types.SimpleNamespace(size=math.prod(shape), dtype=f32),
                                codec, strategy) for name, shape in grads}


def measured(trace: Path, warmup: int) -> Dict[str, Any]:
    """The median step after ``warmup``: its arrivals and measured exposed time."""
    from hipress.secopa.pipeline import arrivals_from_timeline, median_step

    steps, meas = arrivals_from_timeline(str(trace))
    mid = median_step(meas, warmup)
    return {"arrivals": steps[mid], "step": mid, **meas[mid],
            "exposed_all_s": [m["exposed_s"] for m in meas[min(warmup, len(meas) - 1):]]}


def worker_step_s(prefix: Path, n: int) -> Optional[float]:
    """The slowest rank's median timed step from the train_e2e workers' JSON files.

    A worker's ``steps`` include its warm-up steps (``warmup_used`` of them, first): they
    are left out.
    """
    meds = []
    for r in range(n):
        f = Path(f"{prefix}.rank{r}.json")
        if not f.exists():
            return None
        info = json.loads(f.read_text())
        steps = info["steps"][int(info.get("warmup_used", 0)):] or info["steps"][-1:]
        meds.append(statistics.median(s["step_s"] for s in steps))
    return max(meds)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse(argv)
    out = Path(args.out)
    jobdir = out / "jobs"
    jobdir.mkdir(parents=True, exist_ok=True)
    rate = "local" if args.local else args.rate
    tag = (f"{args.model}-{args.codec}-{rate}" + ("-ring" if args.strategy == "ring" else "")
           + ("-sync" if args.sync_only else ""))
    if args.local or args.analyse_only:
        return run_all(args, Runner(args, None, dict(os.environ), jobdir), out, tag)
    from hipress.testing.emucluster import EmulatedCluster, namespaces_unavailable

    reason = namespaces_unavailable()
    if reason is not None:
        print(f"cannot build the emulated cluster: {reason} (try --local)", file=sys.stderr)
        return 2
    with EmulatedCluster(args.hosts, rate=args.rate) as cluster:
        print(f"=== {cluster!r}; load {loadavg()}", flush=True)
        return run_all(args, Runner(args, cluster.hosts_arg(), cluster.env(os.environ),
                                    jobdir), out, tag)


def run_all(args: argparse.Namespace, runner: Runner, out: Path, tag: str) -> int:
    from hipress.codecs import get_codec
    from hipress.secopa.cost import CostModel
    from hipress.secopa.pipeline import UNCOMPRESSED, simulate
    from hipress.secopa.planner import Plan, load_gradients
    from hipress.secopa.profile import Profile, refit_from_timeline

    py, hp_cli = sys.executable, str(Path(sys.executable).parent / "hipress")
    work = out / "jobs" / tag
    work.mkdir(parents=True, exist_ok=True)
    policies = [p for p in args.policies.split(",") if p]
    load_start, load_end = loadavg(), None
    earlier = out / f"{tag}.json"
    if args.analyse_only and earlier.exists():  # the loads the jobs ran under
        old = json.loads(earlier.read_text())["meta"]
        load_start, load_end = old.get("load_start"), old.get("load_end")
    prof_path = work / "profile.json"
    rc = 0 if args.analyse_only else runner.run(
        f"{tag}-profile", [hp_cli, "profile", "--codecs", args.codec, "--time-budget",
                           str(args.profile_budget), "-o", str(prof_path)])
    if rc or not prof_path.exists():
        print(f"profile failed (exit {rc}); see {out / 'jobs'}", file=sys.stderr)
        return 1

    def train(policy: str, env: Dict[str, str], codec: str, rnd: int = 0) -> Dict[str, Any]:
        name = policy if rnd == 0 else f"{policy}.r{rnd}"
        trace = work / f"{name}.trace.json"
        prefix = work / f"{name}"
        warmup = args.warmup
        job: Dict[str, Any] = {"trace": trace, "round": rnd, "warmup": warmup}
        if policy == "auto":  # plans at run time: time only the steps after its plan
            saved = work / f"{name}.plan.json"
            cfg = work / f"{name}.yaml"
            cfg.write_text(json.dumps({"sync": {"plan": "auto", "plan_save": str(saved)}}))
            env = dict(env, HIPRESS_CONFIG=str(cfg))
            from hipress.config import SyncConfig

            # before its plan: the first compressed step and the observed ones; then the
            # step that settles the plan and the ones that time it (a plan slower than
            # the fixed policy is dropped after them, sync.plan_verify_steps)
            sync = SyncConfig()
            warmup += 1 + sync.plan_observe_steps + 1 + sync.plan_verify_steps
            job.update(warmup=warmup, plan_path=saved)
        if args.analyse_only:
            step = worker_step_s(prefix, args.hosts)
            return dict(job, rc=0 if step and trace.exists() else 1, step_s=step)
        for old in [trace, *work.glob(f"{name}.rank*.json")]:
            old.unlink(missing_ok=True)
        rc = runner.run(f"{tag}-{name}", [
            py, str(ROOT / "bench" / "train_e2e_worker.py"), "--system", "hipress", "--model",
            args.model, "--batch-size", str(args.batch_size), "--image-size",
            str(args.image_size), "--seq-len", str(args.seq_len), "--warmup", str(warmup),
            "--iters", str(args.iters),
            "--codec", codec, "--strategy", args.strategy, "--json", str(prefix)]
            + (["--sync-only"] if args.sync_only else []),
            dict(env, HIPRESS_TIMELINE=str(trace)))
        return dict(job, rc=rc, step_s=worker_step_s(prefix, args.hosts))

    grads = load_gradients(args.model)
    jobs: Dict[str, List[Dict[str, Any]]] = {}
    jobs["threshold"] = [train("threshold", {}, args.codec)]
    if jobs["threshold"][0]["rc"] or not jobs["threshold"][0]["trace"].exists():
        print("the threshold job failed; nothing to refit from", file=sys.stderr)
        return 1
    refit, report = refit_from_timeline(Profile.load(prof_path),
                                        str(jobs["threshold"][0]["trace"]))
    refit_path = work / "profile.refit.json"
    refit.save(refit_path)
    plan_path = work / "plan.json"
    if not args.analyse_only:
        subprocess.run([hp_cli, "plan", "--profile", str(refit_path), "--gradients", args.model,
                        "--strategy", args.strategy, "--world-size", str(args.hosts),
                        "--codec", args.codec, "--timeline",
                        str(jobs["threshold"][0]["trace"]), "--skip-steps", str(args.warmup),
                        "-o", str(plan_path)], check=True)
    everything = {"compression": {"min_compress_bytes": 0}}
    everything_cfg = work / "everything.yaml"
    everything_cfg.write_text(json.dumps(everything))  # YAML reads JSON
    plan_cfg = work / "plan.yaml"
    plan_cfg.write_text(f"sync:\n  plan: {json.dumps(str(plan_path))}\n")
    how = {"threshold": ({}, args.codec),
           "compress_everything": ({"HIPRESS_CONFIG": str(everything_cfg)}, args.codec),
           "compress_nothing": ({}, "none"),
           "plan": ({"HIPRESS_CONFIG": str(plan_cfg)}, args.codec),
           "auto": ({}, args.codec)}
    for rnd in range(max(args.repeats, 1)):
        for policy in ("compress_everything", "compress_nothing", "plan", "auto", "threshold"):
            if policy in policies and not (policy == "threshold" and rnd == 0):
                env, codec_name = how[policy]
                jobs.setdefault(policy, []).append(train(policy, env, codec_name, rnd))

    codec = get_codec(args.codec)
    model = CostModel(refit, args.hosts)
    plan_file = Plan.load(plan_path)
    choices = {
        "threshold": fixed_choices(grads, args.strategy, {}),
        "compress_everything": fixed_choices(grads, args.strategy, everything),
        "compress_nothing": {n: UNCOMPRESSED for n, _ in grads},
        "plan": plan_file.decisions(),
    }
    rows = []
    for policy, runs in jobs.items():
        ok = [j for j in runs if j["rc"] == 0 and j["step_s"] and j["trace"].exists()]
        row: Dict[str, Any] = {"policy": policy, "rc": max(j["rc"] for j in runs),
                               "runs": len(runs), "step_s": None,
                               "step_s_runs": [j["step_s"] for j in runs]}
        if policy == "auto":  # each job's own plan (rank 0 saved it once kept)
            for j in ok:
                if j["plan_path"].exists():
                    j["plan"] = Plan.load(j["plan_path"])
                    j["choices"], j["basis"] = j["plan"].decisions(), j["plan"].basis
                else:  # dropped after its timed steps (or not made): the fixed policy
                    j["choices"], j["basis"] = choices["threshold"], "dropped"
            if ok:
                choices["auto"] = ok[0]["choices"]
                row["auto_plans"] = [{"basis": j["basis"],
                                      "compressed": sum(c.compress for c in j["choices"].values())}
                                     for j in ok]
        if ok:
            ms = [measured(j["trace"], j["warmup"]) for j in ok]
            sims = [simulate(model, m["arrivals"], j.get("choices") or choices[policy], codec,
                             plan_file.feedback, shapes=dict(grads)) for m, j in zip(ms, ok)]
            row.update(step_s=statistics.median(j["step_s"] for j in ok),
                       measured_exposed_s=statistics.median(m["exposed_s"] for m in ms),
                       backward_s=statistics.median(m["backward_s"] for m in ms),
                       exposed_all_s=[x for m in ms for x in m["exposed_all_s"]],
                       predicted_exposed_s=statistics.median(s.exposed_s for s in sims),
                       predicted_delay_s=statistics.median(s.delay_s for s in sims),
                       compressed=sum(c.compress for c in choices[policy].values()))
        rows.append(row)
    calib = next((r for r in rows if r["policy"] == "threshold" and r["step_s"]), None)
    floor = calib["step_s"] - calib["predicted_delay_s"] if calib else None
    for r in rows:
        if floor is not None and r["step_s"]:
            r["predicted_step_s"] = floor + r["predicted_delay_s"]
    best_fixed = min((r["step_s"] for r in rows if r["policy"] not in PLANNED and r["step_s"]),
                     default=None)
    per_round = plan_vs_best_fixed_per_round(jobs)
    auto_per_round = plan_vs_best_fixed_per_round(jobs, "auto")
    meta = {"model": args.model, "codec": args.codec, "strategy": args.strategy,
            "rate": "local" if args.local else args.rate, "hosts": args.hosts,
            "batch_size": args.batch_size, "image_size": args.image_size,
            "seq_len": args.seq_len, "sync_only": args.sync_only,
            "warmup": args.warmup, "iters": args.iters, "repeats": args.repeats,
            "load_start": load_start, "compute_floor_s": floor,
            "wire_cpu_ns_per_byte": refit.wire_cpu_s_per_byte * 1e9,
            "load_end": load_end or loadavg(), "refit": report, "round_s": refit.round_s,
            "plan_predicted_exposed_ms": plan_file.predicted_exposed_ms,
            "plan_predicted_delay_ms": plan_file.predicted_delay_ms,
            "plan_basis": plan_file.basis,
            "plan_vs_best_fixed_per_round": per_round,
            "auto_vs_best_fixed_per_round": auto_per_round,
            "argv": sys.argv[1:]}
    (out / f"{tag}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    lines = [f"SeCoPa pipeline model vs {'synchronization only' if args.sync_only else 'training'}"
             f": {args.model}, {args.codec} "
             f"({args.strategy}), {args.hosts} hosts at {meta['rate']}, load {load_start} -> "
             f"{meta['load_end']}; refit factors "
             + ", ".join(f"{k} {v['factor']:.2f}" for k, v in report.items() if "factor" in v)
             + f"; round {refit.round_s * 1e3:.1f} ms; engine cost per task step "
             + (f"{report['engine/step']['step_overhead_s'] * 1e3:.3f} ms (profiled "
                f"{report['engine/step']['profiled_s'] * 1e3:.3f} ms)"
                if "engine/step" in report else "not measured")
             + f"; wire CPU {refit.wire_cpu_s_per_byte * 1e9:.2f} ns/byte; compute floor "
             + (f"{floor:.3f} s (threshold's step less its predicted delay)"
                if floor is not None else "unknown")
             + f"; plan basis {plan_file.basis}"
             + f"; {max(args.repeats, 1)} round(s), medians"
             + ("; plan / best fixed policy of the same round: "
                + ", ".join(f"{x:.3f}" for x in per_round)
                + f" (median {statistics.median(per_round):.3f})" if per_round else "")
             + ("; auto / best fixed policy of the same round: "
                + ", ".join(f"{x:.3f}" for x in auto_per_round)
                + f" (median {statistics.median(auto_per_round):.3f})"
                if auto_per_round else ""), "",
             "| policy | compressed | runs | step s | step s predicted | predicted / measured "
             "| exposed s measured | exposed s predicted | delay s predicted "
             "| step vs best fixed |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        me, pr = r.get("measured_exposed_s"), r.get("predicted_exposed_s")
        ps = r.get("predicted_step_s")
        vs = f"{r['step_s'] / best_fixed:.2f}x" if best_fixed and r["step_s"] else "-"
        ratio = f"{ps / r['step_s']:.2f}" if ps and r["step_s"] else "-"
        runs = ", ".join(f"{x:.3f}" if x else "failed" for x in r["step_s_runs"])
        lines.append(f"| {r['policy']} | {r.get('compressed', '-')}/{len(grads)} | {runs} | "
                     f"{r['step_s']:.3f} | {ps:.3f} | {ratio} | {me:.3f} | {pr:.3f} | "
                     f"{r['predicted_delay_s']:.3f} | {vs} |"
                     if r["step_s"] and me is not None and ps is not None else
                     f"| {r['policy']} | failed (exit {r['rc']}) | {runs} | | | | | | | |")
    text = "\n".join(lines)
    (out / f"{tag}.md").write_text(text + "\n")
    print(text)
    return 0 if all(r["rc"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
