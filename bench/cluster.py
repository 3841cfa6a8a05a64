r"""Gradient sync on an emulated 4-host cluster: HiPress vs Horovod, DDP, GRACE and BytePS.

Builds an emulated cluster (:mod:`hipress.testing.emucluster`: one network namespace per
host, every link shaped with ``tbf``; root required) for each link rate and measures,
in one run, per-iteration synchronization of the gradient sets of ResNet-50, VGG-19 and
BERT-base (shapes from ``hipress/data/gradients``), one rank per emulated host:

- ``horovod``: uncompressed MPI allreduce of fused 64 MiB buckets;
- ``ddp``: PyTorch DDP over gloo with the ``allreduce``, ``fp16`` and PowerSGD rank 1
  and 4 communication hooks (a module whose parameters have the gradient set's shapes;
  the backward pass just writes each gradient), minus a no-op-hook run (DDP's own
  backward and bucketing cost) so that the figure is the synchronization alone;
- ``grace``: compress -> allgather -> decompress each -> sum, per tensor;
- ``byteps``: non-pipelined parameter server, decode-sum-re-encode per tensor;
- ``hipress-ps`` / ``hipress-ring``: CaSync-PS / CaSync-Ring per codec (codecs that
  cannot be merged run on the engine's gather or compressed-allreduce path);
- with ``--training``: end-to-end images/s of the synthetic-data CNN benchmark
  (``examples/torch/synthetic_benchmark.py``) launched through ``hipressrun -H``.

The MPI rows come from ``bench/sync.py`` (launched with ``--mpi-args -H <hosts>`` and the
cluster's ``PRTE_MCA_*``/``OMPI_MCA_*`` environment); the DDP rows from this file's
``--ddp-worker`` mode under ``mpirun`` onto the same hosts.

Wire floor (``floor_s``): the bytes the busiest host must send under the row's strategy
and codec, divided by the link rate (payload bytes only: TCP/IP/Ethernet headers add
about 4.5 % at MTU 1500). With N hosts, raw float32 bytes B and payload bytes C:

- ring allreduce (horovod, DDP allreduce/fp16/PowerSGD, HiPress ``fused`` and
  ``allreduce`` paths, CaSync-Ring): 2(N-1)/N x bytes (fp16: B/2; PowerSGD: P and Q
  factors of the compressed matrices plus the uncompressed vectors);
- allgather (GRACE, HiPress ``gather`` path for DGC/GradDrop): (N-1) x C;
- parameter server (BytePS: server of tensor i is i mod N; CaSync-PS: partitions of
  ``sync.partition_bytes`` assigned round-robin): a host sends C_t for every tensor it
  does not serve and (N-1) x C_t for every one it serves; the floor takes the busiest
  host (2(N-1)/N x C when perfectly balanced).

HiPress rows follow the engine's defaults: tensors under ``compression.min_compress_bytes``
go uncompressed in fused buffers. For variable-size codecs (DGC, GradDrop) C is the
codec's payload bound (``payload_nbytes``), which can exceed the typical payload.

Usage (root; see bench/README.md)::

    python bench/cluster.py --rates 1gbit --models resnet50,vgg19 \
        --systems horovod,grace,byteps,hipress-ps,hipress-ring --codecs onebit,dgc \
        --ddp allreduce,fp16,powersgd1,powersgd4 --iters 2 --warmup 1
    python bench/cluster.py --floors-only --models vgg19 --codecs onebit   # no cluster

Writes ``<out>/cluster.json``, ``<out>/cluster.md`` (the table) and ``<out>/cluster.png``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

DDP_HOOKS = ("noop", "allreduce", "fp16", "powersgd1", "powersgd4")
BASELINE_SYSTEMS = ("horovod", "ddp", "grace", "byteps")
UNCOMPRESSED_BASELINES = {("horovod", "none"), ("ddp", "allreduce")}
#: Open MPI options for a ring allreduce (its default choice for 4 ranks and 64 MiB
#: buckets measured 1.6x slower than ring on the emulated 1 Gbit/s cluster)
HOROVOD_RING = ("--mca", "coll_tuned_use_dynamic_rules", "1",
                "--mca", "coll_tuned_allreduce_algorithm", "4")


# ----------------------------------------------------------------------------- arguments
def parse(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--hosts", type=int, default=4, help="emulated hosts, one rank each")
    p.add_argument("--rates", default="1gbit,10gbit", help="link rates, comma-separated")
    p.add_argument("--models", default="resnet50,vgg19,bert-base")
    p.add_argument("--systems", default="horovod,grace,byteps,hipress-ps,hipress-ring",
                   help="bench/sync.py systems ('' for none)")
    p.add_argument("--codecs", default="onebit,tbq,terngrad,dgc,graddrop,powersgd",
                   help="codecs of grace/byteps/hipress rows")
    p.add_argument("--ddp", default="allreduce,fp16,powersgd1,powersgd4",
                   help="DDP gloo hooks: allreduce,fp16,powersgd1,powersgd4 ('' for none); "
                   "a no-op hook run is added to subtract DDP's own cost")
    p.add_argument("--horovod-allreduce", default="default,ring",
                   help="Open MPI allreduce algorithms of the horovod rows: 'default' (Open "
                   "MPI's own choice) and/or 'ring' (coll_tuned algorithm 4); the faster "
                   "one is the baseline")
    p.add_argument("--plans", default="none",
                   help="SeCoPa plan settings for HiPress rows: none,auto (needs bench/sync.py "
                   "--plan support)")
    p.add_argument("--training", action="store_true",
                   help="also run the synthetic-data CNN benchmark (images/s)")
    p.add_argument("--training-script", default="examples/torch/synthetic_benchmark.py")
    p.add_argument("--training-args", default="",
                   help="model/batch arguments of the training script (default: "
                   "'--model resnet50 --image-size 64 --batch-size 8 --num-warmup-batches 2 "
                   "--num-batches-per-iter 2 --num-iters 3')")
    p.add_argument("--training-codecs", default="none,onebit,dgc",
                   help="codecs of the training rows (its --compression)")
    p.add_argument("--iters", type=int, default=3, help="timed iterations (median reported)")
    p.add_argument("--warmup", type=int, default=1, help="untimed iterations first")
    p.add_argument("--timeline", default=None,
                   help="HiPress Chrome-trace timeline of the last model (per rate: "
                   "<stem>-<rate>.json)")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "cluster"),
                   help="output directory")
    p.add_argument("--job-timeout", type=float, default=3600.0,
                   help="seconds before a launched job is killed")
    p.add_argument("--queue-ms", type=float, default=50.0, help="tbf queue bound (not a delay)")
    p.add_argument("--floors-only", action="store_true",
                   help="print the wire floors and exit (no cluster, no root needed)")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--timeline-summary", metavar="TIMELINE_JSON", default=None,
                   help="summarize a HiPress timeline (compute vs communication per "
                   "iteration) and exit")
    p.add_argument("--ddp-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--master", default=None, help=argparse.SUPPRESS)
    p.add_argument("--json", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def csv(text: str) -> List[str]:
    return [x.strip() for x in (text or "").split(",") if x.strip()]


# ----------------------------------------------------------------------------- wire floors
def load_shapes(model: str) -> List[Tuple[str, Tuple[int, ...]]]:
    spec = json.loads((ROOT / "hipress" / "data" / "gradients" / f"{model}.json").read_text())
    return [(g["name"], tuple(int(d) for d in g["shape"])) for g in spec["gradients"]]


def _numel(shape: Sequence[int]) -> int:
    return int(math.prod(shape)) if shape else 1


def _codec(codec: str):
    from sync import DEFAULT_PARAMS

    from hipress.codecs import get_codec

    return get_codec(codec, **DEFAULT_PARAMS.get(codec, {}))


def _ps_busiest(items: Sequence[Tuple[int, int]], n: int) -> int:
    """Bytes sent by the busiest host; items = (payload bytes, server rank)."""
    sent = [0] * n
    for nbytes, server in items:
        for h in range(n):
            sent[h] += (n - 1) * nbytes if h == server else nbytes
    return max(sent)


def _powersgd_ddp_bytes(shapes: Sequence[Tuple[int, ...]], rank: int) -> int:
    """Bytes PyTorch's PowerSGD hook allreduces per iteration (its compress decision)."""
    total = 0
    for shape in shapes:
        if len(shape) <= 1:
            total += 4 * _numel(shape)
            continue
        rows, cols = shape[0], _numel(shape[1:])
        r = min(rows, cols, rank)
        if rows * cols >= (rows + cols) * r * 2:  # torch's min_compression_rate = 2
            total += 4 * (rows + cols) * r
        else:
            total += 4 * rows * cols
    return total


def wire_bytes(system: str, codec: str, model: str, n: int, path: str = "") -> Optional[int]:
    """Return the bytes the busiest host sends per iteration (see the module docstring).

    Args:
        system: horovod, ddp, grace, byteps, hipress-ps, hipress-ring.
        codec: the row's codec (for ddp: allreduce, fp16, powersgd1, powersgd4).
        model: gradient set name.
        n: hosts.
        path: HiPress's reported path(s), unused except for documentation.

    Returns:
        Bytes, or None when the row has no floor (the DDP no-op run).
    """
    from hipress.config import HiPressConfig

    shapes = [s for _, s in load_shapes(model)]
    raw = sum(4 * _numel(s) for s in shapes)
    ring = 2 * (n - 1) / n
    if n == 1:
        return 0
    if system == "horovod":
        return int(ring * raw)
    if system == "ddp":
        if codec == "allreduce":
            return int(ring * raw)
        if codec == "fp16":
            return int(ring * raw / 2)
        if codec.startswith("powersgd"):
            return int(ring * _powersgd_ddp_bytes(shapes, int(codec[len("powersgd"):])))
        return None
    c = _codec(codec)
    if system == "grace":
        return (n - 1) * sum(c.payload_nbytes(s) for s in shapes)
    if system == "byteps":
        return _ps_busiest([(c.payload_nbytes(s), i % n) for i, s in enumerate(shapes)], n)
    if system.startswith("hipress"):
        cfg = HiPressConfig()
        min_bytes = cfg.compression.min_compress_bytes
        part_bytes = cfg.sync.partition_bytes
        small = sum(4 * _numel(s) for s in shapes if 4 * _numel(s) < min_bytes)
        total = ring * small
        big = [s for s in shapes if 4 * _numel(s) >= min_bytes][::-1]  # submission order
        if not c.mergeable or c.variable_size:
            per = "allreduce" if c.summable and not c.variable_size else "gather"
        else:
            per = system.split("-", 1)[1]
        if per == "gather":
            return int(total + (n - 1) * sum(c.payload_nbytes(s) for s in big))
        if per == "allreduce":
            return int(total + ring * sum(c.payload_nbytes(s) for s in big))
        items, rr = [], 0
        for s in big:
            m = _numel(s)
            parts = min(max(1, math.ceil(4 * m / part_bytes)), m)
            for p in range(parts):
                lo, hi = p * m // parts, (p + 1) * m // parts
                items.append((c.payload_nbytes((hi - lo,)), rr % n))
                rr += 1
        if per == "ring":
            return int(total + ring * sum(b for b, _ in items))
        return int(total + _ps_busiest(items, n))
    return None


# ----------------------------------------------------------------------------- DDP worker
def ddp_worker(args: argparse.Namespace) -> None:
    """One rank of the DDP gloo baselines (started by mpirun onto the emulated hosts)."""
    import numpy as np
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", "0"))
    world = int(os.environ.get("OMPI_COMM_WORLD_SIZE", "1"))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://{args.master}", rank=rank,
                            world_size=world)
    hooks = ["noop"] + [h for h in csv(args.ddp) if h != "noop"]

    class GradSet(nn.Module):
        """Parameters with a gradient set's shapes; backward writes grad = w_i everywhere."""

        def __init__(self, shapes: Sequence[Tuple[int, ...]]) -> None:
            super().__init__()
            self.ps = nn.ParameterList(nn.Parameter(torch.zeros(s)) for s in shapes)
            g = torch.Generator().manual_seed(1234 + rank)
            self.register_buffer("w", torch.randn(len(shapes), generator=g) * 0.01)

        def forward(self) -> torch.Tensor:
            return sum(p.sum() * self.w[i] for i, p in enumerate(self.ps))

    def noop_hook(state, bucket):  # noqa: ANN001 (torch rejects non-GradBucket annotations)
        fut = torch.futures.Future()
        fut.set_result(bucket.buffer())
        return fut

    rows = []
    for model in csv(args.models):
        shapes = [s for _, s in load_shapes(model)]
        total_mib = sum(4 * _numel(s) for s in shapes) / 2**20
        module = GradSet(shapes)
        for hook in hooks:
            single_bucket = hook.startswith("powersgd")
            ddp = DDP(module, bucket_cap_mb=(total_mib + 1) if single_bucket else 25,
                      gradient_as_bucket_view=True, init_sync=False)
            if hook == "noop":
                ddp.register_comm_hook(None, noop_hook)
            elif hook == "fp16":
                ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
            elif hook.startswith("powersgd"):
                state = psgd.PowerSGDState(process_group=None,
                                           matrix_approximation_rank=int(hook[8:]),
                                           start_powerSGD_iter=2)
                ddp.register_comm_hook(state, psgd.powerSGD_hook)
            elif hook != "allreduce":
                raise SystemExit(f"unknown DDP hook {hook!r}; choose from {DDP_HOOKS}")
            times = []
            # PowerSGD compresses from its 3rd iteration on (start_powerSGD_iter=2); the
            # 3rd also allocates its P/Q state, so three untimed iterations for every hook.
            warm = max(args.warmup, 3)
            for i in range(warm + args.iters):
                dist.barrier()
                t0 = time.perf_counter()
                ddp().backward()
                dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
                dist.all_reduce(dt, op=dist.ReduceOp.MAX)
                if i >= warm:
                    times.append(float(dt[0]))
            rows.append({"model": model, "system": "ddp", "codec": hook,
                         "total_s": float(np.median(times)), "times": times,
                         "path": "1 bucket" if single_bucket else "25 MiB buckets"})
            if rank == 0:
                print(f"{model:10s} ddp {hook:10s} {rows[-1]['total_s']:8.3f} s (total, "
                      f"{rows[-1]['path']})", flush=True)
            del ddp
            for p in module.ps:
                p.grad = None
        del module
    if rank == 0 and args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    dist.barrier()
    sys.stdout.flush()
    # Leave without tearing gloo down: its destructor aborted ("terminate called without
    # an active exception") after PowerSGD hooks; every result is written by now.
    os._exit(0)


# ----------------------------------------------------------------------------- launching
def mpirun_path() -> str:
    local = Path(sys.executable).parent / "mpirun"
    return str(local) if local.exists() else "mpirun"


def run_job(cmd: List[str], env: Dict[str, str], timeout: float, log: Path) -> tuple:
    """Run a job, tee its output to stdout and ``log``; kill its process group on timeout.

    Returns:
        (exit status, 124 on timeout; the job's output lines).
    """
    print("$ " + shlex.join(cmd), flush=True)
    lines: List[str] = []
    timed_out = threading.Event()
    with open(log, "a") as fh:
        fh.write("$ " + shlex.join(cmd) + "\n")
        fh.flush()
        proc = subprocess.Popen(cmd, env=env, cwd=str(ROOT), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)

        def kill(sig: int = signal.SIGTERM) -> None:
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                pass

        def expire() -> None:  # fires even when the job prints nothing
            timed_out.set()
            kill(signal.SIGTERM)
            time.sleep(10)
            if proc.poll() is None:
                kill(signal.SIGKILL)

        timer = threading.Timer(timeout, expire)
        timer.daemon = True
        timer.start()
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                sys.stdout.write(line)
                sys.stdout.flush()
                fh.write(line)
                lines.append(line.rstrip("\n"))
            rc = proc.wait()
        except BaseException:
            kill(signal.SIGKILL)
            raise
        finally:
            timer.cancel()
            if proc.poll() is None:
                kill(signal.SIGKILL)
                proc.wait()
        if timed_out.is_set():
            msg = f"!! job ran past {timeout:.0f} s; killed"
            print(msg, flush=True)
            fh.write(msg + "\n")
            lines.append(msg)
            rc = 124
    return rc, lines


def loadavg() -> List[float]:
    return [round(x, 2) for x in os.getloadavg()]


def sync_supports_plan() -> bool:
    return "--plan" in (ROOT / "bench" / "sync.py").read_text()


def sync_groups(args: argparse.Namespace, plan: str) -> List[Tuple[str, str, str]]:
    """Return the (model, system, codec) launches of bench/sync.py, one configuration each.

    One process per configuration: the engine keeps error-feedback state per gradient name
    for the life of a process, so measuring every configuration of VGG-19 in one process
    holds several copies of its 548 MiB per rank (4 ranks ran this machine out of memory).
    """
    systems, codecs = csv(args.systems), csv(args.codecs)
    out = []
    for model in csv(args.models):
        if "horovod" in systems and plan == "none":
            for variant in csv(args.horovod_allreduce) or ["default"]:
                out.append((model, "horovod", variant))
        for codec in codecs:
            for system in ("grace", "byteps", "hipress-ps", "hipress-ring"):
                if system in systems and (plan == "none" or system.startswith("hipress")):
                    out.append((model, system, codec))
    return out


def run_sync(cluster: Any, args: argparse.Namespace, rate: str, out: Path,
             plan: str) -> List[Dict[str, Any]]:
    rows: List[Dict[str, Any]] = []
    for model, system, codec in sync_groups(args, plan):
        mpi_args = f"-H {cluster.hosts_arg()}"
        variant = ""
        if system == "horovod":
            variant, codec = codec, (csv(args.codecs) or ["onebit"])[0]
            if variant == "ring":
                mpi_args += " " + " ".join(HOROVOD_RING)
            elif variant != "default":
                raise SystemExit(f"--horovod-allreduce: unknown {variant!r} (default, ring)")
        elif system == "byteps" and not _codec(codec).mergeable:
            continue  # bench/sync.py skips these too (decode-sum-re-encode is meaningless)
        if system == "hipress-ring" and not _codec(codec).mergeable:
            continue  # same engine path as hipress-ps
        tag = f"{model}-{system}{variant and '-' + variant}-{codec}-{rate}-{plan}"
        js = out / f"sync-{tag}.json"
        js.unlink(missing_ok=True)
        cmd = [sys.executable, str(ROOT / "bench" / "sync.py"), "--np", str(args.hosts),
               "--models", model, "--systems", system, "--codecs", codec,
               "--iters", str(args.iters), "--warmup", str(args.warmup), "--json", str(js),
               "--mpi-args", mpi_args]
        if plan != "none":
            cmd += ["--plan", plan]
        if args.timeline and system.startswith("hipress"):
            stem = Path(args.timeline)
            cmd += ["--timeline", str(stem.with_name(f"{stem.stem}-{tag}{stem.suffix}"))]
        before = loadavg()
        t0 = time.time()
        rc, _ = run_job(cmd, cluster.env(os.environ), args.job_timeout, out / "cluster.log")
        meta = {"rate": rate, "load_before": before, "load_after": loadavg(),
                "wall_s": round(time.time() - t0, 1), "rc": rc, "plan": plan}
        if rc != 0 or not js.exists():
            print(f"!! bench/sync.py {tag} failed (exit {rc}); its row is missing", flush=True)
            rows.append({"kind": "error", "what": f"sync {tag}", **meta})
            continue
        for r in json.loads(js.read_text()):
            if r["system"] == "horovod":
                r["path"] = "ompi " + ("ring" if variant == "ring" else "default")
            r.update(kind="sync", rate=rate,
                     plan=plan if r["system"].startswith("hipress") else "",
                     load=before, job=meta)
            rows.append(r)
    return rows


def run_ddp(cluster: Any, args: argparse.Namespace, rate: str, out: Path) -> List[Dict]:
    if not csv(args.ddp):
        return []
    js = out / f"ddp-{rate}.json"
    js.unlink(missing_ok=True)
    cmd = [mpirun_path(), "-np", str(args.hosts), "-H", cluster.hosts_arg(),
           "--bind-to", "none", sys.executable, str(Path(__file__).resolve()), "--ddp-worker",
           "--master", f"{cluster.hosts[0]}:29517", "--models", ",".join(csv(args.models)),
           "--ddp", args.ddp, "--iters", str(args.iters), "--warmup", str(args.warmup),
           "--json", str(js)]
    env = cluster.env(os.environ)
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    before = loadavg()
    t0 = time.time()
    rc, _ = run_job(cmd, env, args.job_timeout, out / "cluster.log")
    meta = {"rate": rate, "load_before": before, "load_after": loadavg(),
            "wall_s": round(time.time() - t0, 1), "rc": rc}
    if rc != 0 and js.exists():
        print(f"!! DDP baselines exited {rc} after writing their results; rows kept", flush=True)
    elif rc != 0 or not js.exists():
        print(f"!! DDP baselines failed (exit {rc}); their rows are missing", flush=True)
        return [{"kind": "error", "what": "ddp", **meta}]
    rows = json.loads(js.read_text())
    noop = {r["model"]: r["total_s"] for r in rows if r["codec"] == "noop"}
    for r in rows:
        r.update(kind="sync", rate=rate, load=before, job=meta, plan="")
        r["ddp_overhead_s"] = noop.get(r["model"])
        r["time_s"] = max(r["total_s"] - noop.get(r["model"], 0.0), 1e-6)
    return rows


_IMG_RE = re.compile(r"\[(\S+)\] total img/sec on \d+ rank\(s\): ([0-9.]+)")
TRAINING_DEFAULT_ARGS = ("--model resnet50 --image-size 64 --batch-size 8 "
                         "--num-warmup-batches 2 --num-batches-per-iter 2 --num-iters 3")


def run_training(cluster: Any, args: argparse.Namespace, rate: str, out: Path) -> List[Dict]:
    """Images/s of examples/torch/synthetic_benchmark.py through ``hipressrun -H``.

    One job per strategy (``--strategy ps`` and ``ring``), each benchmarking every codec
    of ``--training-codecs`` in turn (``none`` only in the first: uncompressed gradients
    take the fused allreduce path under either strategy). The script prints
    ``[codec] total img/sec on N rank(s): X``; that X is the row's figure.
    """
    script = ROOT / args.training_script
    if not script.exists():
        print(f"!! {args.training_script} not found; training rows skipped", flush=True)
        return [{"kind": "error", "what": "training", "rate": rate, "rc": None}]
    rows: List[Dict[str, Any]] = []
    codecs = csv(args.training_codecs)
    for k, strategy in enumerate(("ps", "ring")):
        todo = [c for c in codecs if k == 0 or c != "none"]
        if not todo:
            continue
        extra = shlex.split(args.training_args or TRAINING_DEFAULT_ARGS)
        cmd = [sys.executable, "-m", "hipress.launch", "-np", str(args.hosts),
               "-H", cluster.hosts_arg(), "-x", "OMP_NUM_THREADS=1", sys.executable,
               str(script), *extra, "--strategy", strategy, "--compression", *todo]
        log = out / f"training-{rate}-{strategy}.log"
        log.unlink(missing_ok=True)
        before = loadavg()
        rc, _ = run_job(cmd, cluster.env(os.environ), args.job_timeout, log)
        found = dict(_IMG_RE.findall(log.read_text())) if log.exists() else {}
        for codec in todo:
            ips = found.get(codec)
            rows.append({"kind": "training", "rate": rate, "codec": codec, "rc": rc,
                         "system": "hipress-fused" if codec == "none" else f"hipress-{strategy}",
                         "images_per_s": float(ips) if ips else None, "load": before,
                         "args": extra})
    base = next((r["images_per_s"] for r in rows if r["codec"] == "none"), None)
    for r in rows:
        if base and r["images_per_s"]:
            r["speedup_vs_uncompressed"] = r["images_per_s"] / base
    return rows


# ----------------------------------------------------------------------------- report
def annotate(rows: List[Dict[str, Any]], n: int) -> None:
    """Add floor_s, x_floor and the speedups of HiPress rows over each baseline."""
    from hipress.testing.emucluster import parse_rate

    for r in rows:
        if r.get("kind") != "sync":
            continue
        b = wire_bytes(r["system"], r["codec"], r["model"], n, r.get("path", ""))
        r["wire_bytes"] = b
        r["floor_s"] = None if b is None else b * 8 / parse_rate(r["rate"])
        r["x_floor"] = (r["time_s"] / r["floor_s"]) if r.get("floor_s") else None
    groups: Dict[Tuple[str, str], List[Dict[str, Any]]] = {}
    for r in rows:
        if r.get("kind") == "sync" and not (r["system"] == "ddp" and r["codec"] == "noop"):
            groups.setdefault((r["model"], r["rate"]), []).append(r)
    for grp in groups.values():
        base: Dict[Tuple[str, str], float] = {}
        for r in grp:  # the fastest variant of each baseline (e.g. horovod default/ring)
            if r["system"] in BASELINE_SYSTEMS:
                key = (r["system"], r["codec"])
                base[key] = min(base.get(key, math.inf), r["time_s"])
        compressed = {k: v for k, v in base.items() if k not in UNCOMPRESSED_BASELINES}
        best_c = min(compressed.items(), key=lambda kv: kv[1]) if compressed else None
        for r in grp:
            if not r["system"].startswith("hipress"):
                continue
            t = r["time_s"]
            sp = {}
            for key, label in ((("horovod", "none"), "horovod"), (("ddp", "allreduce"), "ddp"),
                               (("grace", r["codec"]), "grace"),
                               (("byteps", r["codec"]), "byteps")):
                if key in base:
                    sp[label] = base[key] / t
            if best_c:
                sp["best_compressed"] = best_c[1] / t
                r["best_compressed_baseline"] = f"{best_c[0][0]}/{best_c[0][1]}"
            r["speedup"] = sp


def fmt(x: Optional[float], spec: str = ".2f", suffix: str = "") -> str:
    return "-" if x is None else f"{x:{spec}}{suffix}"


def table(rows: List[Dict[str, Any]]) -> str:
    head = ("| model | link | system | codec | path | plan | sync s | floor s | x floor | "
            "vs Horovod | vs DDP | vs GRACE | vs BytePS | vs best compressed |")
    lines = [head, "|" + "---|" * 14]
    order = {s: i for i, s in enumerate(("horovod", "ddp", "grace", "byteps", "hipress-ps",
                                         "hipress-ring"))}
    sync_rows = sorted((r for r in rows if r.get("kind") == "sync"),
                       key=lambda r: (r["rate"], r["model"], order.get(r["system"], 9),
                                      r["codec"], r.get("plan", "")))
    for r in sync_rows:
        sp = r.get("speedup", {})
        t = r["time_s"] if not (r["system"] == "ddp" and r["codec"] == "noop") else r["total_s"]
        lines.append(
            f"| {r['model']} | {r['rate']} | {r['system']} | {r['codec']} | {r.get('path', '')} "
            f"| {r.get('plan', '') or '-'} | {t:.3f} | {fmt(r.get('floor_s'), '.3f')} "
            f"| {fmt(r.get('x_floor'))} | {fmt(sp.get('horovod'), '.2f', 'x')} "
            f"| {fmt(sp.get('ddp'), '.2f', 'x')} | {fmt(sp.get('grace'), '.2f', 'x')} "
            f"| {fmt(sp.get('byteps'), '.2f', 'x')} "
            f"| {fmt(sp.get('best_compressed'), '.2f', 'x')} |")
    errors = [r for r in rows if r.get("kind") == "error"]
    if errors:
        lines += [""] + [f"- failed: {r['what']} (exit {r.get('rc')}) at {r.get('rate')}"
                         for r in errors]
    train = [r for r in rows if r.get("kind") == "training"]
    if train:
        lines += ["", "| link | system | codec | images/s (all ranks) | vs uncompressed "
                  "| exit |", "|---|---|---|---|---|---|"]
        for r in train:
            lines.append(f"| {r['rate']} | {r['system']} | {r['codec']} "
                         f"| {fmt(r.get('images_per_s'), '.1f')} "
                         f"| {fmt(r.get('speedup_vs_uncompressed'), '.2f', 'x')} | {r['rc']} |")
    return "\n".join(lines)


def targets(rows: List[Dict[str, Any]], model: str = "vgg19", rate: str = "1gbit") -> str:
    """Check the issue's targets on ``model`` at ``rate`` (best HiPress configuration)."""
    grp = [r for r in rows if r.get("kind") == "sync" and r["model"] == model
           and r["rate"] == rate]
    hp = [r for r in grp if r["system"].startswith("hipress")]
    if not hp:
        return f"targets: no HiPress rows for {model} at {rate}"
    best = min(hp, key=lambda r: r["time_s"])
    sp = best.get("speedup", {})
    lines = [f"targets on {model} at {rate}: best HiPress = {best['system']}/{best['codec']} "
             f"({best['time_s']:.3f} s)"]

    def check(label: str, value: Optional[float], want: float, above: bool = True) -> None:
        if value is None:
            lines.append(f"  {label}: not measured")
            return
        ok = value >= want if above else value <= want
        lines.append(f"  {label}: {value:.2f} (target {'>=' if above else '<='} {want}) "
                     f"{'MET' if ok else 'NOT MET'}")

    check("speedup over uncompressed allreduce (horovod)", sp.get("horovod"), 10.0)
    check(f"speedup over best compressed baseline ({best.get('best_compressed_baseline')})",
          sp.get("best_compressed"), 1.3)
    check("time / own wire floor", best.get("x_floor"), 2.0, above=False)
    return "\n".join(lines)


def _union_s(intervals: List[Tuple[float, float]]) -> float:
    total, cur = 0.0, None
    for a, b in sorted(intervals):
        if cur is None or a > cur[1]:
            if cur is not None:
                total += cur[1] - cur[0]
            cur = [a, b]
        else:
            cur[1] = max(cur[1], b)
    if cur is not None:
        total += cur[1] - cur[0]
    return total / 1e6


def timeline_summary(path: str) -> str:
    """Summarize a HiPress timeline: per rank and iteration, where the time went.

    Iterations are cut at each rank's ``fuse`` events (bench/sync.py submits the small
    gradients first, so every iteration starts with one fused bucket). For each window:
    its length, the time the compute thread(s) were busy (union of encode/decode/merge
    events) and the time at least one message was in flight (union of send/recv/
    allgather/allreduce events). A compute share near 100 % means the codecs' CPU time,
    not the links, sets the pace.
    """
    data = json.loads(Path(path).read_text())
    events = [e for e in (data["traceEvents"] if isinstance(data, dict) else data)
              if e.get("ph") == "X"]
    lines = [f"timeline {path}: per rank, per iteration (first = warm-up)",
             "rank iter  window_s  compute_busy_s  comm_busy_s  encode_s  decode+merge_s"]
    for rank in sorted({e["pid"] for e in events}):
        mine = sorted((e for e in events if e["pid"] == rank), key=lambda e: e["ts"])
        cuts = [e["ts"] for e in mine if e["name"] == "fuse"] or [mine[0]["ts"]]
        end = max(e["ts"] + e["dur"] for e in mine)
        for k, lo in enumerate(cuts):
            hi = cuts[k + 1] if k + 1 < len(cuts) else end
            win = [e for e in mine if lo <= e["ts"] < hi]
            comp = [(e["ts"], min(e["ts"] + e["dur"], hi)) for e in win
                    if e["name"].startswith(("encode", "decode", "merge"))]
            comm = [(e["ts"], min(e["ts"] + e["dur"], hi)) for e in win
                    if e["name"] in ("send", "recv", "send+recv", "allgather", "allreduce")]
            enc = sum(e["dur"] for e in win if e["name"] == "encode") / 1e6
            dec = sum(e["dur"] for e in win if e["name"].startswith(("decode", "merge"))) / 1e6
            lines.append(f"{rank:4d} {k:4d} {(hi - lo) / 1e6:9.3f} {_union_s(comp):15.3f} "
                         f"{_union_s(comm):12.3f} {enc:9.3f} {dec:15.3f}")
    return "\n".join(lines)


def print_floors(args: argparse.Namespace) -> None:
    from hipress.testing.emucluster import parse_rate

    n = args.hosts
    print(f"wire floors, {n} hosts (bytes the busiest host sends / link rate)")
    for model in csv(args.models):
        rows = [("horovod", "none"), ("ddp", "allreduce"), ("ddp", "fp16"),
                ("ddp", "powersgd1"), ("ddp", "powersgd4")]
        for c in csv(args.codecs):
            merge = _codec(c).mergeable  # bench/sync.py runs byteps and -ring only then
            rows += [("grace", c)] + ([("byteps", c)] if merge else []) + [("hipress-ps", c)]
            rows += [("hipress-ring", c)] if merge else []
        for system, codec in rows:
            b = wire_bytes(system, codec, model, n)
            if b is None:
                continue
            fl = "  ".join(f"{rate}: {b * 8 / parse_rate(rate):8.4f} s" for rate in csv(args.rates))
            print(f"{model:10s} {system:13s} {codec:10s} {b / 2**20:10.2f} MiB  {fl}")


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse(argv)
    if args.ddp_worker:
        ddp_worker(args)
        return 0
    if args.timeline_summary:
        print(timeline_summary(args.timeline_summary))
        return 0
    if args.floors_only:
        print_floors(args)
        return 0
    from hipress.testing.emucluster import EmulatedCluster, namespaces_unavailable

    reason = namespaces_unavailable()
    if reason is not None:
        print(f"cannot build the emulated cluster: {reason}", file=sys.stderr)
        return 2
    plans = csv(args.plans) or ["none"]
    if any(p != "none" for p in plans) and not sync_supports_plan():
        print("!! bench/sync.py has no --plan option yet; SeCoPa-plan rows skipped", flush=True)
        plans = ["none"]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"started": datetime.datetime.now().isoformat(timespec="seconds"),
            "hosts": args.hosts, "cpus": os.cpu_count(), "argv": sys.argv[1:],
            "load_at_start": loadavg(), "queue_ms": args.queue_ms}
    with open(out / "cluster.log", "w") as fh:
        fh.write(f"bench/cluster.py {shlex.join(sys.argv[1:])}\n")
    rows: List[Dict[str, Any]] = []
    for rate in csv(args.rates):
        with EmulatedCluster(args.hosts, rate=rate, queue_ms=args.queue_ms) as cluster:
            print(f"=== {cluster!r}; load {loadavg()}", flush=True)
            for plan in plans:
                rows += run_sync(cluster, args, rate, out, plan)
            rows += run_ddp(cluster, args, rate, out)
            if args.training:
                rows += run_training(cluster, args, rate, out)
        annotate(rows, args.hosts)
        _write(out, meta, rows, args)  # partial results survive a later failure
    meta["load_at_end"] = loadavg()
    _write(out, meta, rows, args)
    print(table(rows))
    for rate in csv(args.rates):
        if "vgg19" in csv(args.models):
            print(targets(rows, "vgg19", rate))
    print(f"wrote {out / 'cluster.json'}, {out / 'cluster.md'}"
          + ("" if args.no_plot else f", {out / 'cluster.png'}"))
    return 0 if not any(r.get("kind") == "error" for r in rows) else 1


def _write(out: Path, meta: Dict[str, Any], rows: List[Dict[str, Any]],
           args: argparse.Namespace) -> None:
    (out / "cluster.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    text = [f"# Emulated {args.hosts}-host cluster: per-iteration gradient sync",
            "", f"Run: `python bench/cluster.py {shlex.join(sys.argv[1:])}` at "
            f"{meta['started']}; load average at start {meta['load_at_start']} "
            f"on {meta['cpus']} CPUs.", "", table(rows), ""]
    for rate in csv(args.rates):
        if "vgg19" in csv(args.models):
            text += ["```", targets(rows, "vgg19", rate), "```"]
    (out / "cluster.md").write_text("\n".join(text) + "\n")
    if not args.no_plot:
        try:
            from plot_cluster import plot

            plot(rows, out / "cluster.png")
        except ImportError as exc:
            print(f"!! no plot ({exc}); pip install matplotlib", flush=True)


if __name__ == "__main__":
    sys.exit(main())
