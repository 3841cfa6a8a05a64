"""The gradient reduction shared by ``DistributedGradientTape`` and ``DistributedOptimizer``.

One :class:`GradientReducer` turns a list of TensorFlow gradients (dense tensors,
``IndexedSlices`` or None) into the synchronized dense gradients, with the step rules of
:class:`hipress.adapter_common.PassAccumulator` (local accumulation over
``backward_passes_per_step`` passes, zero-filled None gradients that leave this rank's
residual untouched, one :func:`hipress.step` per synchronization).

Eager and ``tf.function`` take the same Python path:

- eagerly, the gradients go to the core zero-copy (:mod:`hipress.tensorflow.convert`);
- in a graph, one ``tf.py_function`` op (named ``hipress_allreduce``) takes every present
  gradient and returns a ``bool`` "update now" flag followed by one synchronized tensor per
  gradient; its Python body is the eager path. The op runs in the graph's order (it
  depends on all the gradients), its outputs get the variables' static shapes. Graphs
  holding it cannot be compiled with XLA (``jit_compile=True``) nor serialized into a
  SavedModel with the op inside (export the model, not the training step), exactly as any
  ``tf.py_function``.
"""

from __future__ import annotations

import logging
import numbers
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf

import hipress
from hipress.adapter_common import (
    Average,
    PassAccumulator,
    check_horovod_op,
    check_op,
    predivide_scales,
    resolve_codec,
    unique_names,
)

from .convert import densify, from_array, to_array, variable_name

logger = logging.getLogger(__name__)


class GradientReducer:
    """Synchronize lists of TensorFlow gradients across ranks (eager or in ``tf.function``).

    Args:
        compression: None or ``"auto"`` (the config's policy), or a codec name, ``.hpc``
            spec or Codec used for every gradient whatever its size.
        op: ``"average"`` or ``"sum"``.
        backward_passes_per_step: passes summed locally before each synchronization.
        sparse_as_dense: densify ``IndexedSlices`` (True) or refuse them (False).
        codec_params: constructor parameters of the named codec.
        prefix: first component of positional names when variable names are not unique.
        source: the API using the reducer, for the startup config line.
        gradient_predivide_factor: Horovod's ``f`` in ``[1, world size]`` (see
            :func:`hipress.adapter_common.predivide_scales`).

    Raises:
        ValueError: bad op or ``backward_passes_per_step``.
        ConfigError: a bad ``gradient_predivide_factor``.
        UnsupportedArgumentError: ``op=Adasum``.
        CodecError: unknown codec or bad parameters.
    """

    def __init__(
        self,
        compression: Any = None,
        op: str = Average,
        backward_passes_per_step: int = 1,
        sparse_as_dense: bool = True,
        codec_params: Optional[Dict[str, Any]] = None,
        prefix: str = "grad",
        source: str = "DistributedOptimizer",
        gradient_predivide_factor: float = 1.0,
    ) -> None:
        check_horovod_op(op, source)
        self.codec = resolve_codec(compression, codec_params, gradients=True)
        hipress.api.note_compression(source, self.codec)
        self.op = check_op(op)
        predivide_scales(gradient_predivide_factor, self.op, hipress.size())  # validates
        self.gradient_predivide_factor = gradient_predivide_factor
        k = backward_passes_per_step
        if isinstance(k, bool) or not isinstance(k, numbers.Integral) or k < 1:
            raise ValueError(f"backward_passes_per_step must be an integer >= 1, got {k!r}")
        self.backward_passes_per_step = int(k)
        self.sparse_as_dense = bool(sparse_as_dense)
        self.prefix = prefix
        self._accumulators: Dict[Tuple[str, ...], PassAccumulator] = {}

    def names(self, variables: Sequence[Any]) -> List[str]:
        """Return the gradient names of ``variables`` (Keras paths / TF names, made unique)."""
        return unique_names([variable_name(v) for v in variables], self.prefix)

    def accumulator(self, names: Sequence[str]) -> PassAccumulator:
        """Return the accumulator of this name list (one per distinct list, kept)."""
        key = tuple(names)
        acc = self._accumulators.get(key)
        if acc is None:
            acc = PassAccumulator(key, self.op, self.codec, self.backward_passes_per_step,
                                  gradient_predivide_factor=self.gradient_predivide_factor)
            self._accumulators[key] = acc
        return acc

    @property
    def pending_passes(self) -> int:
        """Passes accumulated since the last synchronization (0 right after one)."""
        return max((a.passes for a in self._accumulators.values()), default=0)

    def reset(self) -> None:
        """Drop locally accumulated passes."""
        for acc in self._accumulators.values():
            acc.reset()

    # ------------------------------------------------------------------ reduce
    def reduce(
        self, grads: Sequence[Any], variables: Sequence[Any]
    ) -> Tuple[Optional[List[tf.Tensor]], Any]:
        """Count one pass of ``grads`` (one per variable); synchronize on the step's last pass.

        Args:
            grads: dense tensors, ``IndexedSlices`` (densified) or None (zero-filled), one
                per entry of ``variables``.
            variables: the variables (or watched tensors) the gradients belong to; they give
                the names, and the shape and dtype of zero-filled gradients.

        Returns:
            ``(synchronized dense gradients, apply)``. Eagerly, ``apply`` is a Python bool
            and the list is None on passes that only accumulate. In a graph, ``apply`` is a
            scalar bool tensor and the list always holds tensors (the inputs, on passes
            that only accumulate).

        Raises:
            TypeError: an ``IndexedSlices`` gradient with ``sparse_as_dense=False``.
            ValueError: ``grads`` and ``variables`` differ in length.
            HiPressError: the engine failed.
        """
        grads, variables = list(grads), list(variables)
        if len(grads) != len(variables):
            raise ValueError(f"got {len(grads)} gradients for {len(variables)} variables")
        names = self.names(variables)
        dense = [densify(g, n, self.sparse_as_dense) for g, n in zip(grads, names)]
        metas = [_meta(g, v) for g, v in zip(dense, variables)]
        if self.backward_passes_per_step == 1 and hipress.size() == 1:
            # nothing travels at world size 1 (hipress.allreduce_async returns the input):
            # hand the gradients back as they are, without a py_function in graphs
            return [g if g is not None else tf.zeros(m[0], m[1])
                    for g, m in zip(dense, metas)], True
        acc = self.accumulator(names)
        if tf.executing_eagerly():
            result = _run_pass(acc, names, dense, metas)
            return result, result is not None

        present = [i for i, g in enumerate(dense) if g is not None]
        none_names = [names[i] for i, g in enumerate(dense) if g is None]
        if none_names:
            logger.debug("gradients without a value (zero-filled): %s", none_names)

        def bridge(*tensors: tf.Tensor) -> List[tf.Tensor]:
            got: List[Any] = [None] * len(names)
            for i, t in zip(present, tensors):
                got[i] = t
            result = _run_pass(acc, names, got, metas)
            if result is None:  # accumulating: placeholders, the update is skipped
                return [tf.constant(False)] + [
                    got[i] if got[i] is not None else tf.zeros(m[0], m[1])
                    for i, m in enumerate(metas)
                ]
            return [tf.constant(True)] + result

        out = tf.py_function(bridge, [dense[i] for i in present],
                             Tout=[tf.bool] + [m[1] for m in metas], name="hipress_allreduce")
        flag, synced = out[0], list(out[1:])
        flag.set_shape(())
        for t, m in zip(synced, metas):
            t.set_shape(m[0])
        return synced, flag


def _meta(grad: Any, var: Any) -> Tuple[tf.TensorShape, tf.DType, bool]:
    """Return (static shape, dtype, on GPU) of a gradient, from the variable if it is None."""
    src = grad if grad is not None else var
    shape = tf.TensorShape(var.shape) if grad is None else grad.shape
    if grad is not None and not shape.is_fully_defined():
        shape = tf.TensorShape(var.shape)
    dtype = tf.as_dtype(src.dtype)
    device = str(getattr(src, "device", "") or "")
    return shape, dtype, "GPU" in device.upper()


def _run_pass(
    acc: PassAccumulator,
    names: Sequence[str],
    tensors: Sequence[Optional[tf.Tensor]],
    metas: Sequence[Tuple[tf.TensorShape, tf.DType, bool]],
) -> Optional[List[tf.Tensor]]:
    """Hand one pass of eager tensors to ``acc``; return the result tensors or None."""
    arrays = {n: to_array(t) for n, t in zip(names, tensors) if t is not None}
    meta_of = dict(zip(names, metas))

    def zeros(name: str) -> Any:
        shape, dtype, gpu = meta_of[name]
        if not shape.is_fully_defined():
            raise ValueError(
                f"cannot zero-fill the gradient of {name!r}: its variable's shape {shape} is "
                "not fully defined"
            )
        if gpu:
            import cupy

            return cupy.zeros(shape.as_list(), dtype=dtype.as_numpy_dtype)
        return np.zeros(shape.as_list(), dtype=dtype.as_numpy_dtype)

    result = acc.add_pass(arrays, zeros)
    if result is None:
        return None
    return [from_array(result[n], meta_of[n][1]) for n in names]
