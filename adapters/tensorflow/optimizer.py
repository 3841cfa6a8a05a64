"""``DistributedOptimizer``: wraps a Keras 3 optimizer so ``model.fit`` trains data-parallel.

Usage (as with Horovod)::

    import hipress.tensorflow as hp
    hp.init()
    opt = hp.DistributedOptimizer(keras.optimizers.SGD(0.05, momentum=0.9),
                                  compression="onebit")
    model.compile(optimizer=opt, loss="sparse_categorical_crossentropy", jit_compile=False)
    model.fit(x, y, callbacks=[hp.BroadcastGlobalVariablesCallback(0)])

The wrapper overrides ``apply`` (which ``apply_gradients`` and Keras's ``train_step``
call). Per call:

1. the gradients go through a :class:`hipress.tensorflow.reducer.GradientReducer`: None
   gradients are zero-filled (``contributes=False``: this rank's residual is untouched),
   ``IndexedSlices`` densified (``sparse_as_dense=True``) or refused, and the pass is
   counted;
2. with ``backward_passes_per_step = k``, calls ``1 .. k-1`` of a step only add the
   gradients into local accumulators (dense, so an ``IndexedSlices`` gradient accumulates
   as a dense tensor) and update nothing, not even ``iterations``; call ``k``
   synchronizes the local sums (Horovod's rule: passes 1, 3 on rank 0 and 5, 7 on rank 1
   give (4 + 12) / 2 = 8; scale the loss by ``1/k`` for the mean over passes) and runs the
   wrapped optimizer's ``apply`` on the results;
3. :func:`hipress.step` counts the step (warm-up).

Eagerly this is plain Python; inside ``tf.function`` (``model.fit``'s train function) the
synchronization is one ``tf.py_function`` op and the update of accumulation steps sits in
a ``tf.cond``. Compile the model with ``jit_compile=False`` on GPUs (Keras turns XLA on
there by default; XLA cannot compile a ``py_function``). Keras's own
``gradient_accumulation_steps`` would average the *synchronized* gradients again; use
``backward_passes_per_step`` instead.

Checkpoints: the optimizer carries a ``tf.train.experimental.PythonState`` attribute
``hipress_state`` holding the engine's state (error-feedback residuals, PowerSGD
matrices, RNG step counters; :func:`hipress.adapter_common.encode_state`, no pickle), so
``tf.train.Checkpoint(model=model, optimizer=opt)`` saves and restores it bit-identically
with the optimizer's variables. Residuals are each rank's own: write one checkpoint per
rank (or restore rank 0's on every rank and accept the small transient). ``model.save()``
(the ``.keras`` format) stores variables only, without the HiPress state.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import tensorflow as tf

import hipress
from hipress.adapter_common import (
    Average,
    check_horovod_args,
    check_horovod_op,
    decode_state,
    encode_state,
)
from hipress.errors import HiPressError

from .reducer import GradientReducer

logger = logging.getLogger(__name__)


class EngineCheckpointState(tf.train.experimental.PythonState):
    """The engine's state as a checkpoint entry of ``tf.train.Checkpoint``.

    ``serialize`` encodes :func:`hipress.state_dict` with
    :func:`hipress.adapter_common.encode_state`; ``deserialize`` loads it back with
    :func:`hipress.load_state_dict`. The state is the whole engine's on this rank (every
    gradient name), as in the PyTorch adapter's ``state_dict()``.
    """

    def serialize(self) -> bytes:
        """Return the engine state as bytes (empty if HiPress is not initialized)."""
        if not hipress.is_initialized():
            return b""
        return encode_state(hipress.state_dict())

    def deserialize(self, string_value: Any) -> None:
        """Restore the engine state from :meth:`serialize` output (empty: nothing)."""
        data = string_value.numpy() if hasattr(string_value, "numpy") else string_value
        if data:
            hipress.load_state_dict(decode_state(data))


class _Settings:
    """The wrapper's plain-Python state (one attribute, so Keras tracking leaves it alone)."""

    def __init__(self, reducer: GradientReducer) -> None:
        self.reducer = reducer


class _DistributedOptimizer:
    """Mixin placed before the Keras optimizer's class in a dynamic subclass."""

    @property
    def backward_passes_per_step(self) -> int:
        """Backward passes summed locally per update."""
        return self._hp.reducer.backward_passes_per_step

    def apply(self, grads: Any, trainable_variables: Optional[Any] = None) -> Any:
        """Synchronize ``grads`` across ranks, then update (on the last pass of a step).

        Args:
            grads: one gradient per variable (tensor, ``IndexedSlices`` or None).
            trainable_variables: the variables; default: those the optimizer was built on.

        Raises:
            TypeError: an ``IndexedSlices`` gradient with ``sparse_as_dense=False``.
            HiPressError: the engine failed.
        """
        grads = list(grads)
        if trainable_variables is None:
            if not self.built:
                raise ValueError(
                    "the optimizer is not built; pass trainable_variables on the first call"
                )
            trainable_variables = list(self._trainable_variables)
        else:
            trainable_variables = list(trainable_variables)
            if not self.built:  # build outside any tf.cond: variables are created once
                with tf.name_scope(self.name):
                    self.build(trainable_variables)
                self.built = True
        synced, flag = self._hp.reducer.reduce(grads, trainable_variables)
        base_apply = super().apply
        if tf.executing_eagerly():
            if not flag:
                return None
            return base_apply(synced, trainable_variables)
        if self._hp.reducer.backward_passes_per_step == 1:
            return base_apply(synced, trainable_variables)

        def update() -> None:
            base_apply(synced, trainable_variables)

        tf.cond(flag, update, lambda: None)
        return None


def DistributedOptimizer(  # noqa: N802  (Horovod's spelling: it returns an optimizer)
    optimizer: Any,
    compression: Any = None,
    backward_passes_per_step: int = 1,
    op: str = Average,
    sparse_as_dense: bool = True,
    gradient_predivide_factor: float = 1.0,
    **codec_params: Any,
) -> Any:
    """Wrap a Keras 3 optimizer so its gradients are synchronized across ranks by HiPress.

    The result is a new optimizer of a subclass of ``type(optimizer)`` built from
    ``optimizer.get_config()`` (so wrap it before its first use); it saves and loads as
    the original class.

    Args:
        optimizer: an unbuilt ``keras.optimizers.Optimizer`` (SGD, Adam, ...).
        compression: None to follow the config policy, a codec name (``"none"``,
            ``"onebit"``, ``"tbq"``, ``"terngrad"``, ``"dgc"``, ``"graddrop"``,
            ``"powersgd"``, ...) or ``hp.Compression.<name>`` (``hp.Compression.none``
            is exact, not the policy), a ``.hpc`` CompLL spec, or a Codec instance. An
            explicit codec is used for every tensor, whatever its size and the step;
            only None (or ``"auto"``) applies ``min_compress_bytes``, rules and warm-up.
            DGC's default memory applies momentum correction: give it an optimizer
            without momentum.
        backward_passes_per_step: ``apply`` calls summed locally per update (>= 1).
        op: ``hp.Average`` (default) or ``hp.Sum`` across ranks.
        sparse_as_dense: densify ``IndexedSlices`` gradients (default) or raise.
        gradient_predivide_factor: Horovod's ``f`` in ``[1, world size]``: gradients are
            divided by ``f`` before the sum and the sum by ``size / f`` after it, so the
            result is still the average (1, the default: no extra scaling). Needs
            ``op=hp.Average``.
        **codec_params: constructor parameters of the named codec. Horovod arguments
            HiPress does not implement (``process_set``, ``num_groups``, ``groups``,
            ``device_dense``, ...) raise ``UnsupportedArgumentError``.

    Returns:
        The distributed optimizer.

    Raises:
        TypeError: not a Keras optimizer.
        ValueError: the optimizer is already built or already distributed, or
            ``backward_passes_per_step < 1``.
        ConfigError: ``gradient_predivide_factor`` outside ``[1, size]`` or with ``hp.Sum``.
        UnsupportedArgumentError: a Horovod argument HiPress does not implement, or
            ``op=hp.Adasum``; the message names it and the alternative.
        CodecError: unknown codec name (valid names listed) or bad parameters.
        HiPressError: :func:`hipress.init` was not called.
    """
    import keras

    check_horovod_args(codec_params, "DistributedOptimizer")
    check_horovod_op(op, "DistributedOptimizer")

    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise TypeError(
            f"expect a keras.optimizers.Optimizer, got {type(optimizer)}; for a custom loop "
            "use hp.DistributedGradientTape"
        )
    if not hipress.is_initialized():
        raise HiPressError("hipress is not initialized; call hipress.tensorflow.init() first")
    if isinstance(optimizer, _DistributedOptimizer):
        raise ValueError("the optimizer is already a DistributedOptimizer")
    if optimizer.built:
        raise ValueError(
            "the optimizer is already built (it has variables); wrap it with "
            "hp.DistributedOptimizer before compiling the model or applying gradients"
        )
    if getattr(optimizer, "gradient_accumulation_steps", None):
        raise ValueError(
            "Keras's gradient_accumulation_steps would accumulate after synchronization and "
            "average over passes; use DistributedOptimizer(backward_passes_per_step=...) instead"
        )
    reducer = GradientReducer(compression, op, backward_passes_per_step, sparse_as_dense,
                              codec_params,
                              gradient_predivide_factor=gradient_predivide_factor)
    base = type(optimizer)
    cls = type(base.__name__, (_DistributedOptimizer, base), {"__module__": base.__module__})
    dist = cls.from_config(optimizer.get_config())
    dist._hp = _Settings(reducer)
    dist.hipress_state = EngineCheckpointState()
    return dist
