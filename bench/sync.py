"""Per-iteration gradient synchronization time: HiPress vs the systems it is chosen over.

Runs the gradient sets of ResNet-50, VGG-19 and BERT-base (shapes shipped in
``hipress/data/gradients``; values random normal) under MPI and prints, measured in one run:

- ``horovod``: uncompressed MPI allreduce of fused 64 MiB buckets;
- ``grace``: compress -> allgather -> decompress each -> sum, per tensor (GRACE);
- ``byteps``: non-pipelined parameter server, decode-sum-re-encode per tensor (BytePS onebit);
- ``hipress-none``: HiPress's uncompressed allreduce (fused small, in-place large);
- ``hipress-ps`` / ``hipress-ring``: CaSync-PS / CaSync-Ring (or the path the engine picks
  for codecs that cannot be merged: gather for DGC/GradDrop, compressed allreduce for
  PowerSGD), pipelined, small tensors fused uncompressed.

Usage (launches mpirun itself)::

    python bench/sync.py --np 4 --models resnet50 --iters 3
    python bench/sync.py --np 4 --models vgg19 --codecs onebit,dgc --systems horovod,hipress-ps

``--transports mpi,torch`` runs the HiPress rows once per transport in one invocation:
under ``mpirun`` (MPI) and under ``torchrun`` (torch.distributed gloo), then prints each
row's torch/MPI time ratio. ``horovod`` runs under both (MPI ``Allreduce``, or gloo's
``all_reduce`` on a default group of the torch job: the ratio of the two is the libraries'
own difference on this machine); the other baselines need MPI and run in the MPI job only.

Each time is the slowest rank's, median over ``--iters`` after ``--warmup`` iterations.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

DEFAULT_PARAMS = {
    "onebit": {},
    "tbq": {"threshold": 0.02},
    "terngrad": {},
    "dgc": {"ratio": 0.001},
    "graddrop": {"drop_ratio": 0.99},
    "powersgd": {"rank": 1},
    "fp16": {},
}


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--np", type=int, default=4, help="ranks on localhost (default 4)")
    p.add_argument("--models", default="resnet50,vgg19,bert-base")
    p.add_argument("--codecs", default="onebit,tbq,terngrad,dgc,graddrop,powersgd")
    p.add_argument("--systems", default="horovod,grace,byteps,hipress-ps,hipress-ring")
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--timeline", default=None, help="HiPress timeline path (last model)")
    p.add_argument("--plan", default="none",
                   help="sync.plan for the HiPress rows: none, auto (SeCoPa) or a plan file")
    p.add_argument("--json", default=None, help="write the rows as JSON here")
    p.add_argument("--mpi-args", default="", help="extra mpirun arguments")
    p.add_argument("--transports", default="mpi",
                   help="mpi, torch, or mpi,torch to compare HiPress over both in one run")
    p.add_argument("--transport", default="mpi", help=argparse.SUPPRESS)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    argv = os.environ.get("HIPRESS_BENCH_ARGV")
    return p.parse_args(json.loads(argv) if argv else None)


def launch(args: argparse.Namespace) -> int:
    transports = [t for t in args.transports.split(",") if t]
    if len(transports) == 1:
        return _launch_one(args, transports[0], args.json)
    results = {}
    for t in transports:
        out = Path(f"/tmp/hipress-sync-{os.getpid()}-{t}.json")
        rc = _launch_one(args, t, str(out))
        if rc:
            return rc
        results[t] = json.loads(out.read_text())
        out.unlink()
    base = transports[0]
    print(f"\n{'model':10s} {'system':13s} {'codec':9s} " + " ".join(
        f"{t + ' s':>9s}" for t in transports) + "  " + " ".join(
        f"{t + '/' + base:>11s}" for t in transports[1:]), flush=True)
    keyed = {t: {(r["model"], r["system"], r["codec"]): r["time_s"] for r in rows}
             for t, rows in results.items()}
    for key, t0 in keyed[base].items():
        if not all(key in keyed[t] for t in transports):
            continue
        times = [keyed[t][key] for t in transports]
        print(f"{key[0]:10s} {key[1]:13s} {key[2]:9s} " + " ".join(f"{x:9.3f}" for x in times)
              + "  " + " ".join(f"{x / t0:10.2f}x" for x in times[1:]), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


def _launch_one(args: argparse.Namespace, transport: str, json_out) -> int:
    """Run the worker on ``args.np`` local ranks under mpirun (MPI) or torchrun (torch)."""
    passed = _strip(sys.argv[1:], ("--transports", "--json"))
    passed += ["--transport", transport] + (["--json", json_out] if json_out else [])
    if transport == "torch":
        # torchrun's own parser would claim options such as --np: pass them in the env
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.np),
               "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
               "--local-ranks-filter", "0", __file__]
        env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMI"))}
        env.update(PYTHONUNBUFFERED="1", HIPRESS_TRANSPORT="torch",
                   HIPRESS_BENCH_ARGV=json.dumps(["--worker"] + passed))
        return subprocess.call(cmd, env=env)
    mpirun = Path(sys.executable).parent / "mpirun"
    cmd = [str(mpirun if mpirun.exists() else "mpirun"), "-np", str(args.np), "--oversubscribe",
           "--bind-to", "none"] + args.mpi_args.split() + [sys.executable, __file__, "--worker"]
    cmd += passed
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMPI_MCA_mpi_yield_when_idle="1", PYTHONUNBUFFERED="1")
    return subprocess.call(cmd, env=env)


def _strip(argv, flags):
    """Return ``argv`` without the given ``--flag value`` / ``--flag=value`` options."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a in flags:
            skip = True
            continue
        if any(a.startswith(f + "=") for f in flags):
            continue
        out.append(a)
    return out


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _EngineComm:
    """Barrier and max-allreduce through HiPress itself (no mpi4py: the torch transport)."""

    def __init__(self, hp) -> None:
        self.hp = hp
        self.n = 0

    def Barrier(self) -> None:  # noqa: N802 - mpi4py's spelling
        self.hp.barrier()

    def allreduce(self, x: float, op=None) -> float:
        self.n += 1
        return float(self.hp.allreduce(np.array([x]), f"__bench.max.{self.n}", op="max")[0])


def load_grads(model: str, rank: int) -> dict:
    spec = json.loads((ROOT / "hipress" / "data" / "gradients" / f"{model}.json").read_text())
    rng = np.random.default_rng(1234 + rank)
    return {g["name"]: (rng.standard_normal(g["shape"], dtype=np.float32) * 0.01)
            for g in spec["gradients"]}


def timed(comm, fn, iters: int, warmup: int) -> float:
    op = None
    if not isinstance(comm, _EngineComm):
        from mpi4py import MPI

        op = MPI.MAX
    times = []
    for i in range(warmup + iters):
        comm.Barrier()
        t0 = time.perf_counter()
        fn()
        dt = comm.allreduce(time.perf_counter() - t0, op=op)
        if i >= warmup:
            times.append(dt)
    return float(np.median(times))


#: gradients below this size go uncompressed (fused), as under the default policy's
#: compression.min_compress_bytes; an explicit per-call codec would compress them all
MIN_COMPRESS_BYTES = 65536


def hipress_fn(hp, grads: dict, label: str, codec, strategy):
    names = list(grads)[::-1]  # backward order: last layer first
    codecs = {n: codec if grads[n].nbytes >= MIN_COMPRESS_BYTES else None for n in names}

    # in place (results written into the gradients), as the framework adapters submit
    # them: a training step does not allocate a fresh output per gradient
    def run():
        hs = [hp.allreduce_async(grads[n], f"{label}/{n}", codec=codecs[n], strategy=strategy,
                                 inplace=True)
              for n in names]
        for h in hs:
            hp.synchronize(h)

    return run


def worker(args: argparse.Namespace) -> None:
    import hipress as hp
    from hipress.codecs import get_codec

    hp.init({"timeline": args.timeline, "logging": {"level": "WARNING"},
             "sync": {"plan": args.plan}, "transport": args.transport})
    rank, n = hp.rank(), hp.size()
    systems = args.systems.split(",")
    if args.transport == "torch":
        import torch.distributed as dist
        from baselines import gloo_allreduce

        comm = _EngineComm(hp)
        # the fused uncompressed baseline runs on gloo (a default group of its own); the
        # other baselines are written for MPI
        systems = [s for s in systems if s.startswith("hipress") or s == "horovod"]
        if "horovod" in systems and not dist.is_initialized():
            dist.init_process_group("gloo")
    else:
        from baselines import BytePSNonPipelined, GraceAllgather, horovod_allreduce
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
    codecs = [c for c in args.codecs.split(",") if c]
    rows = []

    def report(model, system, codec, t, ratio=None, path=""):
        rows.append({"model": model, "system": system, "codec": codec, "time_s": t,
                     "ratio": ratio, "path": path,
                     "plan": args.plan if system.startswith("hipress") else ""})
        if rank == 0:
            base = next((r["time_s"] for r in rows if r["model"] == model
                         and r["system"] == "horovod"), None)
            sp = f"{base / t:6.2f}x" if base else "     -"
            rt = f"{ratio:7.1f}" if ratio else "      -"
            print(f"{model:10s} {system:13s} {codec:9s} {path:9s} {t:9.3f} s  {sp}  ratio {rt}",
                  flush=True)

    if rank == 0:
        print(f"world size {n}; time per iteration (slowest rank, median of {args.iters}); "
              "speedup vs horovod", flush=True)
    for model in args.models.split(","):
        grads = load_grads(model, rank)
        mib = sum(g.nbytes for g in grads.values()) / 2**20
        if rank == 0:
            print(f"--- {model}: {len(grads)} tensors, {mib:.1f} MiB", flush=True)
        if "horovod" in systems:
            fused = (partial(gloo_allreduce, grads) if args.transport == "torch"
                     else partial(horovod_allreduce, comm, grads))
            report(model, "horovod", "none", timed(comm, fused, args.iters, args.warmup))
        if "hipress-none" in systems:
            label = f"{model}/hipress-none"
            report(model, "hipress-none", "none",
                   timed(comm, hipress_fn(hp, grads, label, None, None), args.iters,
                         args.warmup), 1.0, "fused/direct")
        for codec in codecs:
            params = DEFAULT_PARAMS.get(codec, {})
            cobj = get_codec(codec, **params)
            raw = sum(g.nbytes for g in grads.values())
            wire = sum(cobj.payload_nbytes(g.shape) for g in grads.values())
            ratio = raw / wire
            if "grace" in systems:
                g = GraceAllgather(codec, params)
                report(model, "grace", codec, timed(comm, partial(g, comm, grads), args.iters,
                                                    args.warmup), ratio)
            if "byteps" in systems and cobj.mergeable:
                b = BytePSNonPipelined(codec, params)
                report(model, "byteps", codec, timed(comm, partial(b, comm, grads), args.iters,
                                                     args.warmup), ratio)
            for system in ("hipress-ps", "hipress-ring"):
                if system not in systems:
                    continue
                strategy = system.split("-")[1]
                if not cobj.mergeable and system == "hipress-ring":
                    continue  # same path as hipress-ps for these codecs
                label = f"{model}/{system}/{codec}"
                fn = hipress_fn(hp, grads, label, get_codec(codec, **params), strategy)
                t = timed(comm, fn, args.iters, args.warmup)
                st = hp.stats()
                paths = sorted({v["strategy"] for k, v in st.items() if k.startswith(label)})
                report(model, system, codec, t, ratio, "/".join(paths))
                hp.reset_state(label)  # residuals of finished configurations: free them
    if rank == 0 and args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    hp.shutdown()


if __name__ == "__main__":
    a = parse()
    if a.worker:
        worker(a)
    else:
        sys.exit(launch(a))
