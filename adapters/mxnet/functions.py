"""Process-level functions of the MXNet adapter: NDArrays in, NDArrays out.

Each function converts NDArrays zero-copy (:mod:`hipress.mxnet.convert`) and calls the core
function of the same name; the spelling follows Horovod (``hvd.allreduce``,
``hvd.broadcast_parameters``).
Process control (``init``, ``shutdown``, ``rank``, ``size``, ``barrier``, ...) is
:mod:`hipress`'s own, re-exported unchanged.
"""

from __future__ import annotations

import itertools
import logging
import threading
import types
from typing import Any, List, Mapping, Optional, Sequence

import mxnet as mx

import hipress
from hipress.adapter_common import Average, check_op, refuses_horovod_args, resolve_codec
from hipress.api import (  # noqa: F401  (process control is framework-neutral: re-exported)
    barrier,
    cross_rank,
    cross_size,
    init,
    is_homogeneous,
    is_initialized,
    local_rank,
    local_size,
    rank,
    shutdown,
    size,
)

from .convert import from_array, to_array, write_into

logger = logging.getLogger(__name__)


_noname = itertools.count()
_noname_lock = threading.Lock()


def _auto_name(kind: str) -> str:
    """Return ``<kind>.noname.<n>``: the same on every rank that calls in the same order."""
    with _noname_lock:
        return f"{kind}.noname.{next(_noname)}"


def allreduce(
    tensor: mx.nd.NDArray,
    name: Optional[str] = None,
    op: str = Average,
    compression: Any = None,
    **codec_params: Any,
) -> mx.nd.NDArray:
    """Return the average (or sum) of ``tensor`` over all ranks, as a new NDArray.

    Args:
        tensor: an NDArray (sparse storage is densified): float16/float32/float64 with any
            op; integer dtypes uncompressed with ``hp.Sum``, ``hp.Min``, ``hp.Max`` or
            ``hp.Product`` (an integer average would truncate and is refused).
        name: unique among in-flight submissions, identical on every rank. Default: a
            counter (``allreduce.noname.<n>``), correct when every rank calls in one order.
        op: ``hp.Average``, ``hp.Sum``, ``hp.Min``, ``hp.Max`` or ``hp.Product`` (the last
            three uncompressed).
        compression: None (default): exact, no codec (metrics, losses, counts);
            a codec name or Codec instance: that codec whatever the size; ``"auto"``:
            the job's compression policy, as for gradients in the optimizer.
        **codec_params: parameters of the named codec.

    Returns:
        An NDArray of the input's shape, dtype and context, bit-identical on every rank.

    Raises:
        ValueError: ``name`` is still in flight, or a bad op.
        TypeError: an unsupported dtype.
    """
    result = hipress.allreduce(
        to_array(tensor, any_dtype=True),
        name=name or _auto_name("allreduce"),
        op=check_op(op),
        codec=resolve_codec(compression, codec_params),
    )
    return from_array(result, ctx=tensor.context)


def allreduce_(tensor: mx.nd.NDArray, name: Optional[str] = None, op: str = Average,
               compression: Any = None, **codec_params: Any) -> mx.nd.NDArray:
    """Overwrite ``tensor`` in place with :func:`allreduce`'s result; return it."""
    result = hipress.allreduce(
        to_array(tensor, any_dtype=True),
        name=name or _auto_name("allreduce"),
        op=check_op(op),
        codec=resolve_codec(compression, codec_params),
    )
    write_into(tensor, result)
    return tensor


def grouped_allreduce(tensors: Sequence[mx.nd.NDArray], name: Optional[str] = None,
                      op: str = Average, compression: Any = None,
                      **codec_params: Any) -> List[mx.nd.NDArray]:
    """Allreduce several NDArrays in one negotiation; return new NDArrays in input order.

    They are named ``<name>.<i>``; arguments as :func:`allreduce`.
    """
    tensors = list(tensors)
    results = _grouped(tensors, name, op, compression, codec_params)
    return [from_array(r, ctx=t.context) for r, t in zip(results, tensors)]


def grouped_allreduce_(tensors: Sequence[mx.nd.NDArray], name: Optional[str] = None,
                       op: str = Average, compression: Any = None,
                       **codec_params: Any) -> List[mx.nd.NDArray]:
    """In-place :func:`grouped_allreduce`; returns ``tensors``."""
    tensors = list(tensors)
    for r, t in zip(_grouped(tensors, name, op, compression, codec_params), tensors):
        write_into(t, r)
    return tensors


def _grouped(tensors: List[mx.nd.NDArray], name: Optional[str], op: str, compression: Any,
             codec_params: Any) -> List[Any]:
    base = name or _auto_name("grouped_allreduce")
    return hipress.grouped_allreduce(
        [to_array(t, any_dtype=True) for t in tensors],
        [f"{base}.{i}" for i in range(len(tensors))], op=check_op(op),
        codec=resolve_codec(compression, codec_params))


@refuses_horovod_args
def allgather(tensor: mx.nd.NDArray, name: Optional[str] = None) -> mx.nd.NDArray:
    """Return every rank's ``tensor`` concatenated along dimension 0, in rank order.

    The first dimension may differ across ranks; the others and the dtype must not (else
    every rank raises :class:`hipress.errors.CollectiveArgumentError`).
    """
    result = hipress.allgather(to_array(tensor, any_dtype=True),
                               name or _auto_name("allgather"))
    return from_array(result, ctx=tensor.context)


@refuses_horovod_args
def allgather_object(obj: Any, name: Optional[str] = None) -> List[Any]:
    """Return the list of every rank's picklable ``obj``, in rank order (small objects)."""
    return hipress.allgather_object(obj, name or _auto_name("allgather_object"))


@refuses_horovod_args
def alltoall(tensor: mx.nd.NDArray, splits: Any = None, name: Optional[str] = None) -> Any:
    """Send ``splits[j]`` rows of ``tensor`` to rank j; return the rows sent here.

    ``splits``: rows per destination rank (list or NDArray of ``size()`` integers adding
    up to ``shape[0]``), None for equal parts. Returns the rows received, concatenated in
    source-rank order, and with ``splits`` given (as Horovod) also an int32 NDArray of the
    rows received from each rank. Invalid splits on any rank raise
    :class:`hipress.errors.CollectiveArgumentError` on every rank before data moves.
    """
    if isinstance(splits, mx.nd.NDArray):
        splits = [int(v) for v in splits.asnumpy()]
    out, received = hipress.alltoall(to_array(tensor, any_dtype=True),
                                     name or _auto_name("alltoall"), splits)
    out = from_array(out, ctx=tensor.context)
    if splits is None:
        return out
    return out, mx.nd.array(received, dtype="int32")


@refuses_horovod_args
def reducescatter(tensor: mx.nd.NDArray, name: Optional[str] = None,
                  op: str = Average) -> mx.nd.NDArray:
    """Reduce ``tensor`` over ranks; return this rank's block of rows.

    Lower ranks get the extra rows, as Horovod. Exact; ops and dtypes as
    :func:`allreduce` uncompressed.
    """
    result = hipress.reducescatter(to_array(tensor, any_dtype=True),
                                   name or _auto_name("reducescatter"), op=check_op(op))
    return from_array(result, ctx=tensor.context)


@refuses_horovod_args
def join() -> int:
    """Say this rank has run out of data; return the rank that joined last (every rank).

    Until every rank has joined, this rank adds zeros to the others' average/sum
    allreduces (the trainer's gradients included) and is not counted in averages.
    """
    return hipress.join()


@refuses_horovod_args
def broadcast(tensor: mx.nd.NDArray, root_rank: int, name: Optional[str] = None) -> mx.nd.NDArray:
    """Return ``root_rank``'s ``tensor`` on every rank, as a new NDArray."""
    result = hipress.broadcast(to_array(tensor, any_dtype=True), root_rank,
                               name or _auto_name("broadcast"))
    return from_array(result, ctx=tensor.context)


@refuses_horovod_args
def broadcast_(tensor: mx.nd.NDArray, root_rank: int,
               name: Optional[str] = None) -> mx.nd.NDArray:
    """Overwrite ``tensor`` in place with ``root_rank``'s values; return it."""
    result = hipress.broadcast(to_array(tensor, any_dtype=True), root_rank,
                               name or _auto_name("broadcast"))
    if hipress.rank() != root_rank:
        write_into(tensor, result)
    return tensor


@refuses_horovod_args
def broadcast_object(obj: Any, root_rank: int = 0, name: str = "") -> Any:
    """Return ``root_rank``'s ``obj`` on every rank (small picklable objects only)."""
    return hipress.broadcast_object(obj, root=root_rank, name=name)


def broadcast_parameters(params: Mapping[str, Any], root_rank: int = 0) -> None:
    """Overwrite every rank's parameters in place with ``root_rank``'s (model initialization).

    Args:
        params: ``net.collect_params()`` (a ``ParameterDict``), a dict of Gluon
            ``Parameter`` or a dict of NDArrays (``arg_params``). Entries are broadcast in
            sorted key order; every rank must pass the same keys. A parameter whose
            initialization is deferred (shape known only at the first forward pass) is
            broadcast right after it is initialized, on that first forward pass (as
            Horovod does). Every other broadcast is started before the first is waited
            for, so they share negotiation rounds.
        root_rank: the rank whose values everyone gets.

    Raises:
        TypeError: ``params`` is not a mapping.
    """
    if not hasattr(params, "items"):
        raise TypeError(
            f"expect net.collect_params() or a dict of Parameters/NDArrays, got {type(params)}"
        )
    todo = []  # (array, name): every broadcast starts before the first is waited for
    for key, p in sorted(params.items()):
        name = f"broadcast_parameters.{key}"
        if isinstance(p, mx.gluon.Parameter):
            if p._deferred_init:
                p._init_impl = types.MethodType(_broadcast_after_init(p, root_rank, name), p)
                logger.debug("parameter %s: deferred initialization, broadcast at first use", key)
                continue
            # one name per copy (a parameter has one per context): names in flight differ
            todo += [(data, name if i == 0 else f"{name}@{i}")
                     for i, data in enumerate(p.list_data())]
        elif isinstance(p, mx.nd.NDArray):
            todo.append((p, name))
        else:
            raise TypeError(f"entry {key!r} is a {type(p)}, not a Parameter or NDArray")
    handles = [hipress.broadcast_async(to_array(t, any_dtype=True), root_rank, name)
               for t, name in todo]
    for (t, _), handle in zip(todo, handles):
        result = hipress.synchronize(handle)
        if hipress.rank() != root_rank:
            write_into(t, result)


def _broadcast_after_init(param: Any, root_rank: int, name: str) -> Any:
    """Return an ``_init_impl`` replacement that broadcasts the fresh values."""
    init_impl = param._init_impl

    def wrapped(self: Any, *args: Any, **kwargs: Any) -> None:
        init_impl(*args, **kwargs)
        for data in self.list_data():
            broadcast_(data, root_rank, name=name)

    return wrapped
