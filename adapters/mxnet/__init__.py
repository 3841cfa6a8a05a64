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
    allreduce, allreduce_, grouped_allreduce, grouped_allreduce_, allgather,
    allgather_object, alltoall, reducescatter, broadcast, broadcast_, broadcast_object,
    broadcast_parameters, join: NDArray collectives (Horovod's names).
    cross_rank, cross_size, is_homogeneous: the host layout.
    DistributedTrainer: a Gluon ``Trainer`` (:mod:`hipress.mxnet.trainer`).
    Average, Sum, Min, Max, Product: reduction ops.
"""

from hipress.adapter_common import Average, Max, Min, Product, Sum

from .functions import (
    allgather,
    allgather_object,
    allreduce,
    allreduce_,
    alltoall,
    barrier,
    broadcast,
    broadcast_,
    broadcast_object,
    broadcast_parameters,
    cross_rank,
    cross_size,
    grouped_allreduce,
    grouped_allreduce_,
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
from .trainer import DistributedTrainer

__all__ = [
    "Average",
    "DistributedTrainer",
    "Max",
    "Min",
    "Product",
    "Sum",
    "allgather",
    "allgather_object",
    "allreduce",
    "allreduce_",
    "alltoall",
    "barrier",
    "broadcast",
    "broadcast_",
    "broadcast_object",
    "broadcast_parameters",
    "cross_rank",
    "cross_size",
    "grouped_allreduce",
    "grouped_allreduce_",
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
