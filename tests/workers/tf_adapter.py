"""MPI worker for tests/test_tensorflow_adapter.py: runs the named cases on every rank.

Usage: mpirun -np N python tests/workers/tf_adapter.py case1,case2,...

``<case>@eager`` / ``<case>@graph`` run a case of tests/behaviour_suite.py through
``hp.DistributedOptimizer`` (Keras 3), eagerly or inside ``tf.function``; plain names run
the TensorFlow-specific cases below. Each case prints ``PASS <case> rank <r>`` or
``FAIL <case> rank <r>`` with the traceback; the worker exits 1 if any case failed.
"""

from __future__ import annotations

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


# ---------------------------------------------------------------------------- driver
class RecordingSGD(keras.optimizers.SGD):
    """SGD that keeps the last gradient it applied per variable (to read the synced grads)."""

    def build(self, variables):
        if self.built:
            return
        super().build(variables)
        self.last_grads = [self.add_variable_from_reference(v, name="last_grad")
                           for v in variables]

    def update_step(self, gradient, variable, learning_rate):
        self.assign(self.last_grads[self._get_variable_index(variable)], gradient)
        super().update_step(gradient, variable, learning_rate)


class TFTrainer(suite.Trainer):
    def __init__(self, graph, prefix, init, compression, backward_passes_per_step, op, lr,
                 momentum, codec_params):
        self.keys = list(init)
        self.vars = {k: keras.Variable(np.array(v, np.float32), name=f"{prefix}.{k}")
                     for k, v in init.items()}
        self.var_list = [self.vars[k] for k in self.keys]
        self.opt = hp.DistributedOptimizer(
            RecordingSGD(learning_rate=lr, momentum=momentum), compression=compression,
            backward_passes_per_step=backward_passes_per_step, op=op, **codec_params)
        self.opt.build(self.var_list)
        self._pass = tf.function(self._one_pass) if graph else self._one_pass

    def engine_name(self, key):
        return self.vars[key].path

    def _one_pass(self, grads):
        with tf.GradientTape() as tape:
            loss = tf.add_n([tf.reduce_sum(self.vars[k] * g) for k, g in grads.items()])
        gs = tape.gradient(loss, self.var_list)
        assert sum(g is None for g in gs) == len(self.keys) - len(grads), gs
        self.opt.apply_gradients(zip(gs, self.var_list))

    def step(self, passes):
        for p in passes:
            self._pass({k: tf.constant(v) for k, v in p.items()})

    def grads(self):
        return {k: self.opt.last_grads[i].numpy() for i, k in enumerate(self.keys)}

    def params(self):
        return {k: self.vars[k].numpy() for k in self.keys}

    def _checkpoint(self):
        return tf.train.Checkpoint(vars=self.var_list, optimizer=self.opt)

    def save(self):
        path = os.path.join(tempfile.mkdtemp(prefix=f"tfckpt{hp.rank()}_"), "ckpt")
        return self._checkpoint().write(path)

    def load(self, checkpoint):
        self._checkpoint().read(checkpoint).assert_existing_objects_matched()


class TFDriver(suite.Driver):
    framework = "tensorflow"

    def __init__(self, graph):
        self.graph = graph

    def build(self, prefix, init, compression="none", backward_passes_per_step=1,
              op="average", lr=0.0, momentum=0.0, **codec_params):
        mode = "graph" if self.graph else "eager"
        return TFTrainer(self.graph, f"{prefix}.{mode}", init, compression,
                         backward_passes_per_step, op, lr, momentum, codec_params)

    def allreduce(self, array, name, op="average", compression=None):
        def fn(t):
            return hp.allreduce(t, name=name, op=op, compression=compression)

        return (tf.function(fn) if self.graph else fn)(tf.constant(array)).numpy()

    def broadcast(self, array, root, name):
        return hp.broadcast(tf.constant(array), root, name=name).numpy()

    module = hp

    def tensor(self, array):
        return tf.constant(array)

    def numpy(self, t):
        return t.numpy()

    def wrap(self, fn):
        return tf.function(fn) if self.graph else fn


DRIVERS = {"eager": TFDriver(False), "graph": TFDriver(True)}

# ----------------------------------------------------------------- TF-specific cases
EXTRA = {}


def extra(fn):
    EXTRA[fn.__name__] = fn
    return fn


@extra
def tape_none_and_structure():
    """DistributedGradientTape: None zero-filled, nested sources, eager == tf.function."""
    rank, size = hp.rank(), hp.size()
    a = tf.Variable([0.0, 0.0], name="tape.a")
    b = tf.Variable([0.0, 0.0], name="tape.b")
    ga = {r: tf.constant([1.0 + r, 2.0 * r]) for r in range(size)}
    gb = tf.constant([2.0, 4.0])

    def grads():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(a * ga[rank])
            if rank == 0:
                loss += tf.reduce_sum(b * gb)
        tape = hp.DistributedGradientTape(tape, compression="none")
        return tape.gradient(loss, {"a": a, "b": b})

    want_a = sum(g.numpy() for g in ga.values()) / np.float32(size)
    for fn in (grads, tf.function(grads)):
        for _ in range(2):
            out = fn()
            assert set(out) == {"a", "b"}
            assert np.array_equal(out["a"].numpy(), want_a), (out["a"], want_a)
            assert np.array_equal(out["b"].numpy(), gb.numpy() / np.float32(size)), out["b"]


@extra
def tape_unnamed_variables():
    """Unnamed tf.Variables (all 'Variable:0') get positional names, synchronized exactly."""
    rank, size = hp.rank(), hp.size()
    vs = [tf.Variable(tf.zeros(3)) for _ in range(3)]
    with tf.GradientTape() as tape:
        loss = tf.add_n([tf.reduce_sum(v * float(i + rank)) for i, v in enumerate(vs)])
    out = hp.DistributedGradientTape(tape, compression="none").gradient(loss, vs)
    for i, g in enumerate(out):
        want = np.float32(sum(i + r for r in range(size)) / size)
        assert np.array_equal(g.numpy(), np.full(3, want, np.float32)), (i, g)
    assert any(n.startswith("grad.0.") for n in hipress.stats()), sorted(hipress.stats())


def _embedding_case(size, rank):
    emb = tf.Variable(tf.zeros([6, 3]), name=f"emb{rank * 0}")
    idx = tf.constant([rank, rank + 1, 1])
    ref = np.zeros((6, 3), np.float32)
    for r in range(size):
        for i in (r, r + 1, 1):
            ref[i] += 2.0
    return emb, idx, ref / np.float32(size)


@extra
def indexed_slices():
    """IndexedSlices: densified (tape, eager and graph) or a TypeError naming the variable."""
    rank, size = hp.rank(), hp.size()
    emb, idx, want = _embedding_case(size, rank)

    def grads(sparse_as_dense):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.gather(emb, idx) * 2.0)
        raw = tape.gradient(loss, emb)
        assert isinstance(raw, tf.IndexedSlices), type(raw)
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.gather(emb, idx) * 2.0)
        tape = hp.DistributedGradientTape(tape, compression="none",
                                          sparse_as_dense=sparse_as_dense)
        return tape.gradient(loss, [emb])[0]

    for fn in (grads, tf.function(grads)):
        out = fn(True)
        assert isinstance(out, tf.Tensor) and not isinstance(out, tf.IndexedSlices)
        assert np.array_equal(out.numpy(), want), (out, want)
    try:
        grads(False)
    except TypeError as exc:
        assert "IndexedSlices" in str(exc) and "sparse_as_dense=True" in str(exc), exc
        assert "'emb0'" in str(exc), exc
    else:
        raise AssertionError("sparse_as_dense=False must refuse IndexedSlices")


def _embedding_pass(emb, opt):
    def one_pass(idx):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.gather(emb, idx) * 2.0)
        g = tape.gradient(loss, [emb])
        assert isinstance(g[0], tf.IndexedSlices), type(g[0])
        opt.apply_gradients(zip(g, [emb]))

    return one_pass


@extra
def indexed_slices_accumulated():
    """sparse_as_dense + backward_passes_per_step=2: dense accumulation, no type error."""
    rank, size = hp.rank(), hp.size()
    for graph in (False, True):
        emb = keras.Variable(np.zeros((6, 3), np.float32), name=f"acc_emb_{int(graph)}")
        opt = RecordingSGD(learning_rate=0.0)
        opt = hp.DistributedOptimizer(opt, compression="none", backward_passes_per_step=2,
                                      sparse_as_dense=True)
        opt.build([emb])

        one_pass = _embedding_pass(emb, opt)
        fn = tf.function(one_pass) if graph else one_pass
        fn(tf.constant([rank, 1]))
        assert int(opt.iterations.numpy()) == 0  # first pass: accumulated only
        fn(tf.constant([rank + 1]))
        assert int(opt.iterations.numpy()) == 1
        want = np.zeros((6, 3), np.float32)
        for r in range(size):
            for i in (r, 1, r + 1):
                want[i] += 2.0
        got = opt.last_grads[0].numpy()
        assert np.array_equal(got, want / np.float32(size)), (graph, got, want / size)


@extra
def model_fit():
    """model.fit with DistributedOptimizer + broadcast callback: ranks end identical, loss falls."""
    rank = hp.rank()
    keras.utils.set_random_seed(rank)  # different init per rank: the callback fixes it
    rng = np.random.default_rng(rank)
    x = rng.standard_normal((64, 8)).astype(np.float32)
    w = np.random.default_rng(0).standard_normal((8, 3)).astype(np.float32)
    y = (x @ w).argmax(1)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dense(3)])
    opt = hp.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9),
                                  compression="onebit")
    model.compile(optimizer=opt, jit_compile=False,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    hist = model.fit(x, y, batch_size=16, epochs=4, verbose=0, shuffle=False,
                     callbacks=[hp.BroadcastGlobalVariablesCallback(0)])
    losses = hist.history["loss"]
    assert losses[-1] < 0.8 * losses[0], losses
    suite.same_on_every_rank({v.path: v.numpy() for v in model.variables}, "fit.vars")
    stats = hipress.stats()
    kernels = [n for n in stats if n.startswith("sequential") and n.endswith("kernel")]
    assert kernels and all(stats[n]["codec"] == "onebit" for n in kernels), (
        {n: stats[n]["codec"] for n in kernels})


@extra
def collectives():
    """allreduce (eager, graph, bfloat16 sum) and broadcast_variables."""
    rank, size = hp.rank(), hp.size()
    out = hp.allreduce(tf.constant([1.0 + rank, 2.0]), name="tf.ar")
    assert np.array_equal(out.numpy(), [sum(1.0 + r for r in range(size)) / size, 2.0]), out

    @tf.function
    def graph_ar(t):
        return hp.allreduce(t, name="tf.ar.graph", op=hp.Sum)

    out = graph_ar(tf.constant([float(rank), 1.0]))
    assert out.shape == (2,)
    assert np.array_equal(out.numpy(), [sum(range(size)), size]), out
    bf = hp.allreduce(tf.constant([1.5, 2.0], dtype=tf.bfloat16), name="tf.bf16", op=hp.Sum)
    assert bf.dtype == tf.bfloat16
    assert np.array_equal(bf.numpy().astype(np.float32), [1.5 * size, 2.0 * size]), bf
    vs = [tf.Variable(tf.fill([3], float(rank)), name="bv.a"),
          keras.Variable(np.full((2, 2), rank, np.float32), name="bv.b")]
    vs += [tf.Variable(tf.fill([k + 1], float(rank)), name=f"bv.{k}") for k in range(5)]
    from hipress import api

    rounds = api._ENGINE._round
    hp.broadcast_variables(vs, root_rank=size - 1)
    # eagerly all 7 start before any is waited for: they share rounds (not one each)
    assert api._ENGINE._round - rounds <= 3, api._ENGINE._round - rounds
    assert np.array_equal(vs[0].numpy(), np.full(3, size - 1.0)), vs[0]
    assert np.array_equal(vs[1].numpy(), np.full((2, 2), size - 1.0)), vs[1]
    for k, v in enumerate(vs[2:]):
        assert np.array_equal(v.numpy(), np.full(k + 1, size - 1.0)), v
    # inside tf.function too: one py_function starts all 20 (one at a time took a round
    # each; idle rounds also tick while the graph starts, hence the margin)
    gs = [tf.Variable(tf.fill([k + 2], rank + 1.0), name=f"bg.{k}") for k in range(19)]
    gs.append(tf.Variable(tf.fill([2, 3], rank + 1), name="bg.int"))

    @tf.function
    def graph_bcast():
        hp.broadcast_variables(gs, root_rank=0)

    graph_bcast.get_concrete_function()  # trace first: idle rounds tick while it traces
    rounds = api._ENGINE._round
    graph_bcast()
    assert api._ENGINE._round - rounds <= 10, api._ENGINE._round - rounds
    for k, v in enumerate(gs[:-1]):
        assert np.array_equal(v.numpy(), np.full(k + 2, 1.0)), v
    assert gs[-1].dtype == tf.int32 and np.array_equal(gs[-1].numpy(), np.ones((2, 3))), gs[-1]


@extra
def errors():
    """Clear errors: unknown codec, built optimizer, Keras accumulation, bad k."""
    try:
        hp.DistributedOptimizer(keras.optimizers.SGD(0.1), compression="no-such-codec")
    except hipress.errors.CodecError as exc:
        assert "onebit" in str(exc), exc
    else:
        raise AssertionError("unknown codec must raise")
    built = keras.optimizers.SGD(0.1)
    built.build([keras.Variable(np.zeros(2, np.float32), name="e.v")])
    for bad, match in ((built, "already built"),
                       (keras.optimizers.SGD(0.1, gradient_accumulation_steps=2),
                        "backward_passes_per_step")):
        try:
            hp.DistributedOptimizer(bad)
        except ValueError as exc:
            assert match in str(exc), exc
        else:
            raise AssertionError(f"expected ValueError with {match!r}")
    try:
        hp.DistributedOptimizer(keras.optimizers.SGD(0.1), backward_passes_per_step=0)
    except ValueError as exc:
        assert "backward_passes_per_step" in str(exc), exc
    else:
        raise AssertionError("backward_passes_per_step=0 must raise")


# ----------------------------------------------------------------------------- main
def main():
    names = sys.argv[1].split(",")
    hp.init({"compression": {"min_compress_bytes": 0}, "sync": {"stall_timeout_s": 20},
             "logging": {"level": "WARNING"}})
    status = suite.run_cases(names, DRIVERS, EXTRA)
    hp.shutdown()
    sys.exit(status)


if __name__ == "__main__":
    main()
