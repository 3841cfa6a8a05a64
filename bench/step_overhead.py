r"""What HiPress adds to a training step, on localhost: the framework step and the core alone.

Two measurements, each a median over ``--iters`` after ``--warmup``, slowest rank:

- ``--part step``: a plain PyTorch step (forward, backward, SGD update; no
  synchronization) against the same step with ``hipress.torch.DistributedOptimizer`` and
  each ``--codecs`` entry (``none`` = uncompressed). ms per step and the ratio to the plain
  step measured in the same process, interleaved with it step by step.
  With ``--tf`` / ``--mxnet`` the same for a Keras ``GradientTape`` step and a Gluon
  ``Trainer`` step.
- ``--part core``: the core alone: ``hipress.allreduce_async`` of a model's gradient set
  (``hipress/data/gradients/<model>.json``, NumPy float32) then ``synchronize``, per codec,
  against ``np.copyto`` of the same bytes (a memory copy, the floor of any runtime that
  touches every gradient once) and, at world size > 1, against ``MPI.Allreduce`` of
  the same bytes in one buffer (``mpi allreduce``, the transport's own floor for the
  uncompressed row). Each codec runs twice: results in new arrays, and
  ``inplace=True`` (results written into the gradients, as the adapters submit them;
  averaging in place changes the values each iteration, which changes nothing in cost).
- ``--part latency``: one ``hipress.allreduce`` of 4 float32 values (a negotiation round
  plus a transfer: the engine's fixed cost per round trip) against ``MPI.Allreduce`` of
  the same array; median over ``--iters`` x 50 calls. Not in the default ``--part``.
- ``--part names``: ``--names`` allreduces of 64 float32 values each per step,
  ``allreduce_async`` then ``synchronize`` (the engine's cost per gradient name, with
  almost no bytes); ms per step and us per name, median over ``--iters`` x 4 steps. Not
  in the default ``--part``.

Usage (launches mpirun itself; ``--np 1`` runs in this process)::

    python bench/step_overhead.py --np 1,4 --part step,core
    python bench/step_overhead.py --np 2 --part core --codecs none,onebit
    python bench/step_overhead.py --np 2 --part latency,names

Every row records the 1-minute load average at its start: compare rows of one run only.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "examples" / "torch"))

from sync import DEFAULT_PARAMS as PARAMS  # noqa: E402  (codec settings of bench/sync.py)

CODECS = "none,onebit,tbq,terngrad,dgc,powersgd"


def parse(argv: Any = None) -> argparse.Namespace:
    """Parse the command line."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--np", default="1,4", help="world sizes, comma separated")
    p.add_argument("--part", default="step,core", help="step, core, latency and/or names")
    p.add_argument("--names", default="1,161,1000",
                   help="--part names: allreduces per step, comma separated")
    p.add_argument("--codecs", default=CODECS)
    p.add_argument("--model", default="resnet50", help="model (step) and gradient set (core)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--image-size", type=int, default=64)
    p.add_argument("--iters", type=int, default=7)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--strategy", default="auto", choices=["auto", "ps", "ring"])
    p.add_argument("--tf", action="store_true", help="also the TensorFlow step")
    p.add_argument("--mxnet", default=None, metavar="PYTHON",
                   help="also the MXNet step, run with this interpreter (.venv-mxnet)")
    p.add_argument("--json", default=None, help="write the rows here")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--framework", default="torch", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _csv(text: str) -> List[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def _median_ms(fn: Callable[[], None], iters: int, warmup: int, barrier: Callable[[], None]
               ) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        barrier()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1000.0 * float(np.median(times))


def _slowest(value: float) -> float:
    import hipress

    if hipress.size() == 1:
        return value
    return float(max(hipress.allgather_object(value) if hasattr(hipress, "allgather_object")
                     else _allgather(value)))


def _allgather(value: float) -> List[float]:
    from mpi4py import MPI

    return MPI.COMM_WORLD.allgather(value)


def _barrier() -> None:
    import hipress

    if hipress.size() > 1:
        from mpi4py import MPI

        MPI.COMM_WORLD.Barrier()


# ----------------------------------------------------------------------------- core
def core_rows(args: argparse.Namespace) -> List[Dict[str, Any]]:
    """Time allreduce_async + synchronize of the gradient set per codec (this rank)."""
    import hipress
    from hipress.codecs import get_codec

    spec = json.loads((ROOT / "hipress" / "data" / "gradients" / f"{args.model}.json")
                      .read_text())
    rng = np.random.default_rng(hipress.rank())
    grads = [(g["name"], rng.standard_normal(int(np.prod(g["shape"]))).astype(np.float32)
              .reshape(g["shape"])) for g in spec["gradients"]]
    nbytes = sum(g.nbytes for _, g in grads)
    dst = [np.empty_like(g) for _, g in grads]

    def memcpy() -> None:
        for (_, g), d in zip(grads, dst):
            np.copyto(d, g)

    rows = [{"part": "core", "codec": "memcpy", "ms": _slowest(
        _median_ms(memcpy, args.iters, args.warmup, _barrier))}]
    if hipress.size() > 1:  # the transport's own floor: one MPI allreduce of the same bytes
        from mpi4py import MPI

        flat = np.concatenate([g.reshape(-1) for _, g in grads])
        summed = np.empty_like(flat)
        rows.append({"part": "core", "codec": "mpi allreduce", "ms": _slowest(_median_ms(
            lambda: MPI.COMM_WORLD.Allreduce(flat, summed), args.iters, args.warmup,
            _barrier))})
        del flat, summed
    for codec, inplace in [(c, i) for c in _csv(args.codecs) for i in (False, True)]:
        c = None if codec == "none" else get_codec(codec, **PARAMS.get(codec, {}))
        tag = f"{codec}/"
        work = [(n, g.copy()) for n, g in grads] if inplace else grads

        def sync(c: Any = c, tag: str = tag, work: Any = work, inplace: bool = inplace) -> None:
            hs = [hipress.allreduce_async(g, name=tag + n, codec=c if c is not None else "none",
                                          strategy=None if args.strategy == "auto"
                                          else args.strategy, inplace=inplace)
                  for n, g in work]
            for h in hs:
                hipress.synchronize(h)

        ms = _slowest(_median_ms(sync, args.iters, args.warmup, _barrier))
        rows.append({"part": "core", "codec": codec + (" inplace" if inplace else ""), "ms": ms})
        hipress.reset_state(tag)
    for r in rows:
        r["bytes"] = nbytes
    return rows


def latency_rows(args: argparse.Namespace) -> List[Dict[str, Any]]:
    """Time a tiny allreduce through HiPress against MPI's own (this rank)."""
    import hipress

    x = np.ones(4, np.float32)
    out = np.empty_like(x)
    calls = args.iters * 50

    def hp_once() -> None:
        hipress.allreduce(x, name="latency")

    if hipress.size() > 1:
        from mpi4py import MPI

        def mpi_once() -> None:
            MPI.COMM_WORLD.Allreduce(x, out)
    else:
        def mpi_once() -> None:
            np.copyto(out, x)

    rows = []
    for codec, fn in (("mpi allreduce", mpi_once), ("hipress allreduce", hp_once)):
        ms = _slowest(_median_ms(fn, calls, args.warmup * 10, lambda: None))
        rows.append({"part": "latency", "codec": codec, "ms": ms})
    return rows


def names_rows(args: argparse.Namespace) -> List[Dict[str, Any]]:
    """Time N allreduces of 64 float32 values per step (the engine's cost per name)."""
    import hipress

    rows = []
    for n in (int(v) for v in _csv(args.names)):
        grads = [(f"names{n}/{i}", np.ones(64, np.float32)) for i in range(n)]

        def step(grads: Any = grads) -> None:
            hs = [hipress.allreduce_async(g, name=name, inplace=True) for name, g in grads]
            for h in hs:
                hipress.synchronize(h)

        ms = _slowest(_median_ms(step, args.iters * 4, args.warmup, _barrier))
        rows.append({"part": "names", "codec": f"{n} x 64 floats ({1000 * ms / n:.0f} us/name)",
                     "ms": ms})
    return rows


# ----------------------------------------------------------------------------- torch step
def torch_rows(args: argparse.Namespace) -> List[Dict[str, Any]]:
    """Time a plain PyTorch step against the HiPress step per codec (this rank).

    Each codec gets its own copy of the model (same weights and data), and its steps
    alternate with the plain model's, so both see the same machine load; the plain row is
    the median over all of its interleaved steps.
    """
    import copy

    import torch
    import torch.nn.functional as F  # noqa: N812
    from models import build_model, synthetic_batch

    import hipress
    import hipress.torch as hp

    torch.manual_seed(0)
    model = build_model(args.model, num_classes=1000)
    g = torch.Generator().manual_seed(hipress.rank())
    data, target = synthetic_batch(args.model, args.batch_size, 1000, g,
                                   image_size=args.image_size)

    def make_step(net: Any, opt: Any) -> Callable[[], None]:
        def step() -> None:
            opt.zero_grad()
            F.cross_entropy(net(data), target).backward()
            opt.step()
        return step

    opts: List[Any] = []

    def codec_step(codec: str) -> Callable[[], None]:
        net = copy.deepcopy(model)
        opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
        opts.append(hp.DistributedOptimizer(
            opt, named_parameters=[(f"{codec}/{n}", p) for n, p in net.named_parameters()],
            compression=codec, **PARAMS.get(codec, {})))
        return make_step(net, opts[-1])

    plain = make_step(model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9))
    rows = _interleaved("torch", plain, codec_step, args)
    for opt in opts:
        opt.remove_hooks()
    hipress.reset_state()
    return rows


def tf_rows(args: argparse.Namespace) -> List[Dict[str, Any]]:
    """Time a plain Keras GradientTape step, then the HiPress tape per codec."""
    import tensorflow as tf

    import hipress
    import hipress.tensorflow as hp

    keras = tf.keras
    model = keras.applications.ResNet50(weights=None, input_shape=(args.image_size,
                                                                   args.image_size, 3),
                                        classes=1000)
    rng = np.random.default_rng(hipress.rank())
    x = tf.constant(rng.standard_normal((args.batch_size, args.image_size, args.image_size, 3))
                    .astype(np.float32))
    y = tf.constant(rng.integers(0, 1000, args.batch_size))
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=False)

    def make_step(codec: Any) -> Callable[[], None]:
        opt = keras.optimizers.SGD(0.01, momentum=0.9)

        def step() -> None:
            with tf.GradientTape() as tape:
                loss = loss_fn(y, model(x, training=True))
            if codec is not None:
                tape = hp.DistributedGradientTape(tape, compression=codec,
                                                  **PARAMS.get(codec, {}))
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables))
        return step

    return _interleaved("tensorflow", make_step(None), make_step, args)


def _interleaved(framework: str, plain: Callable[[], None],
                 make_step: Callable[[str], Callable[[], None]],
                 args: argparse.Namespace) -> List[Dict[str, Any]]:
    """Time ``plain`` and each codec's step alternately; return the rows (plain first)."""
    plain_ms: List[float] = []
    rows = []
    for codec in _csv(args.codecs):
        steps = [plain, make_step(codec)]
        times: List[List[float]] = [[], []]
        for i in range(args.warmup + args.iters):
            for k, fn in enumerate(steps):
                _barrier()
                t0 = time.perf_counter()
                fn()
                if i >= args.warmup:
                    times[k].append(1000.0 * (time.perf_counter() - t0))
        plain_ms += times[0]
        rows.append({"part": "step", "framework": framework, "codec": codec,
                     "ms": _slowest(float(np.median(times[1]))),
                     "plain_ms": _slowest(float(np.median(times[0])))})
    rows.insert(0, {"part": "step", "framework": framework, "codec": "plain",
                    "ms": _slowest(float(np.median(plain_ms)))})
    return rows


def mxnet_rows(args: argparse.Namespace) -> List[Dict[str, Any]]:
    """Time a plain Gluon Trainer step, then the HiPress trainer per codec."""
    import mxnet as mx
    from mxnet import autograd, gluon

    import hipress
    import hipress.mxnet as hp

    zoo = {"resnet50": "resnet50_v1", "vgg19": "vgg19"}  # Gluon's names
    net = gluon.model_zoo.vision.get_model(zoo.get(args.model, args.model), classes=1000)
    net.initialize(mx.init.Xavier())
    rng = np.random.default_rng(hipress.rank())
    x = mx.nd.array(rng.standard_normal((args.batch_size, 3, args.image_size, args.image_size)))
    y = mx.nd.array(rng.integers(0, 1000, args.batch_size))
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    net(x)

    def make_step(trainer: Any) -> Callable[[], None]:
        def step() -> None:
            with autograd.record():
                loss = loss_fn(net(x), y)
            loss.backward()
            trainer.step(args.batch_size)
            mx.nd.waitall()
        return step

    def codec_step(codec: str) -> Callable[[], None]:
        return make_step(hp.DistributedTrainer(net.collect_params(), "sgd",
                                               {"learning_rate": 0.01, "momentum": 0.9},
                                               compression=codec, **PARAMS.get(codec, {})))

    plain = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.01, "momentum": 0.9})
    return _interleaved("mxnet", make_step(plain), codec_step, args)


def worker(args: argparse.Namespace) -> None:
    """One rank: run the asked parts, print the rows as one JSON line on rank 0."""
    import hipress

    hipress.init(**{"sync.strategy": args.strategy})
    rows: List[Dict[str, Any]] = []
    parts = _csv(args.part)
    if "step" in parts:
        if args.framework == "torch":
            rows += torch_rows(args)
        if args.framework == "tensorflow":
            rows += tf_rows(args)
        if args.framework == "mxnet":
            rows += mxnet_rows(args)
    if "core" in parts and args.framework == "torch":
        rows += core_rows(args)
    if "latency" in parts and args.framework == "torch":
        rows += latency_rows(args)
    if "names" in parts and args.framework == "torch":
        rows += names_rows(args)
    if hipress.rank() == 0:
        print("ROWS " + json.dumps(rows), flush=True)
    hipress.shutdown()


# ----------------------------------------------------------------------------- driver
def run(args: argparse.Namespace, np_: int, framework: str, python: str) -> List[Dict[str, Any]]:
    """Run one worker job (mpirun unless ``np_`` is 1) and return its rows."""
    argv = [python, str(Path(__file__).resolve()), "--worker", "--framework", framework,
            "--part", args.part, "--codecs", args.codecs, "--model", args.model,
            "--batch-size", str(args.batch_size), "--image-size", str(args.image_size),
            "--iters", str(args.iters), "--warmup", str(args.warmup),
            "--strategy", args.strategy]
    if np_ > 1:
        mpirun = str(Path(python).parent / "mpirun")
        argv = [mpirun if os.path.exists(mpirun) else "mpirun", "-np", str(np_),
                "--oversubscribe"] + argv
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    load = os.getloadavg()[0]
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=1800)
    rows: List[Dict[str, Any]] = []
    for line in proc.stdout.splitlines():
        if line.startswith("ROWS ") or "ROWS [" in line:
            rows = json.loads(line[line.index("ROWS ") + 5:])
    if proc.returncode != 0 or not rows:
        print(proc.stdout[-3000:], proc.stderr[-3000:], sep="\n", file=sys.stderr)
        return [{"framework": framework, "np": np_, "error": proc.returncode}]
    for r in rows:
        r.update(np=np_, load=load, framework=r.get("framework", framework))
    return rows


def table(rows: List[Dict[str, Any]]) -> str:
    """Format the rows with ratios to the plain step / the memcpy of the same run."""
    lines = ["| part | framework | np | codec | ms | ratio | load |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| | {r['framework']} | {r['np']} | FAILED rc={r['error']} | | | |")
            continue
        base_name = {"step": "plain", "latency": "mpi allreduce"}.get(r["part"], "memcpy")
        base = [b for b in rows if "error" not in b and b["part"] == r["part"]
                and b["np"] == r["np"] and b["framework"] == r["framework"]
                and b["codec"] == base_name]
        ref = r.get("plain_ms") or (base[0]["ms"] if base else None)
        ratio = f"{r['ms'] / ref:.2f}x" if ref and r["codec"] != base_name else ""
        lines.append(f"| {r['part']} | {r['framework'] if r['part'] == 'step' else 'numpy'} | "
                     f"{r['np']} | {r['codec']} | {r['ms']:.1f} | {ratio} | {r['load']:.1f} |")
    return "\n".join(lines)


def main(argv: Any = None) -> int:
    """Run every asked world size and framework, print the table."""
    args = parse(argv)
    if args.worker:
        worker(args)
        return 0
    rows: List[Dict[str, Any]] = []
    for np_ in (int(v) for v in _csv(args.np)):
        rows += run(args, np_, "torch", sys.executable)
        if args.tf and "step" in _csv(args.part):
            rows += run(argparse.Namespace(**{**vars(args), "part": "step"}), np_,
                        "tensorflow", sys.executable)
        if args.mxnet and "step" in _csv(args.part):
            rows += run(argparse.Namespace(**{**vars(args), "part": "step"}), np_, "mxnet",
                        args.mxnet)
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
