r"""Synthetic training throughput with HiPress, after Horovod's pytorch_synthetic_benchmark.py.

Random images and labels, a standard model (ResNet-50 by default, defined in models.py
with torchvision's parameter names), data-parallel training with HiPress. For each
``--compression`` value it runs warm-up batches, then ``--num-iters`` timed iterations of
``--num-batches-per-iter`` batches, and prints images/s per rank and in total::

    mpirun -np 4 python examples/torch/synthetic_benchmark.py --model resnet50 \
        --batch-size 32 --compression none onebit dgc powersgd

On a small CPU machine use a smaller problem, e.g.
``--model resnet18 --image-size 64 --batch-size 8 --num-iters 3``.

The compression policy outside the codec name (``min_compress_bytes``, rules, memory,
warm-up, strategy) comes from the job config (``HIPRESS_CONFIG`` / ``hipressrun --config``)
and ``--min-compress-bytes`` / ``--strategy``.
"""

from __future__ import annotations

import argparse
import os
import sys
import timeit

import numpy as np
import torch
import torch.nn.functional as F  # noqa: N812

import hipress
import hipress.torch as hp
from hipress.adapter_common import parse_params

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from models import MODELS, build_model, input_shape, synthetic_batch  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="resnet50", choices=sorted(MODELS))
    p.add_argument("--batch-size", type=int, default=32, help="images per rank per batch")
    p.add_argument("--image-size", type=int, default=224, help="height = width of the images")
    p.add_argument("--num-classes", type=int, default=1000)
    p.add_argument("--num-warmup-batches", type=int, default=10)
    p.add_argument("--num-batches-per-iter", type=int, default=10)
    p.add_argument("--num-iters", type=int, default=10)
    p.add_argument("--compression", nargs="+", default=["none"],
                   help="one or more codec names; each is benchmarked in turn")
    p.add_argument("--param", action="append", default=[], metavar="KEY=VALUE",
                   help="codec parameter for every --compression, repeatable")
    p.add_argument("--min-compress-bytes", type=int, default=None)
    p.add_argument("--strategy", default=None, choices=["auto", "ps", "ring"])
    p.add_argument("--backward-passes-per-step", type=int, default=1)
    p.add_argument("--no-cuda", action="store_true", help="stay on the CPU even with a GPU")
    return p.parse_args(argv)


def log(msg: str) -> None:
    if hp.rank() == 0:
        print(msg, flush=True)


def benchmark(args, model, compression: str, device: torch.device) -> float:
    """Return the mean images/s per rank of one configuration (and print the details)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    opt = hp.DistributedOptimizer(
        opt,
        named_parameters=[(f"{compression}/{n}", p) for n, p in model.named_parameters()],
        compression=compression,
        backward_passes_per_step=args.backward_passes_per_step,
        **parse_params(args.param),
    )
    hp.broadcast_parameters(model.state_dict(), root_rank=0)
    g = torch.Generator().manual_seed(hp.rank())
    data, target = synthetic_batch(args.model, args.batch_size, args.num_classes, g,
                                   image_size=args.image_size)
    data, target = data.to(device), target.to(device)

    def step():
        opt.zero_grad()
        for _ in range(args.backward_passes_per_step):
            F.cross_entropy(model(data), target).backward()
        opt.step()

    log(f"[{compression}] running {args.num_warmup_batches} warm-up batches...")
    timeit.timeit(step, number=args.num_warmup_batches)
    rates = []
    for i in range(args.num_iters):
        secs = timeit.timeit(step, number=args.num_batches_per_iter)
        rate = args.batch_size * args.backward_passes_per_step * args.num_batches_per_iter / secs
        rates.append(rate)
        log(f"[{compression}] iter #{i}: {rate:.1f} img/sec per rank")
    opt.remove_hooks()
    mean, conf = float(np.mean(rates)), float(1.96 * np.std(rates))
    log(f"[{compression}] img/sec per rank: {mean:.1f} +-{conf:.1f}")
    log(f"[{compression}] total img/sec on {hp.size()} rank(s): {hp.size() * mean:.1f} "
        f"+-{hp.size() * conf:.1f}")
    return mean


def main(argv=None) -> None:
    args = parse_args(argv)
    overrides = {}
    if args.min_compress_bytes is not None:
        overrides["compression.min_compress_bytes"] = args.min_compress_bytes
    if args.strategy is not None:
        overrides["sync.strategy"] = args.strategy
    hp.init(**overrides)
    cuda = torch.cuda.is_available() and not args.no_cuda
    device = torch.device("cuda", hp.local_rank()) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    torch.manual_seed(0)
    model = build_model(args.model, num_classes=args.num_classes).to(device)
    nparams = sum(p.numel() for p in model.parameters())
    shape = "x".join(map(str, input_shape(args.model, args.image_size)))
    log(f"model {args.model} ({nparams / 1e6:.2f}M parameters), batch {args.batch_size} x "
        f"{shape}, {hp.size()} rank(s) on {device.type}")
    results = {}
    for compression in args.compression:
        results[compression] = benchmark(args, model, compression, device)
    log("summary (img/sec per rank / total):")
    for compression, rate in results.items():
        ratios = [s.get("compression_ratio", 1.0) for n, s in hipress.stats().items()
                  if n.startswith(f"{compression}/")]
        log(f"  {compression:>10}: {rate:8.1f} / {hp.size() * rate:8.1f}   "
            f"mean compression ratio over tensors x{np.mean(ratios) if ratios else 1.0:.1f}")
    hp.shutdown()


if __name__ == "__main__":
    main()
