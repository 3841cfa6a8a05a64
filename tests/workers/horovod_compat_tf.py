"""MPI worker for tests/test_horovod_compat.py (TensorFlow): Horovod API conventions.

Usage: mpirun -np N python tests/workers/horovod_compat_tf.py case1,case2,...

Each case prints ``PASS <case> rank <r>`` or ``FAIL <case> rank <r>`` with the traceback;
the worker exits 1 if any case failed. Every case uses its own variable names.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import behaviour_suite as suite  # noqa: E402

import hipress  # noqa: E402
import hipress.tensorflow as hp  # noqa: E402
from hipress.errors import ConfigError  # noqa: E402

tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)
CASES = {}


def case(fn):
    CASES[fn.__name__] = fn
    return fn


def _grads(rank, n=6):
    """Rank r's gradient: odd values, so averages with predivision need real arithmetic."""
    return np.arange(n, dtype=np.float32) * (2 * rank + 1) - 3.0 * rank


def _average(size, n=6):
    return sum(_grads(r, n).astype(np.float64) for r in range(size)) / size


@case
def compression_fp16():
    """DistributedOptimizer(compression=hp.Compression.fp16) runs the fp16 codec."""
    rank = hp.rank()
    var = keras.Variable(np.zeros(6, np.float32), name="hvdtf_fp16")
    opt = hp.DistributedOptimizer(keras.optimizers.SGD(1.0), compression=hp.Compression.fp16)
    opt.apply_gradients([(tf.constant(_grads(rank)), var)])
    stats = hipress.stats()
    keys = [k for k in stats if "hvdtf_fp16" in k]
    assert keys and all(stats[k]["codec"] == "fp16" for k in keys), {k: stats[k] for k in keys}
    np.testing.assert_allclose(var.numpy(), -_average(hp.size()), rtol=1e-3)


@case
def predivide_optimizer():
    """Keras DistributedOptimizer: the update uses the plain average for every f in [1, size]."""
    rank, size = hp.rank(), hp.size()
    for i, f in enumerate((1, 1.5, float(size))):
        var = keras.Variable(np.zeros(6, np.float32), name=f"hvdtf_pre{i}")
        opt = hp.DistributedOptimizer(keras.optimizers.SGD(1.0), compression=hp.Compression.none,
                                      gradient_predivide_factor=f)
        opt.apply_gradients([(tf.constant(_grads(rank)), var)])
        want = (-_average(size)).astype(np.float32)
        if f == 1:
            assert np.array_equal(var.numpy(), want), (var.numpy(), want)
        else:
            np.testing.assert_allclose(var.numpy(), want, rtol=1e-6, atol=1e-6)


@case
def predivide_tape():
    """DistributedGradientTape(gradient_predivide_factor=f): eager and in tf.function."""
    rank, size = hp.rank(), hp.size()
    a = tf.Variable(np.zeros(6, np.float32), name="hvdtf_tape")
    g = tf.constant(_grads(rank))
    for f in (1, float(size)):
        def grads(f=f):
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(a * g)
            tape = hp.DistributedGradientTape(tape, compression=hp.Compression.none,
                                              gradient_predivide_factor=f)
            return tape.gradient(loss, [a])[0]

        for fn in (grads, tf.function(grads)):
            out = fn().numpy()
            if f == 1:
                assert np.array_equal(out, _average(size).astype(np.float32)), out
            else:
                np.testing.assert_allclose(out, _average(size), rtol=1e-6, atol=1e-6)


@case
def predivide_errors():
    size = hp.size()
    for kw, frag in (({"gradient_predivide_factor": size + 1}, f"valid range [1, {size}]"),
                     ({"gradient_predivide_factor": 0}, f"valid range [1, {size}]"),
                     ({"gradient_predivide_factor": 2, "op": hp.Sum}, "needs op=hp.Average")):
        for build in (lambda kw=kw: hp.DistributedOptimizer(keras.optimizers.SGD(0.1), **kw),
                      lambda kw=kw: hp.DistributedGradientTape(tf.GradientTape(), **kw)):
            try:
                build()
            except ConfigError as exc:
                assert frag in str(exc) and "gradient_predivide_factor" in str(exc), exc
            else:
                raise AssertionError(f"{kw} accepted")


def main():
    suite.worker_main(hp, CASES)


if __name__ == "__main__":
    main()
