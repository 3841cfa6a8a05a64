"""MPI worker for tests/test_horovod_compat_mxnet.py: Horovod API conventions in Gluon.

Usage: mpirun -np N python tests/workers/horovod_compat_mxnet.py case1,case2,...

Each case prints ``PASS <case> rank <r>`` or ``FAIL <case> rank <r>`` with the traceback;
the worker exits 1 if any case failed. Every case uses its own parameter names.
"""

from __future__ import annotations

import sys
from pathlib import Path

import mxnet as mx
import numpy as np
from mxnet import autograd, gluon

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import behaviour_suite as suite  # noqa: E402

import hipress  # noqa: E402
import hipress.mxnet as hp  # noqa: E402
from hipress.adapter_common import UnsupportedArgumentError  # noqa: E402
from hipress.errors import ConfigError  # noqa: E402

CASES = {}


def case(fn):
    CASES[fn.__name__] = fn
    return fn


def _param(name, value):
    p = gluon.Parameter(name, shape=np.shape(value), dtype="float32")
    p.initialize(ctx=mx.cpu())
    p.set_data(mx.nd.array(value))
    return p


def _grads(rank, n=6):
    return np.arange(n, dtype=np.float32) * (2 * rank + 1) - 3.0 * rank


def _average(size, n=6):
    return sum(_grads(r, n).astype(np.float64) for r in range(size)) / size


def _step(trainer, w, rank):
    with autograd.record():
        loss = (w.data() * mx.nd.array(_grads(rank))).sum()
    loss.backward()
    trainer.step(1)


@case
def compression_fp16():
    """DistributedTrainer(compression=hp.Compression.fp16) runs the fp16 codec."""
    rank = hp.rank()
    w = _param("hvdmx.fp16", np.zeros(6, np.float32))
    trainer = hp.DistributedTrainer({w.name: w}, "sgd", {"learning_rate": 1.0},
                                    compression=hp.Compression.fp16)
    _step(trainer, w, rank)
    assert hipress.stats()[w.name]["codec"] == "fp16", hipress.stats()[w.name]
    np.testing.assert_allclose(w.grad().asnumpy(), _average(hp.size()), rtol=1e-3)


@case
def predivide_trainer():
    """gradient_predivide_factor=f: the gradient is the plain average, rescale applied once."""
    rank, size = hp.rank(), hp.size()
    for i, f in enumerate((1, 1.5, float(size))):
        w = _param(f"hvdmx.pre{i}", np.zeros(6, np.float32))
        trainer = hp.DistributedTrainer({w.name: w}, "sgd", {"learning_rate": 1.0},
                                        compression=hp.Compression.none,
                                        gradient_predivide_factor=f)
        _step(trainer, w, rank)
        want = _average(size).astype(np.float32)
        got = w.grad().asnumpy()
        if f == 1:
            assert np.array_equal(got, want), (got, want)
            assert np.array_equal(w.data().asnumpy(), -want)
        else:
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
            np.testing.assert_allclose(w.data().asnumpy(), -want, rtol=1e-6, atol=1e-6)


@case
def predivide_errors():
    size = hp.size()
    w = _param("hvdmx.err", np.zeros(2, np.float32))
    for kw, frag in (({"gradient_predivide_factor": size + 1}, f"valid range [1, {size}]"),
                     ({"gradient_predivide_factor": -1}, f"valid range [1, {size}]"),
                     ({"gradient_predivide_factor": 2, "op": hp.Sum}, "needs op=hp.Average")):
        try:
            hp.DistributedTrainer({w.name: w}, "sgd", {"learning_rate": 1.0}, **kw)
        except ConfigError as exc:
            assert frag in str(exc) and "gradient_predivide_factor" in str(exc), exc
        else:
            raise AssertionError(f"{kw} accepted")


@case
def unsupported_arguments():
    w = _param("hvdmx.unsup", np.zeros(2, np.float32))
    for kw, frag in (({"process_set": object()}, "process sets are not supported"),
                     ({"num_groups": 2}, "'num_groups' is not supported by HiPress"),
                     ({"sparse_as_dense": True}, "'sparse_as_dense' is not supported"),
                     ({"op": hp.Adasum}, "Adasum reduction is not supported by HiPress")):
        try:
            hp.DistributedTrainer({w.name: w}, "sgd", {"learning_rate": 1.0}, **kw)
        except UnsupportedArgumentError as exc:
            assert frag in str(exc) and "DistributedTrainer(" in str(exc), exc
        else:
            raise AssertionError(f"{kw} accepted")


def main():
    suite.worker_main(hp, CASES)


if __name__ == "__main__":
    main()
