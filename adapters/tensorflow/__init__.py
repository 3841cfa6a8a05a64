"""TensorFlow 2 / Keras 3 adapter of HiPress: ``import hipress.tensorflow as hp``.

Custom training loop::

    import hipress.tensorflow as hp
    hp.init()
    tape = hp.DistributedGradientTape(tape, compression="onebit")
    grads = tape.gradient(loss, model.trainable_variables)

``model.fit``::

    opt = hp.DistributedOptimizer(keras.optimizers.SGD(0.05), compression="onebit")
    model.compile(optimizer=opt, loss=..., jit_compile=False)
    model.fit(..., callbacks=[hp.BroadcastGlobalVariablesCallback(0)])

The adapter is thin: it converts tensors zero-copy (:mod:`hipress.tensorflow.convert`),
crosses from ``tf.function`` graphs to Python through one ``tf.py_function`` per
synchronization (:mod:`hipress.tensorflow.reducer`), and leaves the step rules
(accumulation, zero-filled None gradients, warm-up counting) to
:mod:`hipress.adapter_common`, shared with the PyTorch and MXNet adapters.

Contents:
    init, shutdown, is_initialized, rank, size, local_rank, local_size, barrier:
        process control.
    allreduce, broadcast, broadcast_object, broadcast_variables: tensor collectives
        (eager or inside ``tf.function``).
    DistributedGradientTape: wraps a ``tf.GradientTape``.
    DistributedOptimizer: wraps a Keras 3 optimizer (``model.fit``).
    BroadcastGlobalVariablesCallback: Keras callback broadcasting the initial variables.
    Average, Sum: reduction ops.
"""

from hipress.adapter_common import Average, BackwardPassError, Sum

from .callbacks import BroadcastGlobalVariablesCallback
from .functions import (
    allreduce,
    barrier,
    broadcast,
    broadcast_object,
    broadcast_variables,
    init,
    is_initialized,
    local_rank,
    local_size,
    rank,
    shutdown,
    size,
)
from .gradient_tape import DistributedGradientTape
from .optimizer import DistributedOptimizer, EngineCheckpointState

__all__ = [
    "Average",
    "BackwardPassError",
    "BroadcastGlobalVariablesCallback",
    "DistributedGradientTape",
    "DistributedOptimizer",
    "EngineCheckpointState",
    "Sum",
    "allreduce",
    "barrier",
    "broadcast",
    "broadcast_object",
    "broadcast_variables",
    "init",
    "is_initialized",
    "local_rank",
    "local_size",
    "rank",
    "shutdown",
    "size",
]
