"""PyTorch adapter of HiPress: ``import hipress.torch as hp``, the way Horovod is used.

>>> import hipress.torch as hp
>>> hp.init()
>>> opt = hp.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
...                               compression="onebit")
>>> hp.broadcast_parameters(model.state_dict(), root_rank=0)
>>> hp.broadcast_optimizer_state(opt, root_rank=0)

The adapter is thin: it hooks the points where gradients become ready, hands tensors to
the core zero-copy (NumPy for CPU tensors, CuPy via DLPack for CUDA tensors) and calls
:mod:`hipress`; the step bookkeeping it shares with the other adapters lives in
:mod:`hipress.adapter_common`.

Contents:
    init, shutdown, is_initialized, rank, size, local_rank, local_size, barrier:
        process control (:mod:`hipress.torch.functions`).
    allreduce, allreduce_, allreduce_async, allreduce_async_, grouped_allreduce(_)(_async),
    allgather, allgather_async, allgather_object, alltoall, alltoall_async,
    reducescatter, reducescatter_async, broadcast, broadcast_, broadcast_async,
    broadcast_async_, broadcast_object, synchronize, poll, join: collectives, Horovod's
        names and signatures; allreduce and allgather are differentiable.
    broadcast_parameters, broadcast_optimizer_state: model and optimizer initialization.
    cross_rank, cross_size, is_homogeneous: the host layout.
    DistributedOptimizer: wraps a torch optimizer (:mod:`hipress.torch.optimizer`).
    ddp_comm_hook, make_ddp_hook, DDPHookState: DistributedDataParallel communication
        hook (:mod:`hipress.torch.ddp`).
    Average, Sum, Min, Max, Product: reduction ops.
"""

from hipress.adapter_common import Average, BackwardPassError, Max, Min, Product, Sum
from hipress.api import cross_rank, cross_size, is_homogeneous

from .ddp import DDPHookState, ddp_comm_hook, make_ddp_hook
from .functions import (
    Handle,
    allgather,
    allgather_async,
    allgather_object,
    allreduce,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    alltoall,
    alltoall_async,
    barrier,
    broadcast,
    broadcast_,
    broadcast_async,
    broadcast_async_,
    broadcast_object,
    broadcast_optimizer_state,
    broadcast_parameters,
    grouped_allreduce,
    grouped_allreduce_,
    grouped_allreduce_async,
    grouped_allreduce_async_,
    init,
    is_initialized,
    join,
    local_rank,
    local_size,
    poll,
    rank,
    reducescatter,
    reducescatter_async,
    shutdown,
    size,
    synchronize,
)
from .optimizer import DistributedOptimizer

__all__ = [
    "Average",
    "BackwardPassError",
    "DDPHookState",
    "DistributedOptimizer",
    "Handle",
    "Max",
    "Min",
    "Product",
    "Sum",
    "allgather",
    "allgather_async",
    "allgather_object",
    "allreduce",
    "allreduce_",
    "allreduce_async",
    "allreduce_async_",
    "alltoall",
    "alltoall_async",
    "barrier",
    "broadcast",
    "broadcast_",
    "broadcast_async",
    "broadcast_async_",
    "broadcast_object",
    "broadcast_optimizer_state",
    "broadcast_parameters",
    "cross_rank",
    "cross_size",
    "ddp_comm_hook",
    "grouped_allreduce",
    "grouped_allreduce_",
    "grouped_allreduce_async",
    "grouped_allreduce_async_",
    "init",
    "is_homogeneous",
    "is_initialized",
    "join",
    "local_rank",
    "local_size",
    "make_ddp_hook",
    "poll",
    "rank",
    "reducescatter",
    "reducescatter_async",
    "shutdown",
    "size",
    "synchronize",
]

# Horovod porting aids: hp.Compression.fp16, op=hp.Adasum (refused with a clear error)
from hipress.adapter_common import Adasum, Compression  # noqa: E402

from .sync_batch_norm import SyncBatchNorm  # noqa: E402

__all__ += ["Adasum", "Compression", "SyncBatchNorm"]
