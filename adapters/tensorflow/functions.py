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
from typing import Any, Iterable, Optional

import tensorflow as tf

import hipress
from hipress.adapter_common import Average, check_op, resolve_codec, unique_names
from hipress.api import (  # noqa: F401  (process control is framework-neutral: re-exported)
    barrier,
    init,
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
        tensor: a dense float16/bfloat16/float32/float64 tensor (an ``IndexedSlices`` is
            densified).
        name: unique among in-flight submissions, identical on every rank. Default: a
            counter (``allreduce.noname.<n>``), correct when every rank calls in one order
            (inside ``tf.function`` the name is fixed when the function is traced).
        op: ``hp.Average`` or ``hp.Sum``.
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

    Works eagerly and inside ``tf.function`` (each variable through one
    ``tf.py_function`` broadcast followed by ``assign``).
    """
    variables = list(variables)
    names = unique_names([variable_name(v) for v in variables], "var")
    for v, n in zip(variables, names):
        v.assign(broadcast(tf.convert_to_tensor(v), root_rank, name=f"broadcast_variables.{n}"))


