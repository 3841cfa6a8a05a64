r"""One rank of ``bench/train_e2e.py``: train a model on synthetic data and time every step.

Started by ``mpirun`` (one process per rank; rank and world size come from
``OMPI_COMM_WORLD_RANK`` / ``OMPI_COMM_WORLD_SIZE``). Every system trains the same model
(``examples/torch/models.py``, initialized from seed 0 on every rank) on one fixed batch of
random images and labels drawn from a per-rank seeded generator, with
``SGD(lr=0.01, momentum=0.9)`` and cross-entropy. Systems (``--system``):

- ``ddp``: PyTorch DDP over gloo with the comm hook ``--hook`` (``noop``: the bucket
  returned unchanged, the compute floor; ``allreduce``: DDP's default; ``fp16``;
  ``powersgd1``: PowerSGD rank 1 with a single bucket, see bench/README.md);
- ``mpi-allreduce``: after backward, all gradients flattened into one buffer, one
  ``MPI.Allreduce`` (mpi4py), averaged and copied back (Horovod-style, one fused bucket);
- ``hipress``: ``hipress.torch.DistributedOptimizer`` with ``compression.algorithm=--codec``
  (the job's policy, so ``min_compress_bytes`` keeps tiny tensors uncompressed) under
  ``sync.strategy = --strategy``;
- ``tf-floor`` / ``tf-hipress``: Keras ``ResNet50`` trained with ``model.fit``, alone on
  each rank (the TensorFlow compute floor) or with ``hipress.tensorflow.DistributedOptimizer``.

Per step (PyTorch): ``compute`` = zero_grad + forward + backward until ``backward()``
returns; ``step`` = wall time of what follows until the update is done (``opt.step()``;
for ``mpi-allreduce`` the flatten + Allreduce + copy-back as well); the CPU time of the
threads named ``hipress*`` (engine and codec threads, from ``/proc/self/task/<tid>/stat``)
and of the whole process (``time.process_time()``). After the timed steps, ``update`` is
the wall time of a plain ``torch.optim.SGD.step()`` on the same parameters (the pure
optimizer update). TensorFlow steps are timed between consecutive
``on_train_batch_end`` callbacks (one whole ``model.fit`` step).

With ``--sync-only`` (hipress only) nothing trains: one backward pass before the loop
gives the gradients, and each step submits them all at once (``hipress.allreduce_async``
with the job's policy, ``codec="auto"``, last layer first), waits for them and calls
``hipress.step()``; ``compute`` is then about zero and ``step`` is the synchronization
(``bench/secopa_pipeline.py --sync-only``).

Each rank writes ``<--json>.rank<R>.json``; the driver merges them.
"""

from __future__ import annotations

import argparse
import collections
import gc
import inspect
import json
import os
import resource
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

ROOT = Path(__file__).resolve().parent.parent
CLK_TCK = os.sysconf("SC_CLK_TCK")


def config_overrides(items: Sequence[str]) -> Dict[str, Any]:
    """Turn ``--set KEY=VALUE`` items into ``hipress.init`` keywords (values read as YAML).

    Raises:
        SystemExit: an item has no ``=``.
    """
    import yaml

    out: Dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise SystemExit(f"--set {item!r}: expect KEY=VALUE, e.g. sync.cycle_time_ms=5")
        out[key.strip()] = yaml.safe_load(value)
    return out


def parse(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parse the worker's command line (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--system", required=True,
                   choices=["ddp", "mpi-allreduce", "hipress", "tf-floor", "tf-hipress"])
    p.add_argument("--hook", default="allreduce",
                   choices=["noop", "allreduce", "fp16", "powersgd1"])
    p.add_argument("--codec", default="none",
                   help="HiPress codec (hipress, tf-hipress) as compression.algorithm; with a "
                   "trailing '!' (hipress) passed as DistributedOptimizer(compression=...)")
    p.add_argument("--strategy", default="ps", help="HiPress sync.strategy: ps, ring or auto")
    p.add_argument("--model", default="resnet50")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--image-size", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=64, help="tokens per sequence (bert-base)")
    p.add_argument("--num-classes", type=int, default=1000)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--torch-threads", type=int, default=0,
                   help="torch.set_num_threads (TF: intra-op threads); 0 = library default")
    p.add_argument("--powersgd-start-iter", type=int, default=2)
    p.add_argument("--master", default="127.0.0.1:29600", help="DDP rendezvous host:port")
    p.add_argument("--transport", default="mpi",
                   help="HiPress transport: mpi, or torch (gloo groups on --master's store)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="extra HiPress config key for hipress.init (dotted, e.g. "
                   "sync.cycle_time_ms=5; the value is read as YAML); repeatable")
    p.add_argument("--sync-only", action="store_true",
                   help="hipress only: no training; every step synchronizes the gradients "
                   "of one backward pass (all submitted at once, last layer first)")
    p.add_argument("--json", required=True, help="output prefix: <json>.rank<R>.json")
    args = p.parse_args(argv)
    if args.sync_only and args.system != "hipress":
        p.error("--sync-only works with --system hipress only")
    return args


# ----------------------------------------------------------------------------- CPU time
def _task_cpu_s(tid: int) -> float:
    """Return user + system CPU seconds of thread ``tid`` of this process (0 if gone)."""
    try:
        stat = Path(f"/proc/self/task/{tid}/stat").read_text()
    except OSError:
        return 0.0
    fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) "
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime, stime (fields 14, 15)


def engine_threads() -> List[int]:
    """Return the native ids of this process's HiPress threads.

    A thread counts when its kernel name (``/proc/self/task/<tid>/comm``) starts with
    ``hipress`` or when it is a Python thread whose name does: Python 3.11 does not pass
    ``threading.Thread`` names to the kernel, so the engine (``hipress-engine``) and codec
    (``hipress-compute_N``) threads show up as ``python`` in ``comm``.
    """
    tids = set()
    for t in threading.enumerate():
        if t.name.startswith("hipress") and t.native_id is not None:
            tids.add(t.native_id)
    try:
        for tid in os.listdir("/proc/self/task"):
            try:
                if Path(f"/proc/self/task/{tid}/comm").read_text().startswith("hipress"):
                    tids.add(int(tid))
            except OSError:
                continue
    except OSError:
        pass
    return sorted(tids)


def engine_cpu_s() -> float:
    """Return the CPU seconds used so far by this process's HiPress threads."""
    return sum(_task_cpu_s(t) for t in engine_threads())


class GcClock:
    """Wall seconds spent in Python's cyclic garbage collector (``gc.callbacks``), any thread."""

    def __init__(self) -> None:
        self.total_s = 0.0
        self._start: Dict[int, float] = {}
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: Dict[str, Any]) -> None:
        tid = threading.get_ident()
        if phase == "start":
            self._start[tid] = time.perf_counter()
        elif tid in self._start:
            self.total_s += time.perf_counter() - self._start.pop(tid)


_PAGE = resource.getpagesize()


def minor_faults() -> int:
    """Return the minor page faults of this process so far (first touches of fresh pages)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


class StepClock:
    """Collects per-step wall, CPU, engine-CPU and garbage-collector times and page faults.

    ``fault_mib`` is the memory faulted in during the step (minor faults x page size; a
    transparent huge page counts once): every fresh page costs the kernel a fault and a
    zeroing pass, on virtual machines that hand freed memory back to the host also a round
    trip to the host.
    """

    def __init__(self) -> None:
        self.steps: List[Dict[str, float]] = []
        self._t0 = self._cpu0 = self._eng0 = self._gc0 = 0.0
        self._flt0 = 0
        self._gc = GcClock()

    def start(self) -> None:
        """Mark the start of a step."""
        self._gc0 = self._gc.total_s
        self._flt0 = minor_faults()
        self._eng0, self._cpu0, self._t0 = engine_cpu_s(), time.process_time(), time.perf_counter()

    def stop(self, **phases: float) -> None:
        """Mark the end of a step; ``phases`` are extra wall times (seconds) to record."""
        t1 = time.perf_counter()
        cpu1, eng1 = time.process_time(), engine_cpu_s()
        self.steps.append({"step_s": t1 - self._t0, "cpu_s": cpu1 - self._cpu0,
                           "engine_cpu_s": eng1 - self._eng0,
                           "gc_s": self._gc.total_s - self._gc0,
                           "fault_mib": (minor_faults() - self._flt0) * _PAGE / 2**20,
                           **phases})


def hipress_paths(stats: Dict[str, Dict[str, Any]]) -> Dict[str, Any]:
    """Summarize ``hipress.stats()``: gradients per path taken, bytes sent, mean ratio."""
    grads = {n: s for n, s in stats.items()
             if s.get("strategy") != "bcast" and not n.startswith(("broadcast", "__"))}
    paths = collections.Counter(str(s.get("strategy")) for s in grads.values())
    codecs = collections.Counter(str(s.get("codec")) for s in grads.values())
    calls = max((int(s.get("calls", 0)) for s in grads.values()), default=0)
    sent = sum(int(s.get("bytes_sent", 0)) for s in grads.values())
    raw = sum(int(s.get("raw_bytes", 0)) for s in grads.values())
    payload = sum(int(s.get("payload_bytes", 0)) for s in grads.values())
    return {"paths": dict(paths), "codecs": dict(codecs), "calls": calls,
            "bytes_sent": sent, "bytes_sent_per_step": sent / calls if calls else None,
            "raw_bytes": raw, "payload_bytes": payload,
            "compression_ratio": raw / payload if payload else None}


# ----------------------------------------------------------------------------- PyTorch
def run_torch(args: argparse.Namespace, rank: int, world: int) -> Dict[str, Any]:
    """Train ``args.model`` with ``args.system``; return this rank's measurements."""
    import torch
    import torch.nn.functional as F  # noqa: N812

    sys.path.insert(0, str(ROOT / "examples" / "torch"))
    from models import build_model, synthetic_batch

    if args.torch_threads > 0:
        torch.set_num_threads(args.torch_threads)
    torch.manual_seed(0)
    model = build_model(args.model, num_classes=args.num_classes)
    g = torch.Generator().manual_seed(1000 + rank)
    x, y = synthetic_batch(args.model, args.batch_size, args.num_classes, g,
                           image_size=args.image_size, seq_len=args.seq_len)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=0.01, momentum=0.9)
    net: Any = model
    warm = args.warmup
    info: Dict[str, Any] = {}
    finish: Callable[[], None] = lambda: None  # noqa: E731
    step: Callable[[], None] = opt.step

    if args.system == "ddp":
        import torch.distributed as dist
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
        from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: N817

        dist.init_process_group("gloo", init_method=f"tcp://{args.master}", rank=rank,
                                world_size=world)
        single = args.hook.startswith("powersgd")
        total_mib = sum(p.numel() * p.element_size() for p in params) / 2**20
        # PowerSGD: one bucket (with several, its gloo collectives ran in different orders
        # on different ranks and the job aborted; bench/README.md)
        bucket_mb = total_mib + 1 if single else 25
        # no per-forward buffer broadcast (the other systems do not sync BatchNorm buffers)
        no_sync = ({"forward_sync_buffers": False}
                   if "forward_sync_buffers" in inspect.signature(DDP).parameters
                   else {"broadcast_buffers": False})
        net = DDP(model, bucket_cap_mb=bucket_mb, gradient_as_bucket_view=True, **no_sync)
        info["bucket_cap_mb"] = round(bucket_mb, 1)
        # DDP rebuilds its buckets (in gradient order) in the second step: keep it untimed
        warm = max(warm, 2)
        if args.hook == "noop":
            def noop_hook(state, bucket):  # noqa: ANN001 (torch checks the annotations)
                fut = torch.futures.Future()
                fut.set_result(bucket.buffer())
                return fut

            net.register_comm_hook(None, noop_hook)
        elif args.hook == "fp16":
            net.register_comm_hook(None, default_hooks.fp16_compress_hook)
        elif single:
            state = psgd.PowerSGDState(process_group=None, matrix_approximation_rank=1,
                                       start_powerSGD_iter=args.powersgd_start_iter)
            net.register_comm_hook(state, psgd.powerSGD_hook)
            # compressed from step start_powerSGD_iter on, which also allocates its state
            warm = max(warm, args.powersgd_start_iter + 1)

        def finish() -> None:
            dist.barrier()

    elif args.system == "mpi-allreduce":
        from mpi4py import MPI

        comm = MPI.COMM_WORLD

        def step() -> None:
            grads = [p.grad for p in params]
            flat = torch.cat([gr.reshape(-1) for gr in grads])
            comm.Allreduce(MPI.IN_PLACE, flat.numpy(), op=MPI.SUM)
            flat /= world
            for gr, part in zip(grads, torch.split(flat, [gr.numel() for gr in grads])):
                gr.copy_(part.view_as(gr))
            opt.step()

        def finish() -> None:
            comm.Barrier()

    elif args.system == "hipress":
        import hipress
        import hipress.torch as hp

        # the codec as the job's policy, so compression.min_compress_bytes applies; with a
        # trailing "!" (onebit!) it is passed as compression=, which compresses every
        # tensor, batch-norm vectors included
        codec = args.codec.rstrip("!")
        base = {"sync.strategy": args.strategy, "transport": args.transport,
                **config_overrides(args.set)}
        if args.transport == "torch":  # mpirun only starts the processes
            host, port = args.master.split(":")
            os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR=host,
                              MASTER_PORT=port)
        if args.sync_only:
            # the gradients of one backward pass; each step submits them all at once, in
            # backward order (the last layer first) under the job's compression policy
            # (codec="auto", as the optimizer wrapper submits), waits and ends the step
            hp.init(**base, **{"compression.algorithm": codec})
            F.cross_entropy(net(x), y).backward()
            grads = [(n, p.grad.numpy()) for n, p in reversed(list(model.named_parameters()))
                     if p.requires_grad]

            def step() -> None:
                handles = [hipress.allreduce_async(a, n, codec="auto") for n, a in grads]
                for h in handles:
                    hipress.synchronize(h)
                hipress.step()

        elif args.codec.endswith("!"):
            hp.init(**base)
            opt = hp.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                          compression=codec)
        else:
            hp.init(**base, **{"compression.algorithm": codec})
            opt = hp.DistributedOptimizer(opt, named_parameters=model.named_parameters())
        hp.broadcast_parameters(model.state_dict(), root_rank=0)
        if not args.sync_only:
            step = opt.step

        def finish() -> None:
            info.update(hipress_paths(hipress.stats()))
            hp.barrier()
    else:
        raise SystemExit(f"unknown torch system {args.system!r}")

    clock = StepClock()
    loss = torch.zeros(())
    for _ in range(warm + args.iters):
        clock.start()
        if not args.sync_only:
            opt.zero_grad()
            loss = F.cross_entropy(net(x), y)
            loss.backward()
        t_bwd = time.perf_counter()
        step()
        t_end = time.perf_counter()
        clock.stop(compute_s=t_bwd - clock._t0, step_call_s=t_end - t_bwd)
    # pure optimizer update on the same parameters and gradients (first call allocates)
    plain = torch.optim.SGD(params, lr=0.01, momentum=0.9)
    upd = []
    for k in range(args.iters + 1):
        t0 = time.perf_counter()
        plain.step()
        if k:
            upd.append(time.perf_counter() - t0)
    finish()
    info.update(threads=torch.get_num_threads(), warmup_used=warm, loss=float(loss.detach()),
                update_s=sorted(upd)[len(upd) // 2] if upd else None, steps=clock.steps)
    return info


# ----------------------------------------------------------------------------- TensorFlow
def run_tf(args: argparse.Namespace, rank: int, world: int) -> Dict[str, Any]:
    """Train Keras ResNet-50 with ``model.fit``; return this rank's measurements."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import keras
    import numpy as np
    import tensorflow as tf

    if args.torch_threads > 0:
        tf.config.threading.set_intra_op_parallelism_threads(args.torch_threads)
    if args.model != "resnet50":
        raise SystemExit("--tf supports resnet50 only (keras.applications.ResNet50)")
    keras.utils.set_random_seed(0)
    s = args.image_size
    model = keras.applications.ResNet50(weights=None, input_shape=(s, s, 3),
                                        classes=args.num_classes)
    steps = args.warmup + args.iters
    rng = np.random.default_rng(1000 + rank)
    x = rng.standard_normal((steps * args.batch_size, s, s, 3), dtype=np.float32)
    y = rng.integers(0, args.num_classes, steps * args.batch_size).astype(np.int64)
    opt = keras.optimizers.SGD(learning_rate=0.01, momentum=0.9)
    info: Dict[str, Any] = {}
    hp = None
    if args.system == "tf-hipress":
        import hipress.tensorflow as hp

        hp.init(**{"sync.strategy": args.strategy, "compression.algorithm": args.codec,
                   **config_overrides(args.set)})
        opt = hp.DistributedOptimizer(opt)
        hp.broadcast_variables(model.variables, root_rank=0)
    model.compile(optimizer=opt, loss="sparse_categorical_crossentropy", jit_compile=False)
    clock = StepClock()

    class Timer(keras.callbacks.Callback):
        """Times each ``model.fit`` step from the previous step's end to this one's."""

        def on_train_begin(self, logs: Any = None) -> None:
            clock.start()

        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            clock.stop()
            clock.start()

    hist = model.fit(x, y, batch_size=args.batch_size, epochs=1, shuffle=False, verbose=0,
                     callbacks=[Timer()])
    info.update(threads=tf.config.threading.get_intra_op_parallelism_threads() or "tf default",
                warmup_used=args.warmup, loss=float(hist.history["loss"][-1]),
                update_s=None, steps=clock.steps)
    if hp is not None:
        import hipress

        info.update(hipress_paths(hipress.stats()))
        hp.barrier()
        hp.shutdown()
    return info


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run one rank and write ``<json>.rank<R>.json``."""
    args = parse(argv)
    rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", "0"))
    world = int(os.environ.get("OMPI_COMM_WORLD_SIZE", "1"))
    load = [round(v, 2) for v in os.getloadavg()]
    t0 = time.time()
    if args.system.startswith("tf-"):
        info = run_tf(args, rank, world)
    else:
        info = run_torch(args, rank, world)
    info.update(rank=rank, world=world, host=socket.gethostname(), load_at_start=load,
                wall_s=round(time.time() - t0, 2), system=args.system, hook=args.hook,
                codec=args.codec, strategy=args.strategy, model=args.model,
                batch_size=args.batch_size, image_size=args.image_size, iters=args.iters)
    Path(f"{args.json}.rank{rank}.json").write_text(json.dumps(info, indent=1))
    timed = info["steps"][info["warmup_used"]:]
    med = sorted(st["step_s"] for st in timed)[len(timed) // 2] if timed else float("nan")
    what = args.hook if args.system == "ddp" else args.codec
    print(f"rank {rank}/{world} on {info['host']}: {args.system} {what} "
          f"median step {med:.3f} s, threads {info['threads']}, loss {info['loss']:.3f}",
          flush=True)
    if args.system == "ddp":
        sys.stdout.flush()
        # gloo's destructor aborted after PowerSGD hooks (bench/cluster.py); results are
        # written, so leave without tearing it down
        os._exit(0)
    if args.system == "hipress":
        import hipress.torch as hp

        hp.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
