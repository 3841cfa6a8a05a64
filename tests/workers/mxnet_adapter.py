"""MPI worker for tests/test_mxnet_adapter.py: runs the named cases on every rank.

Usage: mpirun -np N python tests/workers/mxnet_adapter.py case1,case2,...

``<case>@gluon`` runs a case of tests/behaviour_suite.py through ``hp.DistributedTrainer``;
plain names run the MXNet-specific cases below. Each case prints ``PASS <case> rank <r>``
or ``FAIL <case> rank <r>`` with the traceback; the worker exits 1 if any case failed.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import mxnet as mx
import numpy as np
from mxnet import autograd, gluon

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import behaviour_suite as suite  # noqa: E402

import hipress  # noqa: E402
import hipress.mxnet as hp  # noqa: E402
from hipress.mxnet.convert import to_array  # noqa: E402


# ---------------------------------------------------------------------------- driver
class MXTrainer(suite.Trainer):
    def __init__(self, prefix, init, compression, backward_passes_per_step, op, lr, momentum,
                 codec_params):
        self.vars = {k: _param(f"{prefix}.{k}", v) for k, v in init.items()}
        self.trainer = hp.DistributedTrainer(
            {p.name: p for p in self.vars.values()}, "sgd",
            {"learning_rate": lr, "momentum": momentum, "wd": 0.0},
            compression=compression, backward_passes_per_step=backward_passes_per_step, op=op,
            **codec_params)

    def engine_name(self, key):
        return self.vars[key].name

    def step(self, passes):
        for grads in passes:
            with autograd.record():
                loss = mx.nd.add_n(*[(self.vars[k].data() * mx.nd.array(g)).sum()
                                     for k, g in grads.items()])
            loss.backward()
            self.trainer.step(1)

    def grads(self):
        return {k: p.grad().asnumpy() for k, p in self.vars.items()}

    def params(self):
        return {k: p.data().asnumpy() for k, p in self.vars.items()}

    def save(self):
        path = os.path.join(tempfile.mkdtemp(prefix=f"mxckpt{hp.rank()}_"), "trainer.states")
        self.trainer.save_states(path)
        return path, self.params()

    def load(self, checkpoint):
        path, values = checkpoint
        for k, v in values.items():
            self.vars[k].set_data(mx.nd.array(v))
        self.trainer.load_states(path)


class MXDriver(suite.Driver):
    framework = "mxnet"

    def build(self, prefix, init, compression="none", backward_passes_per_step=1,
              op="average", lr=0.0, momentum=0.0, **codec_params):
        return MXTrainer(prefix, init, compression, backward_passes_per_step, op, lr, momentum,
                         codec_params)

    def allreduce(self, array, name, op="average", compression=None):
        return hp.allreduce(mx.nd.array(array), name=name, op=op,
                            compression=compression).asnumpy()

    def broadcast(self, array, root, name):
        return hp.broadcast(mx.nd.array(array), root, name=name).asnumpy()

    module = hp
    int_dtypes = (np.int32, np.int64, np.uint8)  # NDArrays have no bool

    def tensor(self, array):
        return mx.nd.array(array, dtype=array.dtype)

    def numpy(self, t):
        return t.asnumpy()


def _param(name, value):
    p = gluon.Parameter(name, shape=np.shape(value), dtype="float32")
    p.initialize(ctx=mx.cpu())
    p.set_data(mx.nd.array(value))
    return p


DRIVERS = {"gluon": MXDriver()}

# -------------------------------------------------------------- MXNet-specific cases
EXTRA = {}


def extra(fn):
    EXTRA[fn.__name__] = fn
    return fn


@extra
def rescale_once():
    """Grads [2,4]*(r+1), rescale_grad 1.0 -> averaged (world 2: [3,6]), applied once."""
    rank, size = hp.rank(), hp.size()
    want = np.array([2.0, 4.0], np.float32) * (size + 1) / 2  # mean of (r+1) * [2, 4]
    for batch_size in (1, 2):
        w = _param(f"rescale.b{batch_size}", np.zeros(2, np.float32))
        trainer = hp.DistributedTrainer({w.name: w}, "sgd", {"learning_rate": 1.0},
                                        compression="none")
        assert trainer._scale == 1.0 and trainer.optimizer.rescale_grad == 1.0
        with autograd.record():
            loss = (w.data() * mx.nd.array([2.0, 4.0]) * (rank + 1)).sum()
        loss.backward()
        trainer.step(batch_size)
        got_grad, got_w = w.grad().asnumpy(), w.data().asnumpy()
        assert np.array_equal(got_grad, want), (got_grad, want)
        assert np.array_equal(got_w, -want / batch_size), (got_w, -want / batch_size)
        if size == 2 and batch_size == 1:
            assert np.array_equal(got_grad, [3.0, 6.0]), got_grad  # not [1.5, 3]
            assert np.array_equal(got_w, [-3.0, -6.0]), got_w


@extra
def manual_allreduce_update():
    """allreduce_grads() then update(): the gradients are synchronized before the update."""
    rank, size = hp.rank(), hp.size()
    w = _param("manual.w", np.zeros(3, np.float32))
    trainer = hp.DistributedTrainer({w.name: w}, "sgd", {"learning_rate": 0.5},
                                    compression="none")
    with autograd.record():
        loss = (w.data() * float(rank)).sum()
    loss.backward()
    trainer.allreduce_grads()
    want = np.float32(sum(range(size)) / size)
    assert np.array_equal(w.grad().asnumpy(), np.full(3, want)), w.grad()
    trainer.update(1)
    assert np.array_equal(w.data().asnumpy(), np.full(3, -0.5 * want, np.float32))


@extra
def broadcast_deferred():
    """broadcast_parameters: initialized and deferred (first forward) parameters get root's."""
    rank, size = hp.rank(), hp.size()
    mx.random.seed(rank)
    net = gluon.nn.HybridSequential(prefix="bnet_")
    with net.name_scope():
        net.add(gluon.nn.Dense(4, in_units=3), gluon.nn.Dense(2))  # the second is deferred
    net.initialize(mx.init.Uniform(1.0), ctx=mx.cpu())
    params = net.collect_params()
    hp.broadcast_parameters(params, root_rank=size - 1)
    net(mx.nd.ones((1, 3)))  # finishes the deferred initialization -> broadcast
    values = {k: p.data().asnumpy() for k, p in params.items()}
    root = hp.broadcast_object(values if rank == size - 1 else None, root_rank=size - 1,
                               name="bdef.check")
    for k, v in values.items():
        assert np.array_equal(v, root[k]), k
    from hipress import api

    nds = {f"x{k}": mx.nd.full((2, k + 1), float(rank)) for k in range(7)}
    rounds = api._ENGINE._round
    hp.broadcast_parameters(nds, root_rank=0)
    # all 7 start before any is waited for: they share rounds (not one each)
    assert api._ENGINE._round - rounds <= 3, api._ENGINE._round - rounds
    for k, nd in enumerate(nds.values()):
        assert np.array_equal(nd.asnumpy(), np.zeros((2, k + 1))), nd


@extra
def collectives():
    """allreduce / allreduce_ (average, sum; float16/32/64) and dtype errors."""
    rank, size = hp.rank(), hp.size()
    for dt in ("float16", "float32", "float64"):
        x = mx.nd.array([1.0 + rank, 2.0], dtype=dt)
        out = hp.allreduce(x, name=f"mx.ar.{dt}", op=hp.Sum)
        assert out.dtype == np.dtype(dt) and out.context == x.context
        assert np.array_equal(out.asnumpy(), [sum(1.0 + r for r in range(size)), 2.0 * size])
    y = mx.nd.array([float(rank)] * 4)
    hp.allreduce_(y, name="mx.ar_")
    assert np.array_equal(y.asnumpy(), np.full(4, sum(range(size)) / size, np.float32)), y
    # integers: exact sums; an average would truncate and is refused on every adapter
    out = hp.allreduce(mx.nd.array([1, rank], dtype="int32"), name="mx.int.sum", op=hp.Sum)
    assert out.dtype == np.int32 and out.asnumpy().tolist() == [size, size * (size - 1) // 2]
    try:
        hp.allreduce(mx.nd.array([1, 2], dtype="int32"), name="mx.int")
    except TypeError as exc:
        assert "integer average would truncate" in str(exc), exc
    else:
        raise AssertionError("an int32 average must be refused")
    try:  # gradients stay floating: the trainer's conversion refuses integer parameters
        to_array(mx.nd.array([1, 2], dtype="int32"))
    except TypeError as exc:
        assert "float16, float32 and float64" in str(exc), exc
    else:
        raise AssertionError("int32 gradients must be refused")


@extra
def errors():
    """Clear errors: duplicate names, sparse grads, grad_req='add' with accumulation, codec."""
    a, b = _param("dup", np.zeros(1)), _param("dup", np.zeros(1))
    try:
        hp.DistributedTrainer([a, b], "sgd", {"learning_rate": 0.1})
    except ValueError as exc:
        assert "duplicates: 'dup'" in str(exc), exc
    else:
        raise AssertionError("duplicate names must raise")
    emb = gluon.nn.Embedding(5, 2, sparse_grad=True, prefix="semb_")
    emb.initialize(ctx=mx.cpu())
    try:
        hp.DistributedTrainer(emb.collect_params(), "sgd", {"learning_rate": 0.1})
    except TypeError as exc:
        assert "sparse_grad=False" in str(exc), exc
    else:
        raise AssertionError("sparse gradients must be refused")
    c = _param("gadd", np.zeros(2))
    c.grad_req = "add"
    tr = hp.DistributedTrainer([c], "sgd", {"learning_rate": 0.1}, backward_passes_per_step=2)
    with autograd.record():
        loss = (c.data() * 2.0).sum()
    loss.backward()
    try:
        tr.step(1)
    except ValueError as exc:
        assert "grad_req='add'" in str(exc), exc
    else:
        raise AssertionError("grad_req='add' with backward_passes_per_step=2 must raise")
    try:
        hp.DistributedTrainer([_param("cc", np.zeros(1))], "sgd", {"learning_rate": 0.1},
                              compression="no-such-codec")
    except hipress.errors.CodecError as exc:
        assert "onebit" in str(exc), exc
    else:
        raise AssertionError("unknown codec must raise")


@extra
def gluon_trains():
    """A Gluon MLP with onebit: loss falls, parameters identical on every rank."""
    rank = hp.rank()
    mx.random.seed(rank)
    rng = np.random.default_rng(rank)
    x = rng.standard_normal((64, 8)).astype(np.float32)
    y = (x @ np.random.default_rng(0).standard_normal((8, 3))).argmax(1).astype(np.float32)
    net = gluon.nn.HybridSequential(prefix="mlp_")
    with net.name_scope():
        net.add(gluon.nn.Dense(16, in_units=8, activation="relu"), gluon.nn.Dense(3, in_units=16))
    net.initialize(mx.init.Xavier(), ctx=mx.cpu())
    params = net.collect_params()
    hp.broadcast_parameters(params, root_rank=0)
    trainer = hp.DistributedTrainer(params, "sgd", {"learning_rate": 0.1, "momentum": 0.9},
                                    compression="onebit")
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    losses = []
    for _epoch in range(6):
        total = 0.0
        for s in range(0, 64, 16):
            xb, yb = mx.nd.array(x[s:s + 16]), mx.nd.array(y[s:s + 16])
            with autograd.record():
                loss = loss_fn(net(xb), yb)
            loss.backward()
            trainer.step(16)
            total += float(loss.sum().asscalar())
        losses.append(total / 64)
    assert losses[-1] < 0.8 * losses[0], losses
    suite.same_on_every_rank({k: p.data().asnumpy() for k, p in params.items()}, "mx.trains")
    stats = hipress.stats()
    assert stats["mlp_dense0_weight"]["codec"] == "onebit", stats["mlp_dense0_weight"]


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
