"""Train a small CNN on scikit-learn's handwritten digits with HiPress and MXNet Gluon.

The MXNet twin of ``examples/torch/train_digits.py``: the same data split, model shape
(two 3x3 convolutions, a max-pool, two dense layers; about 38k parameters), optimizer
(SGD, lr 0.05, momentum 0.9), batch size, epochs and output lines, so the accuracy tables
of the frameworks compare. The training set is split across ranks; every rank evaluates
its share of the test set and the counts are summed.

MXNet 1.9 needs NumPy < 1.24, so it runs from its own virtualenv (``make venv-mxnet``)::

    hipressrun -np 4 --config configs/digits-mxnet.yaml      # with .venv-mxnet/bin on PATH
    .venv-mxnet/bin/mpirun -np 4 .venv-mxnet/bin/python examples/mxnet/train_digits.py

Rank 0 prints one line per epoch (``epoch 3/5 loss 0.1234 test_acc 97.50%``) and a final
summary naming the codec each tensor got. Precedence of the compression settings:
defaults < YAML (``HIPRESS_CONFIG``, set by ``hipressrun --config``) < ``HIPRESS_*``
environment < this script's flags (as in the PyTorch example).
"""

from __future__ import annotations

import argparse
import sys
import time

import mxnet as mx
import numpy as np
from mxnet import autograd, gluon

import hipress.mxnet as hp
from hipress.adapter_common import parse_params


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--epochs", type=int, default=8, help="passes over the training set")
    p.add_argument("--batch-size", type=int, default=16, help="samples per rank per step")
    p.add_argument("--lr", type=float, default=0.05, help="SGD learning rate")
    p.add_argument("--momentum", type=float, default=0.9,
                   help="SGD momentum (use 0 with --memory dgc, which applies DGC's momentum "
                   "correction itself)")
    p.add_argument("--compression", default=None,
                   help="codec name (none, onebit, tbq, terngrad, dgc, graddrop, powersgd, "
                   "fp16, topk, ...); default: the config's compression.algorithm")
    p.add_argument("--param", action="append", default=[], metavar="KEY=VALUE",
                   help="codec parameter, repeatable (e.g. --param ratio=0.01)")
    p.add_argument("--min-compress-bytes", type=int, default=None,
                   help="tensors smaller than this go uncompressed (config default: 65536)")
    p.add_argument("--warmup-steps", type=int, default=None,
                   help="first N steps run uncompressed (config default: 0)")
    p.add_argument("--memory", default=None, choices=["auto", "none", "residual", "dgc"],
                   help="error feedback (config default: auto = residual for biased codecs)")
    p.add_argument("--test-fraction", type=float, default=0.25, help="share held out for test")
    p.add_argument("--seed", type=int, default=42, help="seed of the split, init and shuffles")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on rank 0")
    return p.parse_args(argv)


def config_overrides(args) -> dict:
    """Return the dotted config overrides the command line asks for."""
    out = {}
    if args.compression is not None:
        out["compression.algorithm"] = args.compression
        out["compression.params"] = parse_params(args.param)
    elif args.param:
        out["compression.params"] = parse_params(args.param)
    if args.min_compress_bytes is not None:
        out["compression.min_compress_bytes"] = args.min_compress_bytes
    if args.warmup_steps is not None:
        out["compression.warmup_steps"] = args.warmup_steps
    if args.memory is not None:
        out["compression.memory"] = args.memory
    return out


def load_data(test_fraction: float, seed: int):
    """Return standardized (x_train, y_train, x_test, y_test); images are 1x8x8 (NCHW)."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x_tr, x_te, y_tr, y_te = train_test_split(x.astype(np.float32), y, test_size=test_fraction,
                                              random_state=seed, stratify=y)
    mean, std = x_tr.mean(), x_tr.std()

    def prep(a, b):
        return ((a - mean) / std).reshape(-1, 1, 8, 8).astype(np.float32), b.astype(np.float32)

    return (*prep(x_tr, y_tr), *prep(x_te, y_te))


def shard(n: int, epoch: int, seed: int, rank: int, size: int) -> np.ndarray:
    """Return this rank's sample indices for ``epoch``: equal counts on every rank."""
    perm = np.random.default_rng(seed * 1000 + epoch).permutation(n)
    return perm[rank::size][: n // size]


def digits_cnn(num_classes: int = 10, width: int = 16) -> gluon.nn.HybridSequential:
    """Return the digits CNN; parameters ``digits_conv1_weight`` ... ``digits_fc2_bias``."""
    net = gluon.nn.HybridSequential(prefix="digits_")
    with net.name_scope():
        net.add(
            gluon.nn.Conv2D(width, 3, padding=1, in_channels=1, activation="relu",
                            prefix="conv1_"),
            gluon.nn.Conv2D(2 * width, 3, padding=1, in_channels=width, activation="relu",
                            prefix="conv2_"),
            gluon.nn.MaxPool2D(2),
            gluon.nn.Flatten(),
            gluon.nn.Dense(64, in_units=2 * width * 16, activation="relu", prefix="fc1_"),
            gluon.nn.Dense(num_classes, in_units=64, prefix="fc2_"),
        )
    return net


def main(argv=None) -> float:
    args = parse_args(argv)
    hp.init(**config_overrides(args))
    rank, size = hp.rank(), hp.size()

    x_tr, y_tr, x_te, y_te = load_data(args.test_fraction, args.seed)
    mx.random.seed(args.seed)
    net = digits_cnn()
    net.initialize(mx.init.Xavier(), ctx=mx.cpu())
    net.hybridize()
    params = net.collect_params()
    hp.broadcast_parameters(params, root_rank=0)
    trainer = hp.DistributedTrainer(params, "sgd",
                                    {"learning_rate": args.lr, "momentum": args.momentum})
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()

    progress = None
    if rank == 0 and not args.no_progress:
        try:
            from tqdm import tqdm

            progress = tqdm
        except ImportError:
            progress = None

    start = time.perf_counter()
    acc = 0.0
    for epoch in range(1, args.epochs + 1):
        idx = shard(len(x_tr), epoch, args.seed, rank, size)
        batches = [idx[s:s + args.batch_size] for s in range(0, len(idx), args.batch_size)]
        it = batches
        if progress is not None:
            it = progress(batches, desc=f"epoch {epoch}/{args.epochs}", leave=False,
                          unit="batch", file=sys.stderr)
        loss_sum = 0.0
        for b in it:
            xb, yb = mx.nd.array(x_tr[b]), mx.nd.array(y_tr[b])
            with autograd.record():
                loss = loss_fn(net(xb), yb)
            loss.backward()
            trainer.step(len(b))  # the mean over the batch: rescale_grad = 1 / len(b)
            loss_sum += float(loss.sum().asscalar())
        xs, ys = x_te[rank::size], y_te[rank::size]
        logits = net(mx.nd.array(xs)).asnumpy()
        correct = int(np.sum(logits.argmax(1) == ys))
        # metrics are summed exactly: never compressed, whatever the config says
        totals = hp.allreduce(mx.nd.array([loss_sum, len(idx), correct, len(ys)],
                                          dtype="float64"),
                              name=f"metrics.epoch{epoch}", op=hp.Sum,
                              compression="none").asnumpy()
        train_loss = totals[0] / totals[1]
        acc = 100.0 * totals[2] / totals[3]
        if rank == 0:
            print(f"epoch {epoch}/{args.epochs} loss {train_loss:.4f} test_acc {acc:.2f}%",
                  flush=True)
    elapsed = time.perf_counter() - start
    if rank == 0:
        import hipress

        codecs = sorted(
            f"{n}={s['codec']}" + (f"(x{s.get('compression_ratio', 1):.1f})"
                                   if s["codec"] != "none" else "")
            for n, s in hipress.stats().items()
            if not n.startswith(("metrics.", "broadcast", "optimizer_state", "__")))
        print(f"final test_acc {acc:.2f}% ranks {size} time {elapsed:.1f}s codecs "
              f"{' '.join(codecs)}", flush=True)
    hp.shutdown()
    return acc


if __name__ == "__main__":
    main()
