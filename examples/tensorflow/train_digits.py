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

import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import hipress.tensorflow as hp  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from digits_common import argument_parser, config_overrides, load_data, shard  # noqa: E402


def parse_args(argv=None):
    p = argument_parser(__doc__.split("\n\n")[0])
    p.add_argument("--loop", choices=["fit", "tape"], default="fit",
                   help="model.fit + DistributedOptimizer, or a custom tf.function step with "
                   "DistributedGradientTape")
    return p.parse_args(argv)


def to_nhwc(x: np.ndarray, y: np.ndarray):
    """Return images as float32 (n, 8, 8, 1) and labels as int64."""
    return x.reshape(-1, 8, 8, 1).astype(np.float32), y.astype(np.int64)


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
    (x_tr, y_tr), (x_te, y_te) = to_nhwc(x_tr, y_tr), to_nhwc(x_te, y_te)
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
