"""HiPress: compression-aware gradient synchronization for data-parallel training.

After Bai et al., "Gradient Compression Supercharged High-Performance Data Parallel DNN
Training", SOSP 2021. The core is framework-neutral (NumPy on the CPU, CuPy on the GPU);
framework adapters are ``hipress.torch``, ``hipress.tensorflow`` and ``hipress.mxnet``.
"""

__version__ = "0.1.0"

from hipress.api import (  # noqa: E402
    allreduce,
    allreduce_async,
    barrier,
    broadcast,
    broadcast_object,
    init,
    is_initialized,
    load_state_dict,
    local_rank,
    local_size,
    poll,
    rank,
    reset_state,
    shutdown,
    size,
    state_dict,
    stats,
    step,
    synchronize,
)
from hipress.engine import POLICY, Handle  # noqa: E402

__all__ = [
    "POLICY",
    "Handle",
    "allreduce",
    "allreduce_async",
    "barrier",
    "broadcast",
    "broadcast_object",
    "init",
    "is_initialized",
    "load_state_dict",
    "local_rank",
    "local_size",
    "poll",
    "rank",
    "reset_state",
    "shutdown",
    "size",
    "state_dict",
    "stats",
    "step",
    "synchronize",
]
