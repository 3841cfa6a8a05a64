"""Process-level functions of the TensorFlow adapter: tensors in, tensors out.

Each function converts tensors zero-copy (:mod:`hipress.tensorflow.convert`) and calls the
core function of the same name. They work eagerly and inside ``tf.function``, where the
call is wrapped in a ``tf.py_function`` (see :mod:`hipress.tensorflow.reducer`).
Process control (``init``, ``shutdown``, ``rank``, ``size``, ``barrier``, ...) is
:mod:`hipress`'s own, re-exported unchanged.
"""

from __future__ import annotations

import itertools
import threading
from typing import Any, Callable, Iterable, List, Optional, Sequence

import tensorflow as tf

import hipress
from hipress.adapter_common import (
    Average,
    check_op,
    refuses_horovod_args,
    resolve_codec,
    unique_names,
)
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

from .convert import from_array, to_array, variable_name

_noname = itertools.count()
_noname_lock = threading.Lock()


def _auto_name(kind: str) -> str:
    """Return ``<kind>.noname.<n>``: the same on every rank that calls in the same order."""
    with _noname_lock:
        return f"{kind}.noname.{next(_noname)}"


def allreduce(
    tensor: Any,
    name: Optional[str] = None,
    op: str = Average,
    compression: Any = None,
    **codec_params: Any,
) -> tf.Tensor:
    """Return the average (or sum) of ``tensor`` over all ranks, as a new tensor.

    Works eagerly and inside ``tf.function`` (through ``tf.py_function``).

    Args:
        tensor: a dense tensor (an ``IndexedSlices`` is densified): float16/bfloat16/
            float32/float64 with any op; integer and bool dtypes uncompressed with
            ``hp.Sum``, ``hp.Min``, ``hp.Max`` or ``hp.Product`` (an integer average would
            truncate and is refused).
        name: unique among in-flight submissions, identical on every rank. Default: a
            counter (``allreduce.noname.<n>``), correct when every rank calls in one order
            (inside ``tf.function`` the name is fixed when the function is traced).
        op: ``hp.Average``, ``hp.Sum``, ``hp.Min``, ``hp.Max`` or ``hp.Product`` (the last
            three uncompressed).
        compression: None (default): exact, no codec (metrics, losses, counts);
            a codec name or Codec instance: that codec whatever the size; ``"auto"``:
            the job's compression policy, as for gradients in the optimizer.
        **codec_params: parameters of the named codec.

    Returns:
        A tensor of the input's shape and dtype, bit-identical on every rank.

    Raises:
        ValueError: ``name`` is still in flight, or a bad op.
    """
    if isinstance(tensor, tf.IndexedSlices):
        tensor = tf.convert_to_tensor(tensor)
    tensor = tf.convert_to_tensor(tensor)
    name = name or _auto_name("allreduce")
    op = check_op(op)
    codec = resolve_codec(compression, codec_params)

    def run(t: tf.Tensor) -> tf.Tensor:
        array = to_array(t)
        return from_array(hipress.allreduce(array, name=name, op=op, codec=codec), t.dtype)

    if tf.executing_eagerly():
        return run(tensor)
    out = tf.py_function(run, [tensor], Tout=tensor.dtype, name="hipress_allreduce")
    out.set_shape(tensor.shape)
    return out


def _bridge(run: Callable[..., Any], inputs: List[tf.Tensor], tout: Any, op_name: str,
            shapes: Sequence[Any]) -> Any:
    """Run ``run`` eagerly, or inside ``tf.function`` through one ``tf.py_function``."""
    if tf.executing_eagerly():
        return run(*inputs)
    out = tf.py_function(run, inputs, Tout=tout, name=op_name)
    outs = out if isinstance(out, (list, tuple)) else [out]
    for o, shape in zip(outs, shapes):
        o.set_shape(shape)
    return out


def grouped_allreduce(tensors: Sequence[Any], name: Optional[str] = None, op: str = Average,
                      compression: Any = None, **codec_params: Any) -> List[tf.Tensor]:
    """Allreduce several tensors in one negotiation; return new tensors in input order.

    They are named ``<name>.<i>`` and become ready together on every rank; arguments as
    :func:`allreduce`. Eager or inside ``tf.function`` (one ``tf.py_function``).
    """
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    base = name or _auto_name("grouped_allreduce")
    op = check_op(op)
    codec = resolve_codec(compression, codec_params)

    def run(*ts: tf.Tensor) -> List[tf.Tensor]:
        res = hipress.grouped_allreduce([to_array(t) for t in ts],
                                        [f"{base}.{i}" for i in range(len(ts))],
                                        op=op, codec=codec)
        return [from_array(r, t.dtype) for r, t in zip(res, ts)]

    return list(_bridge(run, tensors, [t.dtype for t in tensors], "hipress_grouped_allreduce",
                        [t.shape for t in tensors]))


@refuses_horovod_args
def allgather(tensor: Any, name: Optional[str] = None) -> tf.Tensor:
    """Return every rank's ``tensor`` concatenated along dimension 0, in rank order.

    The first dimension may differ across ranks; the others and the dtype must not (else
    every rank raises :class:`hipress.errors.CollectiveArgumentError`). Eager or inside
    ``tf.function`` (the first dimension of the result is then unknown).
    """
    tensor = tf.convert_to_tensor(tensor)
    name = name or _auto_name("allgather")

    def run(t: tf.Tensor) -> tf.Tensor:
        return from_array(hipress.allgather(to_array(t), name), t.dtype)

    return _bridge(run, [tensor], tensor.dtype, "hipress_allgather",
                   [[None] + tensor.shape.as_list()[1:]])


@refuses_horovod_args
def allgather_object(obj: Any, name: Optional[str] = None) -> List[Any]:
    """Return the list of every rank's picklable ``obj``, in rank order (eager only)."""
    return hipress.allgather_object(obj, name or _auto_name("allgather_object"))


@refuses_horovod_args
def alltoall(tensor: Any, splits: Any = None, name: Optional[str] = None) -> Any:
    """Send ``splits[j]`` rows of ``tensor`` to rank j; return the rows sent here.

    ``splits``: rows per destination rank (a list or an integer tensor of ``size()``
    entries adding up to ``shape[0]``), None for equal parts. Returns the rows received,
    concatenated in source-rank order, and with ``splits`` given (as Horovod) also an
    int32 tensor of the rows received from each rank. Invalid splits on any rank raise
    :class:`hipress.errors.CollectiveArgumentError` on every rank before data moves.
    Eager or inside ``tf.function``.
    """
    tensor = tf.convert_to_tensor(tensor)
    name = name or _auto_name("alltoall")
    given = splits is not None
    sp = tf.cast(tf.convert_to_tensor(splits if given else [0]), tf.int64)

    def run(t: tf.Tensor, s: tf.Tensor) -> List[tf.Tensor]:
        out, received = hipress.alltoall(to_array(t), name,
                                         [int(v) for v in s.numpy()] if given else None)
        return [from_array(out, t.dtype), tf.constant(received, tf.int32)]

    out, received = _bridge(run, [tensor, sp], [tensor.dtype, tf.int32], "hipress_alltoall",
                            [[None] + tensor.shape.as_list()[1:], [None]])
    return (out, received) if given else out


@refuses_horovod_args
def reducescatter(tensor: Any, name: Optional[str] = None, op: str = Average) -> tf.Tensor:
    """Reduce ``tensor`` over ranks; return this rank's block of rows.

    Lower ranks get the extra rows, as Horovod. Exact; ops and dtypes as
    :func:`allreduce` uncompressed. Eager or inside ``tf.function``.
    """
    tensor = tf.convert_to_tensor(tensor)
    name = name or _auto_name("reducescatter")
    op = check_op(op)

    def run(t: tf.Tensor) -> tf.Tensor:
        return from_array(hipress.reducescatter(to_array(t), name, op=op), t.dtype)

    return _bridge(run, [tensor], tensor.dtype, "hipress_reducescatter",
                   [[None] + tensor.shape.as_list()[1:]])


@refuses_horovod_args
def join() -> int:
    """Say this rank has run out of data; return the rank that joined last (eager only).

    Until every rank has joined, this rank adds zeros to the others' average/sum
    allreduces (the optimizer's gradients included) and is not counted in averages.
    """
    return hipress.join()


@refuses_horovod_args
def broadcast(tensor: Any, root_rank: int, name: Optional[str] = None) -> tf.Tensor:
    """Return ``root_rank``'s ``tensor`` on every rank, as a new tensor (eager or graph)."""
    tensor = tf.convert_to_tensor(tensor)
    name = name or _auto_name("broadcast")

    def run(t: tf.Tensor) -> tf.Tensor:
        return from_array(hipress.broadcast(to_array(t), root_rank, name), t.dtype)

    if tf.executing_eagerly():
        return run(tensor)
    out = tf.py_function(run, [tensor], Tout=tensor.dtype, name="hipress_broadcast")
    out.set_shape(tensor.shape)
    return out


@refuses_horovod_args
def broadcast_object(obj: Any, root_rank: int = 0, name: str = "") -> Any:
    """Return ``root_rank``'s ``obj`` on every rank (small picklable objects; eager only)."""
    return hipress.broadcast_object(obj, root=root_rank, name=name)


def broadcast_variables(variables: Iterable[Any], root_rank: int = 0) -> None:
    """Assign ``root_rank``'s values to every rank's variables (model initialization).

    Args:
        variables: ``tf.Variable`` or Keras variables, e.g. ``model.variables`` (weights,
            batch-norm statistics) and ``optimizer.variables`` once the optimizer is built.
            Every rank must pass the same variables in the same order.
        root_rank: the rank whose values everyone gets.

    Works eagerly and inside ``tf.function`` (there one ``tf.py_function`` broadcasts
    them all, then each variable is assigned). Every broadcast is started before the
    first is waited for, so they share negotiation rounds.
    """
    variables = list(variables)
    names = [f"broadcast_variables.{n}"
             for n in unique_names([variable_name(v) for v in variables], "var")]
    if not variables:
        return
    tensors = [tf.convert_to_tensor(v) for v in variables]

    def run(*ts: tf.Tensor) -> List[tf.Tensor]:
        handles = [hipress.broadcast_async(to_array(t), root_rank, n)
                   for t, n in zip(ts, names)]
        return [from_array(hipress.synchronize(h), t.dtype) for t, h in zip(ts, handles)]

    if tf.executing_eagerly():
        values = run(*tensors)
    else:
        values = tf.py_function(run, tensors, Tout=[t.dtype for t in tensors],
                                name="hipress_broadcast_variables")
        for value, t in zip(values, tensors):
            value.set_shape(t.shape)
    for v, value in zip(variables, values):
        v.assign(value)


