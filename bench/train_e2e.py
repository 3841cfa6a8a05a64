r"""End-to-end training throughput (images/s) on an emulated cluster: HiPress vs DDP and MPI.

Trains the same model on the same synthetic problem with every system, in one invocation,
each system as its own ``mpirun`` job on the emulated cluster of
:mod:`hipress.testing.emucluster` (N hosts, one rank per host, ``tbf``-shaped links; root
required) or, with ``--local``, on this machine (``mpirun -np N --oversubscribe``):

- ``ddp-noop``: PyTorch DDP over gloo with a hook that returns each bucket unchanged: no
  synchronization at all, the **compute floor**;
- ``ddp-allreduce`` (DDP's default), ``ddp-fp16`` (``fp16_compress_hook``),
  ``ddp-powersgd1`` (``powerSGD_hook``, rank 1, one DDP bucket: with several buckets its
  gloo collectives ran in different orders on different ranks and the job aborted);
- ``mpi-allreduce``: Horovod-style; all gradients flattened into one buffer after backward,
  one ``MPI.Allreduce`` (mpi4py), averaged, copied back;
- ``hipress-none``: ``hipress.torch.DistributedOptimizer(compression="none")``;
- ``hipress-<strategy>-<codec>``: HiPress with each codec under ``sync.strategy`` ps and
  ring; codecs that cannot run under a strategy take another path (gather, compressed
  allreduce), which the row records (``path``, from ``hipress.stats()``);
- with ``--tf``: Keras ResNet-50 with ``model.fit``: ``tf-floor`` (each rank trains alone),
  ``tf-hipress-none`` and ``tf-hipress-<strategy>-<codec>``.

The per-rank script is ``bench/train_e2e_worker.py`` (its docstring defines the per-step
measurements). Images/s = world x batch / (median step time of the slowest rank).

Usage (root, repository root, virtual environment active; see bench/README.md)::

    python bench/train_e2e.py                                   # the full benchmark
    python bench/train_e2e.py --models resnet50 --codecs onebit --strategies ps \
        --iters 1 --warmup 1 --image-size 32                   # a small check
    python bench/train_e2e.py --local --np 2 --models resnet50 --codecs onebit
    python bench/train_e2e.py --tf --no-torch --tf-codecs none,onebit --iters 2
    python bench/train_e2e.py --models vgg19 --baselines ddp-powersgd1 \
        --codecs onebit --strategies ps --repeats 3             # medians of 3 rounds
    python bench/train_e2e.py --dry-run                         # print the commands

Machine speed drifts by 5-20 % between jobs minutes apart. With ``--repeats R`` every
job runs R times in rounds (all jobs, then all again in the reverse order, then forward
again...: the job that ran right after the compute floor ran slowest in every round of
2026-12-07's runs, and alternating the order gives no job a fixed place), each row
reports the median images/s over the rounds with the lowest and highest, and each "vs"
ratio is the median of the R ratios measured within one round (both jobs minutes apart,
not a round apart), with their range.

Writes ``<out>/train_e2e.json`` (every row; with ``--repeats``, ``runs`` holds each
round's rows), ``train_e2e.md`` (the table),
``train_e2e.png`` (images/s per system and model, compute floor as a line) and
``train_e2e.log`` (everything the jobs printed).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
from cluster import HOROVOD_RING, loadavg, mpirun_path, run_job  # noqa: E402

WORKER = ROOT / "bench" / "train_e2e_worker.py"
DDP_HOOKS = ("noop", "allreduce", "fp16", "powersgd1")
DEFAULT_BASELINES = "ddp-noop,ddp-allreduce,ddp-fp16,ddp-powersgd1,mpi-allreduce,hipress-none"
#: rows every other row of the same framework is compared with (label -> column title)
PEERS = {"torch": {"ddp-allreduce": "vs DDP allreduce", "ddp-fp16": "vs DDP fp16",
                   "ddp-powersgd1": "vs DDP PowerSGD", "mpi-allreduce": "vs mpi-allreduce"},
         "tf": {"tf-hipress-none": "vs HiPress none"}}
FLOOR = {"torch": "ddp-noop", "tf": "tf-floor"}


def csv(text: str) -> List[str]:
    """Split a comma-separated flag value, dropping empty items."""
    return [x.strip() for x in (text or "").split(",") if x.strip()]


def parse(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parse the command line (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hosts", type=int, default=4, help="emulated hosts, one rank each")
    p.add_argument("--np", type=int, default=None, help="ranks with --local (default --hosts)")
    p.add_argument("--local", action="store_true",
                   help="run on localhost (mpirun --oversubscribe), no emulated cluster, no root")
    p.add_argument("--rates", default="1gbit", help="link rates, comma-separated (1gbit,10gbit)")
    p.add_argument("--queue-ms", type=float, default=50.0, help="tbf queue bound (not a delay)")
    p.add_argument("--models", default="resnet50,vgg19",
                   help="PyTorch models of examples/torch/models.py (resnet50, vgg19, "
                        "bert-base: its rows' images/s are sequences/s)")
    p.add_argument("--baselines", default=DEFAULT_BASELINES,
                   help="baseline systems ('' for none; ddp-noop, the compute floor, always runs)")
    p.add_argument("--codecs", default="onebit,tbq,terngrad,dgc,graddrop,powersgd",
                   help="HiPress codecs ('' for none)")
    p.add_argument("--strategies", default="ps,ring", help="HiPress sync.strategy values")
    p.add_argument("--transports", default="mpi",
                   help="HiPress transports: mpi, torch (gloo, rows labelled @torch) or both")
    p.add_argument("--ompi-ring", action="store_true",
                   help="force Open MPI's ring allreduce in the mpi-allreduce job")
    p.add_argument("--variants", default="",
                   help="extra HiPress configurations, each run for every codec and strategy "
                   "as a row labelled <row>[NAME]: 'NAME:KEY=VALUE,KEY=VALUE;NAME2:...' "
                   "(dotted config keys, e.g. 'cyc5:sync.cycle_time_ms=5')")
    p.add_argument("--no-torch", action="store_true", help="skip the PyTorch jobs")
    p.add_argument("--tf", action="store_true", help="also run the TensorFlow jobs")
    p.add_argument("--tf-codecs", default="none,onebit,terngrad",
                   help="HiPress codecs of the TensorFlow jobs")
    p.add_argument("--batch-size", type=int, default=8,
                   help="images (bert-base: sequences) per rank per step")
    p.add_argument("--image-size", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=64, help="tokens per sequence (bert-base)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    p.add_argument("--iters", type=int, default=5, help="timed steps (median reported)")
    p.add_argument("--repeats", type=int, default=1,
                   help="run every job this many times, in rounds (all jobs, then all again "
                   "in the reverse order, alternating): "
                   "a row reports the median over rounds and their range, and each ratio is "
                   "the median of the ratios measured within one round")
    p.add_argument("--torch-threads", type=int, default=0,
                   help="torch.set_num_threads in every job (TF: intra-op threads) and "
                   "OMP_NUM_THREADS; 0 = leave the library default")
    p.add_argument("--job-timeout", type=float, default=600.0,
                   help="seconds before a job is killed (its row records rc 124)")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "train-e2e"))
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--dry-run", action="store_true", help="print the commands and exit")
    return p.parse_args(argv)


# ----------------------------------------------------------------------------- jobs
def parse_variants(text: str) -> List[Any]:
    """Parse ``--variants``: ``'NAME:KEY=VALUE,KEY=VALUE;NAME2:KEY=VALUE'``.

    Returns:
        [(row suffix ``[NAME]``, [``KEY=VALUE``, ...]), ...] in the given order.

    Raises:
        SystemExit: an entry has no name, no setting, or a setting without ``=``.
    """
    out = []
    for entry in [e.strip() for e in (text or "").split(";") if e.strip()]:
        name, sep, body = entry.partition(":")
        sets = csv(body)
        if not sep or not name.strip() or not sets or any("=" not in x for x in sets):
            raise SystemExit(f"--variants: {entry!r} is not NAME:KEY=VALUE[,KEY=VALUE...] "
                             "(e.g. 'cyc5:sync.cycle_time_ms=5')")
        out.append((f"[{name.strip()}]", sets))
    return out


def plan_jobs(args: argparse.Namespace) -> List[Dict[str, Any]]:
    """Return the jobs of one link rate: one dict per system, model and framework.

    Each job has ``framework``, ``model``, ``label`` (the system's row name), ``system``,
    ``codec``, ``strategy`` (asked for; HiPress rows only) and ``worker`` (the worker's
    arguments).
    """
    common = ["--batch-size", str(args.batch_size), "--image-size", str(args.image_size),
              "--seq-len", str(args.seq_len),
              "--warmup", str(args.warmup), "--iters", str(args.iters),
              "--torch-threads", str(args.torch_threads)]
    baselines = csv(args.baselines)
    unknown = [b for b in baselines
               if b not in ("mpi-allreduce", "hipress-none") + tuple(f"ddp-{h}" for h in DDP_HOOKS)]
    if unknown:
        raise SystemExit(f"--baselines: unknown {unknown}; choose from {DEFAULT_BASELINES}")
    jobs: List[Dict[str, Any]] = []

    def add(framework: str, model: str, label: str, system: str, codec: str = "",
            strategy: str = "", hook: str = "", transport: str = "mpi",
            sets: Sequence[str] = ()) -> None:
        w = ["--system", system, "--model", model, *common]
        for item in sets:
            w += ["--set", item]
        if hook:
            w += ["--hook", hook]
        if transport != "mpi":
            w += ["--transport", transport]
        if system in ("hipress", "tf-hipress"):
            w += ["--codec", codec, "--strategy", strategy]
        jobs.append({"framework": framework, "model": model, "label": label, "system": system,
                     "codec": codec or hook or "none", "strategy": strategy, "worker": w})

    strategies = csv(args.strategies) or ["ps"]
    variants = [("", [])] + parse_variants(args.variants)
    if not args.no_torch:
        for model in csv(args.models):
            add("torch", model, "ddp-noop", "ddp", hook="noop")
            for hook in DDP_HOOKS[1:]:
                if f"ddp-{hook}" in baselines:
                    add("torch", model, f"ddp-{hook}", "ddp", hook=hook)
            if "mpi-allreduce" in baselines:
                add("torch", model, "mpi-allreduce", "mpi-allreduce")
            for tx in csv(args.transports) or ["mpi"]:
                at = "" if tx == "mpi" else f"@{tx}"
                if "hipress-none" in baselines:
                    add("torch", model, f"hipress-none{at}", "hipress", "none", strategies[0],
                        transport=tx)
                for codec in csv(args.codecs):
                    for strategy in strategies:
                        for vname, sets in variants:
                            add("torch", model, f"hipress-{strategy}-{codec}{at}{vname}",
                                "hipress", codec, strategy, transport=tx, sets=sets)
    if args.tf:
        add("tf", "resnet50", "tf-floor", "tf-floor")
        for codec in csv(args.tf_codecs):
            if codec == "none":
                add("tf", "resnet50", "tf-hipress-none", "tf-hipress", "none", strategies[0])
                continue
            for strategy in strategies:
                add("tf", "resnet50", f"tf-hipress-{strategy}-{codec}", "tf-hipress", codec,
                    strategy)
    return jobs


def job_command(job: Dict[str, Any], args: argparse.Namespace, hosts: Optional[str],
                master: str, prefix: Path) -> List[str]:
    """Return the ``mpirun`` command line of one job.

    Args:
        job: one entry of :func:`plan_jobs`.
        args: parsed command line.
        hosts: ``-H`` value of the emulated cluster, or None for a local job.
        master: DDP rendezvous ``host:port`` (host 1 of the cluster, or 127.0.0.1).
        prefix: the worker's ``--json`` prefix.
    """
    n = args.hosts if hosts else (args.np or args.hosts)
    cmd = [mpirun_path(), "-np", str(n)]
    cmd += ["-H", hosts] if hosts else ["--oversubscribe"]
    cmd += ["--bind-to", "none", "--map-by", "slot", "--tag-output", "-x", "PYTHONUNBUFFERED",
            "-x", "TF_CPP_MIN_LOG_LEVEL"]
    if args.torch_threads > 0:
        cmd += ["-x", "OMP_NUM_THREADS"]
    if job["system"] == "mpi-allreduce" and args.ompi_ring:
        cmd += list(HOROVOD_RING)
    worker = list(job["worker"])
    if job["system"] == "ddp" or "--transport" in worker:
        worker += ["--master", master]
    return cmd + [sys.executable, str(WORKER), *worker, "--json", str(prefix)]


# ----------------------------------------------------------------------------- rows
def _median(xs: Sequence[float]) -> Optional[float]:
    return float(statistics.median(xs)) if xs else None


def _mean(xs: Sequence[float]) -> Optional[float]:
    return float(statistics.fmean(xs)) if xs else None


def summarize(job: Dict[str, Any], ranks: List[Dict[str, Any]]) -> Dict[str, Any]:
    """Turn the per-rank results of one job into its row.

    Wall times are per-rank medians over the timed steps; ``step_s`` is the slowest rank's,
    the breakdown (compute, step(), CPU times) the mean over ranks of the per-rank medians
    (CPU times: per-rank means, ``/proc`` counts in clock ticks of 10 ms).
    """
    per_rank = []
    for r in ranks:
        timed = r["steps"][r["warmup_used"]:]
        per_rank.append({
            "rank": r["rank"], "host": r["host"],
            "step_s": _median([s["step_s"] for s in timed]),
            "compute_s": _median([s["compute_s"] for s in timed if "compute_s" in s]),
            "step_call_s": _median([s["step_call_s"] for s in timed if "step_call_s" in s]),
            "engine_cpu_s": _mean([s["engine_cpu_s"] for s in timed]),
            "cpu_s": _mean([s["cpu_s"] for s in timed]),
            "gc_s": _mean([s["gc_s"] for s in timed if "gc_s" in s]),
            "fault_mib": _mean([s["fault_mib"] for s in timed if "fault_mib" in s]),
            "update_s": r.get("update_s"), "loss": r.get("loss"),
        })
    world = ranks[0]["world"]
    step = max(p["step_s"] for p in per_rank)

    def avg(key: str) -> Optional[float]:
        vals = [p[key] for p in per_rank if p[key] is not None]
        return _mean(vals) if vals else None

    row = {"step_s": step, "images_per_s": world * ranks[0]["batch_size"] / step,
           "world": world, "compute_s": avg("compute_s"), "step_call_s": avg("step_call_s"),
           "update_s": avg("update_s"), "engine_cpu_s": avg("engine_cpu_s"),
           "cpu_s": avg("cpu_s"), "gc_s": avg("gc_s"), "fault_mib": avg("fault_mib"),
           "threads": ranks[0]["threads"],
           "warmup_used": ranks[0]["warmup_used"], "per_rank": per_rank,
           "hosts": sorted({r["host"] for r in ranks})}
    if row["step_call_s"] is not None and row["update_s"] is not None:
        row["exposed_sync_s"] = max(row["step_call_s"] - row["update_s"], 0.0)
    if row["cpu_s"] is not None:
        row["cpu_bound_step_s"] = cpu_bound_step(world, row["cpu_s"])
    r0 = ranks[0]
    if "paths" in r0:
        paths = dict(r0["paths"])
        other = {k: v for k, v in paths.items() if k != "fused"}
        row.update(paths=paths, path="+".join(sorted(other)) or "fused",
                   codecs_used=r0.get("codecs"), compression_ratio=r0.get("compression_ratio"),
                   bytes_sent_per_step=r0.get("bytes_sent_per_step"))
    return row


def cpu_bound_step(world: int, cpu_s: float, cpus: Optional[int] = None) -> float:
    """Return the step time the ranks' CPU alone needs: ``world * cpu_s / cpus``.

    Every rank of the emulated cluster (and of ``--local``) runs on this machine's
    ``cpus`` (default ``os.cpu_count()``), so a step cannot be shorter than all ranks'
    CPU seconds per step spread over them. A step near this figure is CPU-bound: what a
    system spends on the CPU, not on the wire, sets its speed.
    """
    return world * cpu_s / float(cpus or os.cpu_count() or 1)


def annotate(rows: List[Dict[str, Any]]) -> None:
    """Add ``x_floor`` and ``vs`` (ratio of images/s to each peer) to every measured row.

    Rows are compared within their round (``repeat``): a ratio never mixes rounds.
    """
    groups: Dict[tuple, List[Dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["framework"], r["model"], r["rate"], r.get("repeat", 1)),
                          []).append(r)
    for (framework, _, _, _), grp in groups.items():
        ips = {r["label"]: r.get("images_per_s") for r in grp if r.get("images_per_s")}
        floor = ips.get(FLOOR[framework])
        for r in grp:
            if not r.get("images_per_s"):
                continue
            r["floor_images_per_s"] = floor
            r["x_floor"] = r["images_per_s"] / floor if floor else None
            r["vs"] = {p: r["images_per_s"] / ips[p] for p in PEERS[framework]
                       if p in ips and p != r["label"]}
            fl = next((x for x in grp if x["label"] == FLOOR[framework]
                       and x.get("step_s")), None)
            r["overhead_vs_floor_s"] = r["step_s"] - fl["step_s"] if fl else None


#: figures of a combined row that are medians over its rounds
_MEDIAN_KEYS = ("step_s", "compute_s", "step_call_s", "update_s", "exposed_sync_s",
                "overhead_vs_floor_s", "engine_cpu_s", "cpu_s", "cpu_bound_step_s", "gc_s",
                "fault_mib", "x_floor")


def combine(runs: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Combine the rows of several rounds (``--repeats``) into one row per system.

    Args:
        runs: every round's rows, annotated (:func:`annotate`), each with ``repeat``.

    Returns:
        One row per (framework, model, rate, label), in first-round order: the job's
        fields, ``images_per_s`` the median over the rounds that produced figures with
        ``images_per_s_range`` (lowest, highest), ``vs`` the median of each peer's
        within-round ratios with ``vs_range``, the breakdown figures (``step_s`` ...) as
        medians, ``repeats`` the rounds with figures, ``rc`` the first nonzero exit code
        (else 0) and ``load`` the highest 1-minute load seen at a job's start. A system
        that failed in every round keeps the first failure's ``log_tail``.
    """
    groups: Dict[tuple, List[Dict[str, Any]]] = {}
    for r in runs:
        groups.setdefault((r["framework"], r["model"], r["rate"], r["label"]), []).append(r)
    out = []
    for grp in groups.values():
        ok = [r for r in grp if r.get("images_per_s")]
        first = grp[0]
        row = {k: first[k] for k in ("framework", "model", "label", "system", "codec",
                                     "strategy", "rate")}
        row["rc"] = next((r["rc"] for r in grp if r["rc"] != 0), 0)
        row["load"] = [max(r["load"][0] for r in grp)] + list(first["load"][1:])
        row["repeats"] = len(ok)
        if not ok:
            row["log_tail"] = first.get("log_tail", [])
            out.append(row)
            continue
        ips = [r["images_per_s"] for r in ok]
        row["images_per_s"] = _median(ips)
        row["images_per_s_range"] = [min(ips), max(ips)]
        for k in _MEDIAN_KEYS:
            vals = [r[k] for r in ok if r.get(k) is not None]
            row[k] = _median(vals)
        for k in ("path", "paths", "threads", "codecs_used", "compression_ratio",
                  "bytes_sent_per_step", "world"):
            if k in ok[0]:
                row[k] = ok[0][k]
        ratios = {p: [r["vs"][p] for r in ok if p in r.get("vs", {})]
                  for p in sorted({p for r in ok for p in r.get("vs", {})})}
        row["vs"] = {p: _median(v) for p, v in ratios.items()}
        row["vs_range"] = {p: [min(v), max(v)] for p, v in ratios.items()}
        out.append(row)
    return out


def fmt(x: Optional[float], spec: str = ".3f", suffix: str = "") -> str:
    """Format a number, or '-' for None."""
    return "-" if x is None else f"{x:{spec}}{suffix}"


def table(rows: List[Dict[str, Any]]) -> str:
    """Return the Markdown table of every row, failed jobs included."""
    present = {r["framework"] for r in rows}
    peers = [t for fw in ("torch", "tf") if fw in present for t in PEERS[fw].items()]
    head = (["model", "link", "system", "codec", "strategy", "path", "images/s", "x floor"]
            + [t for _, t in peers]
            + ["step s", "compute s", "step() s", "update s", "exposed sync s",
               "over floor s", "engine CPU s/step", "CPU s/step", "CPU-bound step s",
               "GC s/step",
               "faulted MiB/step", "load 1m",
               "threads", "rc"])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        vs = r.get("vs", {})
        model = r["model"] if r["framework"] == "torch" else f"{r['model']} (tf)"
        cells = [model, r["rate"], r["label"], r["codec"], r.get("strategy") or "-",
                 r.get("path", "-"), _with_range(r.get("images_per_s"),
                                                 r.get("images_per_s_range"), ".2f"),
                 fmt(r.get("x_floor"), ".2f")]
        cells += [_with_range(vs.get(p), r.get("vs_range", {}).get(p), ".2f", "x")
                  for p, _ in peers]
        cells += [fmt(r.get(k)) for k in ("step_s", "compute_s", "step_call_s", "update_s",
                                          "exposed_sync_s", "overhead_vs_floor_s",
                                          "engine_cpu_s", "cpu_s", "cpu_bound_step_s",
                                          "gc_s")]
        cells.append(fmt(r.get("fault_mib"), ".0f"))
        cells += [fmt(r["load"][0], ".2f"), str(r.get("threads", "-")), str(r["rc"])]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _with_range(x: Optional[float], rng: Optional[Sequence[float]], spec: str,
                suffix: str = "") -> str:
    """Format a median with its (lowest-highest) range when rounds give one."""
    if x is None or not rng:
        return fmt(x, spec, suffix)
    return f"{x:{spec}}{suffix} ({rng[0]:{spec}}-{rng[1]:{spec}})"


def failures(rows: List[Dict[str, Any]]) -> str:
    """Return the failed jobs with the tail of their output (Markdown)."""
    out = []
    for r in rows:
        if r.get("images_per_s") is None:
            out += [f"- {r['model']} {r['rate']} {r['label']}: exit {r['rc']}", "", "```",
                    *r.get("log_tail", []), "```", ""]
    return "\n".join(out)


COLUMNS = """\
Columns: images/s = world x batch / median step time of the slowest rank; x floor =
images/s / the compute floor's (ddp-noop; tf-floor for TensorFlow); vs X = images/s / X's
(>1: faster than X); step s = that median step; compute s = zero_grad + forward + backward
(DDP's gradient sync runs inside backward, so DDP rows show it here); step() s = from
backward's return to the end of the update (optimizer.step(); mpi-allreduce: flatten +
Allreduce + copy back + update); update s = a plain SGD step on the same parameters;
exposed sync s = step() - update; over floor s = step s - the floor's step s; engine CPU
= CPU s per step of the threads named hipress*; CPU = process CPU s per step; CPU-bound
step = world x CPU s/step / this machine's CPUs (every rank runs on them: a step near it
is set by CPU, not by the wire); GC = wall s
per step in Python's cyclic garbage collector (any thread); faulted MiB = memory faulted
into the process per step (minor page faults x page size); load 1m = 1-minute load average
when the job started. Breakdown figures are means over ranks of per-rank medians (CPU, GC,
faults: means)."""


def rounds_table(runs: List[Dict[str, Any]]) -> str:
    """Return a Markdown table of images/s per system and round (``--repeats``)."""
    reps = sorted({r.get("repeat", 1) for r in runs})
    cells: Dict[tuple, Dict[int, str]] = {}
    for r in runs:
        key = (r["model"] if r["framework"] == "torch" else f"{r['model']} (tf)", r["rate"],
               r["label"])
        cells.setdefault(key, {})[r.get("repeat", 1)] = fmt(r.get("images_per_s"), ".2f")
    head = ["model", "link", "system"] + [f"round {k}" for k in reps]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for key, by in cells.items():
        lines.append("| " + " | ".join(list(key) + [by.get(k, "-") for k in reps]) + " |")
    return "\n".join(lines)


def write(out: Path, meta: Dict[str, Any], rows: List[Dict[str, Any]], plot: bool,
          runs: Optional[List[Dict[str, Any]]] = None) -> bool:
    """Write train_e2e.json, train_e2e.md and (unless ``plot`` is False) train_e2e.png.

    Args:
        out: the output directory.
        meta: the run's settings.
        rows: the rows of the table (with ``--repeats``, :func:`combine`'s).
        plot: draw the PNG.
        runs: with ``--repeats``, every round's rows (written to the JSON as ``runs``,
            and as a table of images/s per round).

    Returns:
        True if the PNG was written (False without ``plot`` or without matplotlib).
    """
    doc: Dict[str, Any] = {"meta": meta, "rows": rows}
    if runs is not None:
        doc["runs"] = runs
    (out / "train_e2e.json").write_text(json.dumps(doc, indent=1))
    threads = sorted({str(r.get("threads")) for r in rows if r.get("threads") is not None})
    text = ["# End-to-end training throughput", "",
            f"Run: `python bench/train_e2e.py {shlex.join(meta['argv'])}` at {meta['started']} "
            f"({meta['mode']}); load average at start {meta['load_at_start']} on "
            f"{meta['cpus']} CPUs; batch {meta['batch_size']} per rank, images "
            f"{meta['image_size']}x{meta['image_size']} (bert-base: sequences of "
            f"{meta.get('seq_len', 64)} tokens); torch threads: "
            f"{meta['torch_threads_setting']} (get_num_threads in the workers: "
            f"{', '.join(threads) or '-'}).", "", table(rows), "", COLUMNS, ""]
    if runs is not None:
        text += [f"With --repeats {meta.get('repeats')}: images/s is the median over the "
                 "rounds (lowest-highest); each vs X is the median of the ratios measured "
                 "within one round (lowest-highest); the other figures are medians over the "
                 "rounds; load 1m is the highest at a job's start.", "",
                 "## Images/s per round", "", rounds_table(runs), ""]
    fail = failures(rows)
    if fail:
        text += ["## Failed jobs", "", fail]
    (out / "train_e2e.md").write_text("\n".join(text) + "\n")
    if not plot:
        return False
    try:
        plot_rows(rows, out / "train_e2e.png")
    except ImportError as exc:
        print(f"!! no plot ({exc}); pip install matplotlib", flush=True)
        return False
    return True


def plot_rows(rows: List[Dict[str, Any]], path: Path) -> None:
    """Bar chart of images/s per system, one panel per framework/model/link rate.

    The compute floor is drawn as a dashed line; failed jobs get an empty bar marked 'x'.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels: Dict[tuple, List[Dict[str, Any]]] = {}
    for r in rows:
        panels.setdefault((r["framework"], r["model"], r["rate"]), []).append(r)
    if not panels:
        return
    fig, axes = plt.subplots(len(panels), 1, figsize=(max(8, 0.55 * max(map(len, panels.values()))
                                                          + 2), 4 * len(panels)), squeeze=False)
    for ax, ((framework, model, rate), grp) in zip(axes[:, 0], panels.items()):
        labels = [r["label"] for r in grp]
        vals = [r.get("images_per_s") or 0.0 for r in grp]
        colors = ["tab:gray" if r["label"] == FLOOR[framework] else
                  "tab:orange" if "hipress" in r["label"] else "tab:blue" for r in grp]
        bars = ax.bar(range(len(grp)), vals, color=colors)
        for b, r in zip(bars, grp):
            txt = "x" if r.get("images_per_s") is None else f"{r['images_per_s']:.1f}"
            ax.annotate(txt, (b.get_x() + b.get_width() / 2, b.get_height()),
                        ha="center", va="bottom", fontsize=7)
        floor = next((r.get("images_per_s") for r in grp if r["label"] == FLOOR[framework]),
                     None)
        if floor:
            ax.axhline(floor, ls="--", color="k", lw=1, label=f"compute floor {floor:.1f}")
            ax.legend(loc="upper right", fontsize=8)
        ax.set_xticks(range(len(grp)))
        ax.set_xticklabels(labels, rotation=45, ha="right", fontsize=8)
        ax.set_ylabel("images/s (all ranks)")
        ax.set_title(f"{model} ({framework}), {rate}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ----------------------------------------------------------------------------- driver
def round_order(jobs: Sequence[Dict[str, Any]], repeat: int) -> List[Tuple[int, Dict[str, Any]]]:
    """Return ``(index, job)`` pairs in the order round ``repeat`` (from 1) runs them.

    Odd rounds run the jobs as planned, even rounds in the reverse order (ABBA
    counterbalancing): a job's mean place over two rounds is the middle, so neither a
    drift of the machine during a round nor the job it follows favours any system.
    ``index`` is the job's place in ``jobs`` (its rendezvous port).
    """
    order = list(enumerate(jobs))
    return order[::-1] if repeat % 2 == 0 else order


def run_rate(args: argparse.Namespace, rate: str, jobs: List[Dict[str, Any]], out: Path,
             hosts: Optional[str], master_host: str, env: Dict[str, str],
             rows: List[Dict[str, Any]], meta: Dict[str, Any], repeat: int = 1) -> None:
    """Run every job at one link rate; append a row per job to ``rows``.

    ``repeat`` numbers the round (``--repeats``): it is recorded in each row and, with
    more than one round, in the job's file names (``-r<repeat>``).
    """
    jobdir = out / "jobs"
    jobdir.mkdir(exist_ok=True)
    n = args.hosts if hosts else (args.np or args.hosts)
    for k, job in round_order(jobs, repeat):
        tag = f"{job['framework']}-{job['model']}-{job['label']}-{rate}"
        if args.repeats > 1:
            tag += f"-r{repeat}"
        prefix = jobdir / tag
        for old in jobdir.glob(f"{tag}.rank*.json"):
            old.unlink()
        # a fresh rendezvous port per job and round (a port just closed may linger)
        port = 29600 + (k + (repeat - 1) * len(jobs)) % 300
        cmd = job_command(job, args, hosts, f"{master_host}:{port}", prefix)
        before = loadavg()
        print(f"=== {tag}: load {before}", flush=True)
        t0 = time.time()
        rc, lines = run_job(cmd, env, args.job_timeout, out / "train_e2e.log")
        row = {k2: job[k2] for k2 in ("framework", "model", "label", "system", "codec",
                                      "strategy")}
        row.update(rate=rate, repeat=repeat, load=before, load_after=loadavg(), rc=rc,
                   wall_s=round(time.time() - t0, 1), command=cmd)
        files = [Path(f"{prefix}.rank{r}.json") for r in range(n)]
        if all(f.exists() for f in files):
            try:
                row.update(summarize(job, [json.loads(f.read_text()) for f in files]))
            except (ValueError, KeyError, TypeError) as exc:
                row["error"] = f"bad worker output: {exc!r}"
        if row.get("images_per_s") is None:
            # printable text only: a rank killed mid-write leaves NUL bytes in the stream
            row["log_tail"] = ["".join(c for c in ln if c.isprintable() or c == "\t")
                               for ln in lines[-25:]]
            print(f"!! {tag} failed (exit {rc}); row recorded without figures", flush=True)
        elif rc != 0:
            print(f"!! {tag} exited {rc} after writing its results; figures kept", flush=True)
        rows.append(row)
        annotate(rows)
        # partial results survive a later failure
        if args.repeats > 1:
            write(out, meta, combine(rows), plot=False, runs=rows)
        else:
            write(out, meta, rows, plot=False)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the benchmark; return 0 when every job produced figures, 1 otherwise."""
    args = parse(argv)
    if args.repeats < 1:
        raise SystemExit(f"--repeats must be >= 1, got {args.repeats}")
    jobs = plan_jobs(args)
    if os.geteuid() == 0:
        os.environ.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
        os.environ.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    os.environ["PYTHONUNBUFFERED"] = "1"
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if args.torch_threads > 0:
        os.environ["OMP_NUM_THREADS"] = str(args.torch_threads)
    threads = str(args.torch_threads) if args.torch_threads > 0 else "library default"
    rates = ["local"] if args.local else csv(args.rates)
    out = Path(args.out)
    print(f"train_e2e: {len(jobs)} jobs per rate, rates {rates}, torch threads {threads}",
          flush=True)
    if args.dry_run:
        for rate in rates:
            hosts = None if args.local else ",".join(f"<host{i + 1}>:1" for i in range(args.hosts))
            for k, job in enumerate(jobs):
                master = "127.0.0.1" if args.local else "<host1>"
                print(f"# {job['framework']} {job['model']} {job['label']} at {rate}")
                tag = f"{job['framework']}-{job['model']}-{job['label']}-{rate}"
                print(shlex.join(job_command(job, args, hosts, f"{master}:{29600 + k % 300}",
                                             out / "jobs" / tag)))
        return 0
    out.mkdir(parents=True, exist_ok=True)
    meta = {"started": datetime.datetime.now().isoformat(timespec="seconds"),
            "argv": sys.argv[1:] if argv is None else list(argv),
            "mode": "local" if args.local else f"emulated cluster, {args.hosts} hosts",
            "cpus": os.cpu_count(), "load_at_start": loadavg(),
            "batch_size": args.batch_size, "image_size": args.image_size,
            "seq_len": args.seq_len, "warmup": args.warmup, "iters": args.iters,
            "repeats": args.repeats,
            "torch_threads_setting": threads,
            "queue_ms": args.queue_ms, "hipress_env": {k: v for k, v in os.environ.items()
                                                       if k.startswith("HIPRESS_")}}
    with open(out / "train_e2e.log", "w") as fh:
        fh.write(f"bench/train_e2e.py {shlex.join(meta['argv'])}  ({meta['started']})\n")
    rows: List[Dict[str, Any]] = []
    if args.local:
        for rep in range(1, args.repeats + 1):
            run_rate(args, "local", jobs, out, None, "127.0.0.1", dict(os.environ), rows, meta,
                     rep)
    else:
        from hipress.testing.emucluster import EmulatedCluster, namespaces_unavailable

        reason = namespaces_unavailable()
        if reason is not None:
            print(f"cannot build the emulated cluster: {reason} (try --local)", file=sys.stderr)
            return 2
        for rate in rates:
            with EmulatedCluster(args.hosts, rate=rate, queue_ms=args.queue_ms) as cluster:
                print(f"=== {cluster!r}; load {loadavg()}", flush=True)
                for rep in range(1, args.repeats + 1):
                    run_rate(args, rate, jobs, out, cluster.hosts_arg(), cluster.hosts[0],
                             cluster.env(os.environ), rows, meta, rep)
    meta["load_at_end"] = loadavg()
    runs = rows if args.repeats > 1 else None
    if runs is not None:
        rows = combine(runs)
    plotted = write(out, meta, rows, plot=not args.no_plot, runs=runs)
    print(table(rows))
    print(f"wrote {out / 'train_e2e.json'}, {out / 'train_e2e.md'}, "
          + (f"{out / 'train_e2e.png'}, " if plotted else "") + f"{out / 'train_e2e.log'}")
    return 0 if all(r.get("images_per_s") is not None for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
