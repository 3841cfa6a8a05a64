"""MXNet (Gluon) adapter of HiPress: ``import hipress.mxnet as hp``, the way Horovod is used.

>>> import hipress.mxnet as hp
>>> hp.init()
>>> hp.broadcast_parameters(net.collect_params(), root_rank=0)
>>> trainer = hp.DistributedTrainer(net.collect_params(), "sgd", {"learning_rate": 0.05},
...                                 compression="onebit")

The adapter is thin: it converts NDArrays zero-copy through DLPack
(:mod:`hipress.mxnet.convert`) and leaves the step rules (accumulation, zero-filled
gradients, warm-up counting, checkpoint encoding) to :mod:`hipress.adapter_common`, shared
with the PyTorch and TensorFlow adapters. MXNet 1.9 needs NumPy < 1.24: it runs in its own
virtualenv (``make venv-mxnet``).

Contents:
    init, shutdown, is_initialized, rank, size, local_rank, local_size, barrier:
        process control.
    allreduce, allreduce_, broadcast, broadcast_, broadcast_object, broadcast_parameters:
        NDArray collectives.
    DistributedTrainer: a Gluon ``Trainer`` (:mod:`hipress.mxnet.trainer`).
    Average, Sum: reduction ops.
"""

from hipress.adapter_common import Average, Sum

from .functions import (
    allreduce,
    allreduce_,
    barrier,
    broadcast,
    broadcast_,
    broadcast_object,
    broadcast_parameters,
    init,
    is_initialized,
    local_rank,
    local_size,
    rank,
    shutdown,
    size,
)
from .trainer import DistributedTrainer

__all__ = [
    "Average",
    "DistributedTrainer",
    "Sum",
    "allreduce",
    "allreduce_",
    "barrier",
    "broadcast",
    "broadcast_",
    "broadcast_object",
    "broadcast_parameters",
    "init",
    "is_initialized",
    "local_rank",
    "local_size",
    "rank",
    "shutdown",
    "size",
]
