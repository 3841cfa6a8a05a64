"""Process-level functions of the PyTorch adapter: tensors in, tensors out.

Each one converts torch tensors zero-copy (:mod:`hipress.torch.convert`) and calls the
core function of the same name; the spelling follows Horovod (``hvd.allreduce``,
``hvd.broadcast_parameters``, ``hvd.broadcast_optimizer_state``).
"""

from __future__ import annotations

import itertools
import threading
from typing import Any, Iterable, List, Mapping, Optional, Tuple, Union

import torch

import hipress
from hipress.adapter_common import (
    Average,
    check_op,
    join_leaves,
    leaf_slots,
    resolve_codec,
    split_leaves,
)

from .convert import (
    empty_from_meta,
    from_array,
    is_tensor,
    tensor_meta,
    to_array,
)


def init(config: Any = None, **overrides: Any) -> None:
    """Start HiPress on this rank (collective; see :func:`hipress.init`).

    Args:
        config: None (defaults < ``HIPRESS_CONFIG`` YAML < ``HIPRESS_*`` environment), a
            :class:`hipress.config.HiPressConfig`, a dict of the same keys, or a YAML path.
        **overrides: dotted keys overriding the config, e.g.
            ``init(**{"compression.algorithm": "onebit"})``.
    """
    hipress.init(config, **overrides)


def shutdown() -> None:
    """Stop HiPress on this rank (idempotent)."""
    hipress.shutdown()


def is_initialized() -> bool:
    """Return True between :func:`init` and :func:`shutdown`."""
    return hipress.is_initialized()


def rank() -> int:
    """Return this process's rank in the job (0 .. size-1)."""
    return hipress.rank()


def size() -> int:
    """Return the number of ranks in the job."""
    return hipress.size()


def local_rank() -> int:
    """Return this process's rank among the ranks on its host (use it to pick a GPU)."""
    return hipress.local_rank()


def local_size() -> int:
    """Return the number of ranks on this host."""
    return hipress.local_size()


def barrier() -> None:
    """Wait until every rank reaches this call."""
    hipress.barrier()


_noname = itertools.count()
_noname_lock = threading.Lock()


def _auto_name(kind: str) -> str:
    """Return ``<kind>.noname.<n>``: the same on every rank that calls in the same order."""
    with _noname_lock:
        return f"{kind}.noname.{next(_noname)}"


class Handle:
    """An in-flight :func:`allreduce_async`; pass it to :func:`synchronize`."""

    __slots__ = ("_core", "_like", "_keep")

    def __init__(self, core: Any, like: torch.Tensor, keep: Any) -> None:
        self._core = core
        self._like = like
        self._keep = keep  # the array handed to the core stays alive until synchronize


def allreduce_async(
    tensor: torch.Tensor,
    name: Optional[str] = None,
    op: str = Average,
    compression: Any = None,
    **codec_params: Any,
) -> Handle:
    """Start reducing ``tensor`` across ranks; return a handle for :func:`synchronize`.

    Args:
        tensor: float16/bfloat16/float32/float64 tensor on the CPU or a CUDA device; it
            must not change until the handle is synchronized (it is read in place).
        name: unique among in-flight submissions, identical on every rank. Default: a
            counter (``allreduce.noname.<n>``), correct when every rank calls in one order.
        op: ``hp.Average`` or ``hp.Sum``.
        compression: None (default): exact, no codec (metrics, losses, counts);
            a codec name or Codec instance: that codec whatever the size; ``"auto"``:
            the job's compression policy, as for gradients in the optimizer.
        **codec_params: parameters of the named codec.

    Raises:
        ValueError: ``name`` is still in flight, or a bad op.
    """
    if tensor.layout != torch.strided:
        tensor = tensor.coalesce().to_dense()
    array = to_array(tensor)
    core = hipress.allreduce_async(
        array,
        name=name or _auto_name("allreduce"),
        op=check_op(op),
        codec=resolve_codec(compression, codec_params),
    )
    return Handle(core, tensor, array)


def synchronize(handle: Handle) -> torch.Tensor:
    """Wait for an :func:`allreduce_async` and return the result as a new tensor.

    The result has the input's shape, dtype and device and is bit-identical on every rank.
    """
    return from_array(hipress.synchronize(handle._core), like=handle._like)


def poll(handle: Handle) -> bool:
    """Return True if :func:`synchronize` would not block."""
    return hipress.poll(handle._core)


def allreduce(
    tensor: torch.Tensor,
    name: Optional[str] = None,
    op: str = Average,
    compression: Any = None,
    **codec_params: Any,
) -> torch.Tensor:
    """Return the average (or sum) of ``tensor`` over all ranks, as a new tensor.

    See :func:`allreduce_async` for the arguments.
    """
    return synchronize(allreduce_async(tensor, name, op, compression, **codec_params))


def broadcast(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None) -> torch.Tensor:
    """Return ``root_rank``'s ``tensor`` on every rank, as a new tensor (same shape/dtype)."""
    result = hipress.broadcast(to_array(tensor), root_rank, name or _auto_name("broadcast"))
    return from_array(result, like=tensor)


def broadcast_(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None) -> torch.Tensor:
    """Overwrite ``tensor`` in place with ``root_rank``'s values; return it."""
    result = broadcast(tensor, root_rank, name)
    if hipress.rank() != root_rank:
        with torch.no_grad():
            tensor.copy_(result)
    return tensor


def broadcast_object(obj: Any, root_rank: int = 0, name: str = "") -> Any:
    """Return ``root_rank``'s ``obj`` on every rank (small picklable objects only)."""
    return hipress.broadcast_object(obj, root=root_rank, name=name)


def broadcast_parameters(
    params: Union[Mapping[str, Any], Iterable[Tuple[str, torch.Tensor]], Iterable[torch.Tensor]],
    root_rank: int = 0,
) -> None:
    """Overwrite every rank's tensors in place with ``root_rank``'s (model initialization).

    Args:
        params: ``model.state_dict()`` (buffers included), ``model.named_parameters()``,
            or a list of tensors; entries that are not tensors are skipped.
        root_rank: the rank whose values everyone gets.
    """
    if isinstance(params, Mapping):
        items: List[Tuple[str, Any]] = list(params.items())
    else:
        items = [
            p if isinstance(p, tuple) else (f"param.{i}", p) for i, p in enumerate(params)
        ]
    for name, t in items:
        if is_tensor(t):
            broadcast_(t, root_rank, name=f"broadcast_parameters.{name}")


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int = 0) -> None:
    """Give every rank ``root_rank``'s optimizer state (momenta, step counts, hyper-params).

    The state's structure and scalars travel as one small pickled object; every tensor
    travels through :func:`hipress.broadcast`. HiPress's own per-rank state (residuals) is
    not broadcast: it is each rank's local error.

    Args:
        optimizer: a torch optimizer or a :func:`DistributedOptimizer`, built over the same
            parameters on every rank.
        root_rank: the rank whose state everyone gets.
    """
    from .optimizer import _DistributedOptimizer

    if isinstance(optimizer, _DistributedOptimizer):
        get, load = optimizer._hp_framework_state_dict, optimizer._hp_load_framework_state_dict
    else:
        get, load = optimizer.state_dict, optimizer.load_state_dict
    is_root = hipress.rank() == root_rank
    skeleton, leaves = split_leaves(get(), is_tensor, tensor_meta) if is_root else (None, [])
    skeleton = hipress.broadcast_object(skeleton, root=root_rank, name="optimizer_state")
    received = []
    for slot in leaf_slots(skeleton):
        t = leaves[slot.index].detach().cpu() if is_root else empty_from_meta(slot.meta)
        received.append(broadcast(t, root_rank, name=f"optimizer_state.{slot.index}"))
    if not is_root:
        load(join_leaves(skeleton, lambda slot: received[slot.index]))
