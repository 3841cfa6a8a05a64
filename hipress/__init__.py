"""HiPress: compression-aware gradient synchronization for data-parallel training.

After Bai et al., "Gradient Compression Supercharged High-Performance Data Parallel DNN
Training", SOSP 2021. The core is framework-neutral (NumPy on the CPU, CuPy on the GPU);
framework adapters are ``hipress.torch``, ``hipress.tensorflow`` and ``hipress.mxnet``.
"""

__version__ = "0.1.0"

from hipress.api import (  # noqa: E402
    allgather,
    allgather_async,
    allgather_object,
    allreduce,
    allreduce_async,
    alltoall,
    alltoall_async,
    barrier,
    broadcast,
    broadcast_async,
    broadcast_object,
    cross_rank,
    cross_size,
    grouped_allreduce,
    grouped_allreduce_async,
    init,
    is_homogeneous,
    is_initialized,
    join,
    load_state_dict,
    local_rank,
    local_size,
    poll,
    rank,
    reducescatter,
    reducescatter_async,
    reset_state,
    shutdown,
    size,
    state_dict,
    stats,
    step,
    synchronize,
)
from hipress.engine import POLICY, Handle  # noqa: E402


def _install_codec_loaders() -> None:
    """Send ``compll.*`` codec names to :mod:`hipress.compll`, imported on the first one.

    The codec registry does not import CompLL (CompLL builds on it); this stand-in loader
    only imports ``hipress.compll``, whose import installs the real loader, which the
    registry then asks in turn.
    """
    import importlib

    from hipress.codecs.base import register_codec_loader

    def _import_compll(*_: object) -> None:
        importlib.import_module("hipress.compll")

    register_codec_loader("compll.", _import_compll, _import_compll)


_install_codec_loaders()

__all__ = [
    "allgather",
    "allgather_async",
    "allgather_object",
    "alltoall",
    "alltoall_async",
    "broadcast_async",
    "cross_rank",
    "cross_size",
    "grouped_allreduce",
    "grouped_allreduce_async",
    "is_homogeneous",
    "join",
    "reducescatter",
    "reducescatter_async",
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
