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

import os
import sys
import time

import mxnet as mx
import numpy as np
from mxnet import autograd, gluon

import hipress.mxnet as hp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from digits_common import argument_parser, config_overrides, load_data, shard  # noqa: E402


def parse_args(argv=None):
    return argument_parser(__doc__.split("\n\n")[0]).parse_args(argv)


def to_nchw(x: np.ndarray, y: np.ndarray):
    """Return images as float32 (n, 1, 8, 8) and labels as float32 (Gluon's loss wants them)."""
    return x.reshape(-1, 1, 8, 8).astype(np.float32), y.astype(np.float32)


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
    (x_tr, y_tr), (x_te, y_te) = to_nchw(x_tr, y_tr), to_nchw(x_te, y_te)
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
