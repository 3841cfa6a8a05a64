"""MPI worker for tests/test_keras_callbacks.py: the Keras callbacks of hipress.tensorflow.

Usage: mpirun -np N python tests/workers/keras_callbacks.py case1,case2,...

Every case runs a real ``model.fit`` with ``hp.DistributedOptimizer`` on small random
data that differs per rank, and prints ``PASS <case> rank <r>`` or ``FAIL <case> rank <r>``
with the traceback; the worker exits 1 if any case failed.
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import behaviour_suite as suite  # noqa: E402

import hipress  # noqa: E402
import hipress.tensorflow as hp  # noqa: E402

tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)

CASES = {}


def case(fn):
    CASES[fn.__name__] = fn
    return fn


# ------------------------------------------------------------------------- helpers
def data(seed: int, n: int = 40):
    """Return (x, y) regression data of ``n`` samples, different for each seed."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, 4)).astype(np.float32)
    y = (x @ np.arange(1.0, 5.0, dtype=np.float32)[:, None] + rng.standard_normal((n, 1))
         .astype(np.float32))
    return x, y


def model_with(opt, metrics=()):
    """Return a compiled two-layer model (same initial weights on every rank)."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"),
                              keras.layers.Dense(1)])
    model.compile(optimizer=opt, loss="mse", metrics=list(metrics), jit_compile=False)
    return model


def gather(obj, what):
    """Return ``[obj of rank 0, obj of rank 1, ...]`` on every rank."""
    return [hipress.broadcast_object(obj if hp.rank() == r else None, root=r,
                                     name=f"kcb.gather.{what}.{r}") for r in range(hp.size())]


class Capture(keras.callbacks.Callback):
    """Keep a copy of the logs of every epoch end (as this callback sees them)."""

    def __init__(self):
        super().__init__()
        self.epochs = []

    def on_epoch_end(self, epoch, logs=None):
        self.epochs.append(dict(logs))


class Inject(keras.callbacks.Callback):
    """Add entries (a dict per epoch, or a function of the epoch) to the epoch-end logs."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def on_epoch_end(self, epoch, logs=None):
        logs.update(self.fn(epoch))


def warmup_lr(initial_lr, size, steps, warmup_epochs, k):
    """Horovod's warm-up formula for global batch ``k`` (reference for the callback)."""
    if k >= steps * warmup_epochs:
        return initial_lr
    return initial_lr / size * (1.0 + (k + 1) * (size - 1) / (steps * warmup_epochs))


class LrRecorder(keras.callbacks.Callback):
    """Record the learning rate (and momentum) seen at each batch begin and end."""

    def __init__(self):
        super().__init__()
        self.begin, self.end, self.mom_begin, self.mom_end = [], [], [], []

    def _read(self):
        opt = self.model.optimizer
        mom = getattr(opt, "momentum", None)
        return (float(keras.ops.convert_to_numpy(opt.learning_rate)),
                None if mom is None else float(keras.ops.convert_to_numpy(mom)))

    def on_train_batch_begin(self, batch, logs=None):
        lr, mom = self._read()
        self.begin.append(lr)
        self.mom_begin.append(mom)

    def on_train_batch_end(self, batch, logs=None):
        lr, mom = self._read()
        self.end.append(lr)
        self.mom_end.append(mom)


class VariableMomentumSGD(keras.optimizers.Optimizer):
    """SGD with momentum held in a variable (so the warm-up's momentum correction applies).

    ``v = momentum * v - lr * g; w += v`` (Keras's SGD rule, without Nesterov).
    """

    def __init__(self, learning_rate=0.01, momentum=0.9, name="vm_sgd", **kwargs):
        super().__init__(learning_rate=learning_rate, name=name, **kwargs)
        self._momentum_value = momentum

    def get_config(self):
        return {**super().get_config(), "momentum": self._momentum_value}

    def build(self, variables):
        if self.built:
            return
        super().build(variables)
        self.momentum = self.add_variable((), initializer=keras.initializers.Constant(
            self._momentum_value), name="momentum_coefficient")
        self.velocities = self.add_optimizer_variables(variables, "velocity")

    def update_step(self, gradient, variable, learning_rate):
        v = self.velocities[self._get_variable_index(variable)]
        lr = keras.ops.cast(learning_rate, variable.dtype)
        mom = keras.ops.cast(self.momentum, variable.dtype)
        self.assign(v, keras.ops.subtract(keras.ops.multiply(v, mom),
                                          keras.ops.multiply(gradient, lr)))
        self.assign_add(variable, v)


def expect_raises(exc_type, match, fn):
    try:
        fn()
    except exc_type as exc:
        assert match in str(exc), (match, str(exc))
    else:
        raise AssertionError(f"expected {exc_type.__name__} with {match!r}")


# -------------------------------------------------------------------------- cases
@case
def metric_average():
    """Epoch logs become the exact average of every rank's own values, on every rank."""
    rank, size = hp.rank(), hp.size()
    x, y = data(rank)
    xv, yv = data(100 + rank, n=16)
    model = model_with(hp.DistributedOptimizer(keras.optimizers.SGD(0.01)), metrics=["mae"])
    extra = Inject(lambda e: {"count": rank + e, "f32": np.float32(0.25 * rank),
                              "note": f"rank{rank}", "flag": True, "none": None,
                              "vec": np.array([1.0, 2.0 + rank]), "text_num": "1.5"})
    pre, post = Capture(), Capture()
    hist = model.fit(x, y, batch_size=8, epochs=3, verbose=0, shuffle=False,
                     validation_data=(xv, yv),
                     callbacks=[hp.BroadcastGlobalVariablesCallback(0), extra, pre,
                                hp.MetricAverageCallback(), post])
    numeric = {"loss", "mae", "val_loss", "val_mae", "count", "f32"}
    everyone = gather(pre.epochs, "pre")
    if size > 1:  # the ranks' own values differ, so the test means something
        assert everyone[0][0]["val_loss"] != everyone[1][0]["val_loss"], everyone
    for epoch, logs in enumerate(post.epochs):
        assert set(logs) == set(pre.epochs[epoch]), (sorted(logs), sorted(pre.epochs[epoch]))
        for key in numeric:
            acc = float(everyone[0][epoch][key])
            for r in range(1, size):
                acc += float(everyone[r][epoch][key])
            want = acc / size  # the engine's exact average: sum in rank order, then / N
            assert isinstance(logs[key], float) and logs[key] == want, (epoch, key, logs[key],
                                                                        want)
            assert hist.history[key][epoch] == want, (key, hist.history[key], want)
        for key in set(logs) - numeric:  # non-numeric entries are this rank's, untouched
            assert logs[key] is pre.epochs[epoch][key], (key, logs[key])
    suite.same_on_every_rank({k: np.array([e[k] for e in post.epochs]) for k in numeric},
                             "kcb.post")


@case
def metric_average_empty_logs():
    """Logs without numbers (or no logs) cost no collective and change nothing."""
    cb = hp.MetricAverageCallback()
    logs = {"note": "x", "flag": False}
    cb.on_epoch_end(0, logs)
    cb.on_epoch_end(0, None)
    cb.on_epoch_end(0, {})
    assert logs == {"note": "x", "flag": False}, logs


@case
def lr_warmup():
    """The learning rate follows the linear formula per batch, then stays at initial_lr."""
    rank, size = hp.rank(), hp.size()
    x, y = data(rank)  # 40 samples / batch 8: 5 steps per epoch, from Keras
    initial_lr = 0.01 * size
    model = model_with(hp.DistributedOptimizer(keras.optimizers.SGD(initial_lr, momentum=0.9)))
    rec = LrRecorder()
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("hipress.tensorflow.callbacks").addHandler(handler)
    try:
        model.fit(x, y, batch_size=8, epochs=3, verbose=0, shuffle=False,
                  callbacks=[hp.BroadcastGlobalVariablesCallback(0),
                             hp.LearningRateWarmupCallback(initial_lr, warmup_epochs=2), rec])
    finally:
        logging.getLogger("hipress.tensorflow.callbacks").removeHandler(handler)
    want = [warmup_lr(initial_lr, size, 5, 2, k) for k in range(15)]
    # float32 variable: the values agree to its rounding
    np.testing.assert_allclose(rec.begin, want, rtol=1e-6, atol=0)
    np.testing.assert_allclose(rec.end, want, rtol=1e-6, atol=0)
    np.testing.assert_allclose(rec.begin[0], initial_lr / size * (1 + (size - 1) / 10),
                               rtol=1e-6)
    assert rec.begin[9] == np.float32(initial_lr), rec.begin  # last warm-up batch: exact
    assert all(v == np.float32(initial_lr) for v in rec.begin[10:]), rec.begin
    assert rec.mom_begin == [0.9] * 15, rec.mom_begin  # a float momentum is left alone
    warned = [r for r in records if "momentum correction skipped" in r.getMessage()]
    assert len(warned) == (1 if rank == 0 else 0), [r.getMessage() for r in records]


@case
def lr_warmup_momentum():
    """A momentum variable is scaled by new_lr / old_lr during each warm-up batch."""
    rank, size = hp.rank(), hp.size()
    x, y = data(rank, n=24)  # 3 steps per epoch, given explicitly
    initial_lr = 0.02 * size
    opt = hp.DistributedOptimizer(VariableMomentumSGD(initial_lr, momentum=0.5))
    model = model_with(opt)
    rec = LrRecorder()
    before = [float(v) for v in model.get_weights()[0].ravel()[:3]]
    model.fit(x, y, batch_size=8, epochs=2, verbose=0, shuffle=False,
              callbacks=[hp.BroadcastGlobalVariablesCallback(0),
                         hp.LearningRateWarmupCallback(initial_lr, warmup_epochs=1,
                                                       steps_per_epoch=3), rec])
    want_lr = [warmup_lr(initial_lr, size, 3, 1, k) for k in range(6)]
    np.testing.assert_allclose(rec.begin, want_lr, rtol=1e-6, atol=0)
    old = [initial_lr] + rec.begin[:-1]
    want_mom = [0.5 * rec.begin[k] / old[k] if k < 3 else 0.5 for k in range(6)]
    # the optimizer makes its momentum variable at its first step (it builds then)
    assert rec.mom_begin[0] in (None, want_mom[0]), rec.mom_begin
    np.testing.assert_allclose(rec.mom_begin[1:], want_mom[1:], rtol=1e-6, atol=0)
    if size > 1:
        assert rec.mom_begin[1] > 0.5 and rec.mom_begin[2] > 0.5, rec.mom_begin  # lr grows
    assert rec.mom_end == [0.5] * 6, rec.mom_end  # restored after every batch
    assert before != [float(v) for v in model.get_weights()[0].ravel()[:3]]  # it trained
    suite.same_on_every_rank({v.path: v.numpy() for v in model.variables}, "kcb.mom.vars")


@case
def lr_warmup_errors():
    """Unknown steps per epoch and a schedule learning rate fail with the fix named."""
    for bad, match in (({"initial_lr": 0.0}, "initial_lr"),
                       ({"initial_lr": 0.1, "warmup_epochs": -1}, "warmup_epochs"),
                       ({"initial_lr": 0.1, "steps_per_epoch": 0}, "steps_per_epoch")):
        expect_raises(ValueError, match, lambda bad=bad: hp.LearningRateWarmupCallback(**bad))
    x, y = data(0, n=16)

    def gen():
        for i in range(0, 16, 8):
            yield x[i:i + 8], y[i:i + 8]

    unknown = tf.data.Dataset.from_generator(gen, output_signature=(
        tf.TensorSpec((None, 4), tf.float32), tf.TensorSpec((None, 1), tf.float32)))
    model = model_with(keras.optimizers.SGD(0.1))
    expect_raises(ValueError, "steps_per_epoch", lambda: model.fit(
        unknown, epochs=1, verbose=0, callbacks=[hp.LearningRateWarmupCallback(0.1)]))
    schedule = keras.optimizers.schedules.ExponentialDecay(0.1, 10, 0.9)
    model = model_with(keras.optimizers.SGD(schedule))
    expect_raises(TypeError, "schedule", lambda: model.fit(
        x, y, batch_size=8, epochs=1, verbose=0,
        callbacks=[hp.LearningRateWarmupCallback(0.1)]))
    # given explicitly, steps_per_epoch works where Keras does not know it
    model = model_with(keras.optimizers.SGD(0.1))
    rec = LrRecorder()
    model.fit(unknown, epochs=1, verbose=0, callbacks=[
        hp.LearningRateWarmupCallback(0.1, warmup_epochs=1, steps_per_epoch=2), rec])
    # Keras calls batch-begin once more when it finds the end of data of unknown length;
    # past S * W batches the callback holds initial_lr (the cap)
    assert len(rec.begin) >= 2, rec.begin
    np.testing.assert_allclose(rec.begin, [warmup_lr(0.1, hp.size(), 2, 1, k)
                                           for k in range(len(rec.begin))], rtol=1e-6)


#: monitored value per rank and epoch (rank r uses row r % 3); mode "min"
SCORES = [[4.0, 3.0, 5.0, 1.0], [4.0, 5.0, 0.0, 5.0], [4.0, 4.0, 1.0, 0.0]]


@case
def best_checkpoint():
    """Rank 0 alone writes, at each improvement of the rank-averaged metric."""
    with tempfile.TemporaryDirectory(prefix=f"kcb_rank{hp.rank()}_") as root:
        check_best_checkpoint(root)


def check_best_checkpoint(root):
    rank, size = hp.rank(), hp.size()
    x, y = data(rank)
    model = model_with(hp.DistributedOptimizer(keras.optimizers.SGD(0.01)))
    path = os.path.join(root, "sub", "best.keras")  # Keras makes "sub" only when saving
    saves, weights = [], []
    real_save = model.save

    def save(filepath, *args, **kwargs):
        saves.append((len(weights), filepath))  # the epoch being finished
        real_save(filepath, *args, **kwargs)

    model.save = save
    keep = keras.callbacks.LambdaCallback(
        on_epoch_end=lambda e, logs: weights.append(model.get_weights()))
    scores = SCORES[rank % 3]
    model.fit(x, y, batch_size=8, epochs=4, verbose=0, shuffle=False,
              callbacks=[hp.BroadcastGlobalVariablesCallback(0),
                         Inject(lambda e: {"val_score": scores[e]}),
                         hp.MetricAverageCallback(),
                         hp.BestModelCheckpoint(path, monitor="val_score", mode="min"),
                         keep])
    mean = [sum(SCORES[r % 3][e] for r in range(size)) / size for e in range(4)]
    best, want = None, []
    for e, v in enumerate(mean):
        if best is None or v < best:
            best = v
            want.append(e)
    if rank == 0:
        assert [e for e, _ in saves] == want and all(p == path for _, p in saves), (saves, want)
        assert os.path.isfile(path), os.listdir(root)
        loaded = keras.models.load_model(path, compile=False)
        for a, b in zip(loaded.get_weights(), weights[want[-1]]):
            assert np.array_equal(a, b), "the file holds the weights of the best epoch"
    else:
        assert saves == [], saves
        assert os.listdir(root) == [], os.listdir(root)  # not even the directory
    if size == 2:
        assert want == [0, 2], want  # rank 0's own values would have saved at 0, 1, 3


# ----------------------------------------------------------------------------- main
def main():
    names = sys.argv[1].split(",")
    hp.init({"sync": {"stall_timeout_s": 20}, "logging": {"level": "WARNING"}})
    status = suite.run_cases(names, {}, CASES)
    hp.shutdown()
    sys.exit(status)


if __name__ == "__main__":
    main()
