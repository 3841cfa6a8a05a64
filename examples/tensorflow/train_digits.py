"""Train a small CNN on scikit-learn's handwritten digits with HiPress and TensorFlow/Keras.

The TensorFlow twin of ``examples/torch/train_digits.py``: the same data split, model
shape (two 3x3 convolutions, a max-pool, two dense layers; about 38k parameters),
optimizer (SGD, lr 0.05, momentum 0.9), batch size, epochs and output lines, so the
accuracy tables of the frameworks compare. The training set is split across ranks; every
rank evaluates its share of the test set and the counts are summed.

Run it with the launcher and a job config (compression and sync policy from the YAML)::

    hipressrun -np 4 --config configs/digits-tf.yaml

or directly under MPI::

    mpirun -np 4 python examples/tensorflow/train_digits.py --compression onebit
    mpirun -np 4 python examples/tensorflow/train_digits.py --loop tape --compression none

``--loop fit`` (default) trains with ``model.fit`` and ``hp.DistributedOptimizer``;
``--loop tape`` runs a custom ``tf.function`` step with ``hp.DistributedGradientTape``.
Both cross to HiPress through one ``tf.py_function`` per step. Rank 0 prints one line per
epoch (``epoch 3/5 loss 0.1234 test_acc 97.50%``) and a final summary naming the codec
each tensor got. Precedence of the compression settings: defaults < YAML
(``HIPRESS_CONFIG``, set by ``hipressrun --config``) < ``HIPRESS_*`` environment < this
script's flags (as in the PyTorch example).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import hipress.tensorflow as hp  # noqa: E402
from hipress.adapter_common import parse_params  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--epochs", type=int, default=8, help="passes over the training set")
    p.add_argument("--batch-size", type=int, default=16, help="samples per rank per step")
    p.add_argument("--lr", type=float, default=0.05, help="SGD learning rate")
    p.add_argument("--momentum", type=float, default=0.9,
                   help="SGD momentum (use 0 with --memory dgc, which applies DGC's momentum "
                   "correction itself)")
    p.add_argument("--loop", choices=["fit", "tape"], default="fit",
                   help="model.fit + DistributedOptimizer, or a custom tf.function step with "
                   "DistributedGradientTape")
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
    """Return standardized (x_train, y_train, x_test, y_test); images are 8x8x1 (NHWC)."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x_tr, x_te, y_tr, y_te = train_test_split(x.astype(np.float32), y, test_size=test_fraction,
                                              random_state=seed, stratify=y)
    mean, std = x_tr.mean(), x_tr.std()

    def prep(a, b):
        return ((a - mean) / std).reshape(-1, 8, 8, 1).astype(np.float32), b.astype(np.int64)

    return (*prep(x_tr, y_tr), *prep(x_te, y_te))


def shard(n: int, epoch: int, seed: int, rank: int, size: int) -> np.ndarray:
    """Return this rank's sample indices for ``epoch``: equal counts on every rank."""
    perm = np.random.default_rng(seed * 1000 + epoch).permutation(n)
    return perm[rank::size][: n // size]


def digits_cnn(num_classes: int = 10, width: int = 16) -> keras.Model:
    """Return the digits CNN (layer names conv1, conv2, fc1, fc2 as in the torch model)."""
    return keras.Sequential([
        keras.Input((8, 8, 1)),
        keras.layers.Conv2D(width, 3, padding="same", activation="relu", name="conv1"),
        keras.layers.Conv2D(2 * width, 3, padding="same", activation="relu", name="conv2"),
        keras.layers.MaxPooling2D(2),
        keras.layers.Flatten(),
        keras.layers.Dense(64, activation="relu", name="fc1"),
        keras.layers.Dense(num_classes, name="fc2"),
    ], name="digits")


class _Progress(keras.callbacks.Callback):
    """A tqdm bar per epoch on stderr (rank 0)."""

    def __init__(self, tqdm, steps: int, desc: str) -> None:
        super().__init__()
        self.bar = tqdm(total=steps, desc=desc, leave=False, unit="batch", file=sys.stderr)

    def on_train_batch_end(self, batch, logs=None):
        self.bar.update(1)

    def on_train_end(self, logs=None):
        self.bar.close()


def main(argv=None) -> float:
    args = parse_args(argv)
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    hp.init(**config_overrides(args))
    rank, size = hp.rank(), hp.size()

    x_tr, y_tr, x_te, y_te = load_data(args.test_fraction, args.seed)
    keras.utils.set_random_seed(args.seed)
    model = digits_cnn()
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    base = keras.optimizers.SGD(learning_rate=args.lr, momentum=args.momentum)
    hp.broadcast_variables(model.variables, root_rank=0)

    if args.loop == "fit":
        opt = hp.DistributedOptimizer(base)
        model.compile(optimizer=opt, loss=loss_fn, jit_compile=False)
    else:
        opt = base

        @tf.function
        def train_step(x, y):
            with tf.GradientTape() as tape:
                loss = loss_fn(y, model(x, training=True))
            tape = hp.DistributedGradientTape(tape)
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables))
            return loss

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
        steps = -(-len(idx) // args.batch_size)
        desc = f"epoch {epoch}/{args.epochs}"
        if args.loop == "fit":
            cbs = [_Progress(progress, steps, desc)] if progress is not None else []
            hist = model.fit(x_tr[idx], y_tr[idx], batch_size=args.batch_size, epochs=1,
                             shuffle=False, verbose=0, callbacks=cbs)
            loss_sum = hist.history["loss"][0] * len(idx)
        else:
            bar = progress(total=steps, desc=desc, leave=False, unit="batch",
                           file=sys.stderr) if progress is not None else None
            loss_sum = 0.0
            for s in range(0, len(idx), args.batch_size):
                b = idx[s:s + args.batch_size]
                loss_sum += float(train_step(x_tr[b], y_tr[b])) * len(b)
                if bar is not None:
                    bar.update(1)
            if bar is not None:
                bar.close()
        xs, ys = x_te[rank::size], y_te[rank::size]
        logits = model(xs, training=False)
        correct = int(np.sum(np.argmax(logits.numpy(), 1) == ys))
        test_loss = float(loss_fn(ys, logits)) * len(ys)
        del test_loss  # the torch example reports the training loss; kept for symmetry
        # metrics are summed exactly: never compressed, whatever the config says
        totals = hp.allreduce(tf.constant([loss_sum, len(idx), correct, len(ys)], tf.float64),
                              name=f"metrics.epoch{epoch}", op=hp.Sum,
                              compression="none").numpy()
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
