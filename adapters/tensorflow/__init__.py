"""TensorFlow 2 / Keras 3 adapter of HiPress: ``import hipress.tensorflow as hp``.

Custom training loop::

    import hipress.tensorflow as hp
    hp.init()
    tape = hp.DistributedGradientTape(tape, compression="onebit")
    grads = tape.gradient(loss, model.trainable_variables)

``model.fit``::

    opt = hp.DistributedOptimizer(keras.optimizers.SGD(0.05), compression="onebit")
    model.compile(optimizer=opt, loss=..., jit_compile=False)
    model.fit(..., callbacks=[hp.BroadcastGlobalVariablesCallback(0),
                              hp.MetricAverageCallback()])  # before callbacks reading logs

The adapter is thin: it converts tensors zero-copy (:mod:`hipress.tensorflow.convert`),
crosses from ``tf.function`` graphs to Python through one ``tf.py_function`` per
synchronization (:mod:`hipress.tensorflow.reducer`), and leaves the step rules
(accumulation, zero-filled None gradients, warm-up counting) to
:mod:`hipress.adapter_common`, shared with the PyTorch and MXNet adapters.

Contents:
    init, shutdown, is_initialized, rank, size, local_rank, local_size, barrier:
        process control.
    allreduce, grouped_allreduce, allgather, alltoall, reducescatter, broadcast,
    broadcast_variables: tensor collectives (eager or inside ``tf.function``).
    broadcast_object, allgather_object, join: eager only.
    cross_rank, cross_size, is_homogeneous: the host layout.
    DistributedGradientTape: wraps a ``tf.GradientTape``.
    DistributedOptimizer: wraps a Keras 3 optimizer (``model.fit``).
    BroadcastGlobalVariablesCallback: Keras callback broadcasting the initial variables.
    MetricAverageCallback: Keras callback averaging the epoch's metrics over the ranks.
    LearningRateWarmupCallback: Keras callback ramping the learning rate from
        ``initial_lr / size()`` to ``initial_lr``.
    BestModelCheckpoint: ``ModelCheckpoint(save_best_only=True)`` writing on rank 0 only.
    Average, Sum, Min, Max, Product: reduction ops.
"""

from hipress.adapter_common import Average, BackwardPassError, Max, Min, Product, Sum

from .callbacks import (
    BestModelCheckpoint,
    BroadcastGlobalVariablesCallback,
    LearningRateWarmupCallback,
    MetricAverageCallback,
)
from .functions import (
    allgather,
    allgather_object,
    allreduce,
    alltoall,
    barrier,
    broadcast,
    broadcast_object,
    broadcast_variables,
    cross_rank,
    cross_size,
    grouped_allreduce,
    init,
    is_homogeneous,
    is_initialized,
    join,
    local_rank,
    local_size,
    rank,
    reducescatter,
    shutdown,
    size,
)
from .gradient_tape import DistributedGradientTape
from .optimizer import DistributedOptimizer, EngineCheckpointState

__all__ = [
    "Average",
    "BackwardPassError",
    "BestModelCheckpoint",
    "BroadcastGlobalVariablesCallback",
    "DistributedGradientTape",
    "DistributedOptimizer",
    "EngineCheckpointState",
    "LearningRateWarmupCallback",
    "Max",
    "MetricAverageCallback",
    "Min",
    "Product",
    "Sum",
    "allgather",
    "allgather_object",
    "allreduce",
    "alltoall",
    "barrier",
    "broadcast",
    "broadcast_object",
    "broadcast_variables",
    "cross_rank",
    "cross_size",
    "grouped_allreduce",
    "init",
    "is_homogeneous",
    "is_initialized",
    "join",
    "local_rank",
    "local_size",
    "rank",
    "reducescatter",
    "shutdown",
    "size",
]

# Horovod porting aids: hp.Compression.fp16, op=hp.Adasum (refused with a clear error)
from hipress.adapter_common import Adasum, Compression  # noqa: E402

__all__ += ["Adasum", "Compression"]
