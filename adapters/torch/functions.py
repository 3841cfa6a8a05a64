"""Process-level functions of the PyTorch adapter: tensors in, tensors out.

Each one converts torch tensors zero-copy (:mod:`hipress.torch.convert`) and calls the
core function of the same name; the spelling follows ``horovod.torch`` (``allreduce``,
``allreduce_``, ``allreduce_async``, ``grouped_allreduce``, ``allgather``, ``alltoall``,
``reducescatter``, ``broadcast_async_``, ``join``, ``broadcast_parameters``, ...).
``allreduce`` and ``allgather`` are differentiable, as Horovod's: autograd flows through
them (the gradient of an average is the average of the gradients).
"""

from __future__ import annotations

import itertools
import threading
from typing import Any, Callable, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

import torch

import hipress
from hipress.adapter_common import (
    Average,
    Sum,
    check_op,
    join_leaves,
    leaf_slots,
    refuses_horovod_args,
    resolve_codec,
    split_leaves,
)
from hipress.api import allgather_rows

from .convert import (
    empty_from_meta,
    from_array,
    is_tensor,
    shares_memory,
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
    """An in-flight ``*_async`` operation; pass it to :func:`synchronize` or :func:`poll`."""

    __slots__ = ("_core", "_like", "_keep", "_post")

    def __init__(self, core: Any, like: torch.Tensor, keep: Any,
                 post: Optional[Callable[[Any], Any]] = None) -> None:
        self._core = core
        self._like = like
        self._keep = keep  # the array handed to the core stays alive until synchronize
        # turns the core's result into what synchronize returns (default: a tensor like
        # the input)
        self._post = post or (lambda res: from_array(res, like=like))


def _inplace_post(tensor: torch.Tensor) -> Callable[[Any], torch.Tensor]:
    """Return a result handler writing the core's result into ``tensor`` (returned)."""
    def post(res: Any) -> torch.Tensor:
        if not shares_memory(res, tensor):
            with torch.no_grad():
                tensor.copy_(from_array(res, like=tensor).reshape(tensor.shape))
        return tensor
    return post


def allreduce_async(
    tensor: torch.Tensor,
    name: Optional[str] = None,
    op: str = Average,
    compression: Any = None,
    **codec_params: Any,
) -> Handle:
    """Start reducing ``tensor`` across ranks; return a handle for :func:`synchronize`.

    Args:
        tensor: a tensor on the CPU or a CUDA device; it must not change until the handle
            is synchronized (it is read in place). Floating dtypes with any op; integer
            and bool dtypes uncompressed with ``hp.Sum``, ``hp.Min``, ``hp.Max`` or
            ``hp.Product`` (an integer average would truncate and is refused).
        name: unique among in-flight submissions, identical on every rank. Default: a
            counter (``allreduce.noname.<n>``), correct when every rank calls in one order.
        op: ``hp.Average``, ``hp.Sum``, ``hp.Min``, ``hp.Max`` or ``hp.Product`` (the last
            three uncompressed).
        compression: None (default): exact, no codec (metrics, losses, counts);
            a codec name or Codec instance: that codec whatever the size; ``"auto"``:
            the job's compression policy, as for gradients in the optimizer.
        **codec_params: parameters of the named codec.

    Raises:
        ValueError: ``name`` is still in flight, or a bad op.
        TypeError: a dtype the op or codec cannot take.
    """
    if tensor.layout != torch.strided:
        tensor = tensor.coalesce().to_dense()
    array = to_array(tensor)
    return Handle(_submit(array, name, op, compression, codec_params), tensor, array)


def _submit(array: Any, name: Optional[str], op: str, compression: Any, codec_params: Any,
            inplace: bool = False) -> Any:
    """Submit one allreduce to the core with the adapter's argument conventions."""
    return hipress.allreduce_async(array, name=name or _auto_name("allreduce"),
                                   op=check_op(op),
                                   codec=resolve_codec(compression, codec_params),
                                   inplace=inplace)


def allreduce_async_(
    tensor: torch.Tensor,
    name: Optional[str] = None,
    op: str = Average,
    compression: Any = None,
    **codec_params: Any,
) -> Handle:
    """Start an in-place allreduce: :func:`synchronize` writes the result into ``tensor``.

    Contiguous tensors are reduced straight in their own memory. Arguments as
    :func:`allreduce_async`.
    """
    array = to_array(tensor)
    return Handle(_submit(array, name, op, compression, codec_params, inplace=True), tensor,
                  array, _inplace_post(tensor))


def allreduce_(
    tensor: torch.Tensor,
    name: Optional[str] = None,
    op: str = Average,
    compression: Any = None,
    **codec_params: Any,
) -> torch.Tensor:
    """Reduce ``tensor`` over all ranks in place; return it (see :func:`allreduce_async`)."""
    return synchronize(allreduce_async_(tensor, name, op, compression, **codec_params))


def synchronize(handle: Handle) -> Any:
    """Wait for an ``*_async`` operation and return its result.

    An allreduce or broadcast gives a tensor of the input's shape, dtype and device
    (the input itself for the in-place ``*_async_`` forms), bit-identical on every rank;
    the other collectives give what their blocking form returns.
    """
    return _handle(handle, "synchronize")._post(hipress.synchronize(handle._core))


def poll(handle: Handle) -> bool:
    """Return True if :func:`synchronize` would not block.

    Raises:
        TypeError: ``handle`` is not a handle from an ``*_async`` call.
    """
    return hipress.poll(_handle(handle, "poll")._core)


def _handle(handle: Any, what: str) -> Handle:
    """Return ``handle`` if it is this adapter's :class:`Handle`, else raise a TypeError."""
    if not isinstance(handle, Handle):
        raise hipress.api.not_a_handle(handle, what)
    return handle


def allreduce(
    tensor: torch.Tensor,
    name: Optional[str] = None,
    op: str = Average,
    compression: Any = None,
    **codec_params: Any,
) -> torch.Tensor:
    """Return the reduction (average by default) of ``tensor`` over all ranks, as a new tensor.

    Differentiable (as ``horovod.torch.allreduce``): when ``tensor`` requires grad and
    ``op`` is ``hp.Average`` or ``hp.Sum``, the backward pass allreduces the incoming
    gradient with the same op (exact, under the name ``<name>.grad``). See
    :func:`allreduce_async` for the arguments.
    """
    name = name or _auto_name("allreduce")
    op = check_op(op)
    if tensor.requires_grad and torch.is_grad_enabled() and op in (Average, Sum):
        return _AllreduceFn.apply(tensor, name, op, compression, codec_params)
    return synchronize(allreduce_async(tensor, name, op, compression, **codec_params))


class _AllreduceFn(torch.autograd.Function):
    """Autograd through an allreduce: backward is the same allreduce of the gradient."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: str, op: str, compression: Any,
                codec_params: dict) -> torch.Tensor:
        ctx.name, ctx.op = name, op
        return synchronize(allreduce_async(tensor, name, op, compression, **codec_params))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Tuple[Any, ...]:
        return (synchronize(allreduce_async(grad.contiguous(), f"{ctx.name}.grad", ctx.op)),
                None, None, None, None)


def grouped_allreduce_async(
    tensors: Sequence[torch.Tensor],
    name: Optional[str] = None,
    op: str = Average,
    compression: Any = None,
    **codec_params: Any,
) -> Handle:
    """Start allreducing several tensors negotiated together; see :func:`grouped_allreduce`."""
    return _grouped(tensors, name, op, compression, codec_params, inplace=False)


def grouped_allreduce_async_(
    tensors: Sequence[torch.Tensor],
    name: Optional[str] = None,
    op: str = Average,
    compression: Any = None,
    **codec_params: Any,
) -> Handle:
    """In-place :func:`grouped_allreduce_async`: :func:`synchronize` returns ``tensors``."""
    return _grouped(tensors, name, op, compression, codec_params, inplace=True)


def _grouped(tensors: Sequence[torch.Tensor], name: Optional[str], op: str, compression: Any,
             codec_params: Any, inplace: bool) -> Handle:
    tensors = list(tensors)
    base = name or _auto_name("grouped_allreduce")
    arrays = [to_array(t) for t in tensors]
    cores = hipress.grouped_allreduce_async(
        arrays, [f"{base}.{i}" for i in range(len(tensors))], op=check_op(op),
        codec=resolve_codec(compression, codec_params), inplace=inplace)
    posts = [_inplace_post(t) if inplace else
             (lambda res, t=t: from_array(res, like=t)) for t in tensors]
    return Handle(_Group(cores), tensors[0] if tensors else torch.empty(0), arrays,
                  lambda results: [p(r) for p, r in zip(posts, results)])


class _Group:
    """Several core handles waited on as one (what grouped collectives return)."""

    def __init__(self, handles: List[Any]) -> None:
        self.handles = handles

    def done(self) -> bool:
        return all(h.done() for h in self.handles)

    def wait(self, timeout: Optional[float] = None) -> List[Any]:
        return [h.wait(timeout) for h in self.handles]


def grouped_allreduce(
    tensors: Sequence[torch.Tensor],
    name: Optional[str] = None,
    op: str = Average,
    compression: Any = None,
    **codec_params: Any,
) -> List[torch.Tensor]:
    """Allreduce several tensors in one negotiation; return new tensors in input order.

    The tensors are named ``<name>.<i>``; they become ready together on every rank and
    small ones share fusion buffers. Arguments as :func:`allreduce_async`.
    """
    return synchronize(grouped_allreduce_async(tensors, name, op, compression, **codec_params))


def grouped_allreduce_(
    tensors: Sequence[torch.Tensor],
    name: Optional[str] = None,
    op: str = Average,
    compression: Any = None,
    **codec_params: Any,
) -> List[torch.Tensor]:
    """In-place :func:`grouped_allreduce`; returns ``tensors``."""
    return synchronize(grouped_allreduce_async_(tensors, name, op, compression, **codec_params))


@refuses_horovod_args
def allgather_async(tensor: torch.Tensor, name: Optional[str] = None) -> Handle:
    """Start an allgather; :func:`synchronize` returns what :func:`allgather` does."""
    array = to_array(tensor)
    core = hipress.allgather_async(array, name or _auto_name("allgather"))
    return Handle(core, tensor, array)


@refuses_horovod_args
def allgather(tensor: torch.Tensor, name: Optional[str] = None) -> torch.Tensor:
    """Return every rank's ``tensor`` concatenated along dimension 0, in rank order.

    The first dimension may differ across ranks; the others and the dtype must not (else
    every rank raises :class:`hipress.errors.CollectiveArgumentError`). Any dtype but
    complex. Differentiable (as ``horovod.torch.allgather``): the backward pass averages
    the incoming gradient over ranks and returns this rank's rows of it.
    """
    name = name or _auto_name("allgather")
    if tensor.requires_grad and torch.is_grad_enabled():
        return _AllgatherFn.apply(tensor, name)
    return synchronize(allgather_async(tensor, name))


class _AllgatherFn(torch.autograd.Function):
    """Autograd through an allgather: average the gradient, keep this rank's rows."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: str) -> torch.Tensor:
        ctx.name = name
        out, rows = allgather_rows(to_array(tensor), name)
        ctx.offset, ctx.rows = sum(rows[:hipress.rank()]), rows[hipress.rank()]
        return from_array(out, like=tensor)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Tuple[Any, ...]:
        avg = synchronize(allreduce_async(grad.contiguous(), f"{ctx.name}.grad", Average))
        return avg.narrow(0, ctx.offset, ctx.rows), None


@refuses_horovod_args
def allgather_object(obj: Any, name: Optional[str] = None) -> List[Any]:
    """Return the list of every rank's picklable ``obj``, in rank order (small objects)."""
    return hipress.allgather_object(obj, name or _auto_name("allgather_object"))


@refuses_horovod_args
def alltoall_async(tensor: torch.Tensor, splits: Any = None,
                   name: Optional[str] = None) -> Handle:
    """Start an alltoall; :func:`synchronize` returns ``(tensor, received_splits)``."""
    array = to_array(tensor)
    if isinstance(splits, torch.Tensor):
        splits = splits.tolist()
    core = hipress.alltoall_async(array, name or _auto_name("alltoall"), splits)
    return Handle(core, tensor, array,
                  lambda res: (from_array(res[0], like=tensor),
                               torch.tensor(res[1], dtype=torch.int32)))


@refuses_horovod_args
def alltoall(tensor: torch.Tensor, splits: Any = None, name: Optional[str] = None) -> Any:
    """Send ``splits[j]`` rows of ``tensor`` to rank j; return the rows every rank sent here.

    Args:
        tensor: ``ndim >= 1``; trailing dimensions and dtype equal on every rank.
        splits: rows per destination rank (a list or an int tensor of ``size()`` entries
            adding up to ``tensor.shape[0]``); None: equal parts (``shape[0]`` must divide
            by ``size()``).
        name: identical on every rank.

    Returns:
        The received rows concatenated in source-rank order; with ``splits`` given, as in
        Horovod, ``(received, received_splits)`` where ``received_splits`` is an int32
        tensor of rows from each rank.

    Raises:
        CollectiveArgumentError: on every rank, before any data moves, when some rank's
            splits do not add up or ranks disagree on dtype or trailing dimensions.
    """
    out, received = synchronize(alltoall_async(tensor, splits, name))
    return out if splits is None else (out, received)


@refuses_horovod_args
def reducescatter_async(tensor: torch.Tensor, name: Optional[str] = None,
                        op: str = Average) -> Handle:
    """Start a reduce-scatter; :func:`synchronize` returns this rank's reduced rows."""
    array = to_array(tensor)
    core = hipress.reducescatter_async(array, name or _auto_name("reducescatter"),
                                       op=check_op(op))
    return Handle(core, tensor, array)


@refuses_horovod_args
def reducescatter(tensor: torch.Tensor, name: Optional[str] = None,
                  op: str = Average) -> torch.Tensor:
    """Reduce ``tensor`` over ranks; return this rank's block of rows of the result.

    Dimension 0 is split as evenly as possible, lower ranks getting one extra row (as
    Horovod). Exact; ops and dtypes as :func:`allreduce_async` without compression.
    """
    return synchronize(reducescatter_async(tensor, name, op))


@refuses_horovod_args
def join(device: int = -1) -> int:
    """Say this rank has run out of data; return the rank that joined last (every rank).

    Until every rank has joined, this rank takes part in the others' average/sum
    allreduces (the DistributedOptimizer's gradients included) with zeros and is not
    counted in averages. ``device`` is accepted for Horovod compatibility and unused.
    """
    del device
    return hipress.join()


@refuses_horovod_args
def broadcast(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None) -> torch.Tensor:
    """Return ``root_rank``'s ``tensor`` on every rank, as a new tensor (same shape/dtype)."""
    return synchronize(broadcast_async(tensor, root_rank, name))


@refuses_horovod_args
def broadcast_(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None) -> torch.Tensor:
    """Overwrite ``tensor`` in place with ``root_rank``'s values; return it."""
    return synchronize(broadcast_async_(tensor, root_rank, name))


@refuses_horovod_args
def broadcast_async(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None) -> Handle:
    """Start a broadcast; :func:`synchronize` returns ``root_rank``'s tensor (new tensor)."""
    array = to_array(tensor)
    core = hipress.broadcast_async(array, root_rank, name or _auto_name("broadcast"))
    return Handle(core, tensor, array)


@refuses_horovod_args
def broadcast_async_(tensor: torch.Tensor, root_rank: int,
                     name: Optional[str] = None) -> Handle:
    """In-place :func:`broadcast_async`: :func:`synchronize` writes into ``tensor``."""
    handle = broadcast_async(tensor, root_rank, name)
    is_root = hipress.rank() == root_rank

    def post(res: Any) -> torch.Tensor:
        if not is_root:
            with torch.no_grad():
                tensor.copy_(from_array(res, like=tensor))
        return tensor

    handle._post = post
    return handle


@refuses_horovod_args
def broadcast_object(obj: Any, root_rank: int = 0, name: str = "") -> Any:
    """Return ``root_rank``'s ``obj`` on every rank (small picklable objects only)."""
    return hipress.broadcast_object(obj, root=root_rank, name=name)


def broadcast_parameters(
    params: Union[Mapping[str, Any], Iterable[Tuple[str, torch.Tensor]], Iterable[torch.Tensor]],
    root_rank: int = 0,
) -> None:
    """Overwrite every rank's tensors in place with ``root_rank``'s (model initialization).

    Every broadcast is started before the first is waited for (as Horovod does), so they
    share negotiation rounds: ResNet-50's 320 state tensors took 328 rounds and 4.1 s
    one at a time on 4 emulated hosts.

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
    handles = [broadcast_async_(t, root_rank, name=f"broadcast_parameters.{name}")
               for name, t in items if is_tensor(t)]
    for handle in handles:
        synchronize(handle)


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
    handles = []  # all started before any is waited for: they share negotiation rounds
    for slot in leaf_slots(skeleton):
        t = leaves[slot.index].detach().cpu() if is_root else empty_from_meta(slot.meta)
        handles.append(broadcast_async(t, root_rank, name=f"optimizer_state.{slot.index}"))
    received = [synchronize(h) for h in handles]
    if not is_root:
        load(join_leaves(skeleton, lambda slot: received[slot.index]))
