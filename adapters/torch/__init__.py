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
    allreduce, allreduce_async, synchronize, poll, broadcast, broadcast_,
    broadcast_object, broadcast_parameters, broadcast_optimizer_state: tensor
        collectives.
    DistributedOptimizer: wraps a torch optimizer (:mod:`hipress.torch.optimizer`).
    ddp_comm_hook, make_ddp_hook, DDPHookState: DistributedDataParallel communication
        hook (:mod:`hipress.torch.ddp`).
    Average, Sum: reduction ops.
"""

from hipress.adapter_common import Average, BackwardPassError, Sum

from .ddp import DDPHookState, ddp_comm_hook, make_ddp_hook
from .functions import (
    Handle,
    allreduce,
    allreduce_async,
    barrier,
    broadcast,
    broadcast_,
    broadcast_object,
    broadcast_optimizer_state,
    broadcast_parameters,
    init,
    is_initialized,
    local_rank,
    local_size,
    poll,
    rank,
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
    "Sum",
    "allreduce",
    "allreduce_async",
    "barrier",
    "broadcast",
    "broadcast_",
    "broadcast_object",
    "broadcast_optimizer_state",
    "broadcast_parameters",
    "ddp_comm_hook",
    "init",
    "is_initialized",
    "local_rank",
    "local_size",
    "make_ddp_hook",
    "poll",
    "rank",
    "shutdown",
    "size",
    "synchronize",
]
