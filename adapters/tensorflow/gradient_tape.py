"""``DistributedGradientTape``: a ``tf.GradientTape`` whose gradients are synchronized.

Usage in a custom training loop (as with Horovod)::

    import hipress.tensorflow as hp
    hp.init()

    @tf.function
    def train_step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        tape = hp.DistributedGradientTape(tape, compression="onebit")
        grads = tape.gradient(loss, model.trainable_variables)   # synchronized
        optimizer.apply_gradients(zip(grads, model.trainable_variables))

    hp.broadcast_variables(model.variables, root_rank=0)   # after the model is built

Each ``gradient()`` call is one synchronization step: the gradients are computed by the
wrapped tape, then handed to the core together (zero-copy eagerly; one ``tf.py_function``
inside ``tf.function``, see :mod:`hipress.tensorflow.reducer`) and the synchronized dense
gradients are returned in the structure of ``sources``. None gradients (a variable not
used on this rank) are zero-filled: they come back as the cross-rank average with this
rank counting zeros, so every rank returns a tensor and applies the same update.
``IndexedSlices`` gradients (embedding lookups) are densified (``sparse_as_dense=True``,
the default) or refused with a ``TypeError`` naming the variable (``False``).

Use either this tape or :func:`hipress.tensorflow.DistributedOptimizer`, not both (the
gradients would be synchronized twice). Local accumulation over several backward passes
is a feature of ``DistributedOptimizer`` (``backward_passes_per_step``).
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from hipress.adapter_common import Average, check_horovod_args, check_horovod_op
from hipress.errors import HiPressError

from .reducer import GradientReducer


class _DistributedGradientTape:
    """Mixin placed before the tape's class in a dynamic subclass (the tape's state is shared)."""

    def gradient(
        self,
        target: Any,
        sources: Any,
        output_gradients: Any = None,
        unconnected_gradients: Any = tf.UnconnectedGradients.NONE,
    ) -> Any:
        """Return the gradients of ``target`` w.r.t. ``sources``, synchronized across ranks.

        Args:
            target: the loss (tensor or nested structure of tensors).
            sources: variables or watched tensors (any nest structure). Gradient names
                are the variables' Keras paths / TF names (positional ``grad.<i>.<name>``
                when those are not unique); every rank must pass the same sources.
            output_gradients: as for ``tf.GradientTape.gradient``.
            unconnected_gradients: as for ``tf.GradientTape.gradient``; None gradients are
                zero-filled either way.

        Returns:
            Dense synchronized gradients in the structure of ``sources`` (never None).

        Raises:
            TypeError: an ``IndexedSlices`` gradient with ``sparse_as_dense=False``.
            HiPressError: the engine failed (e.g. :class:`hipress.errors.StallError`).
        """
        grads = super().gradient(target, sources, output_gradients=output_gradients,
                                 unconnected_gradients=unconnected_gradients)
        flat_sources = tf.nest.flatten(sources)
        flat_grads = tf.nest.flatten(grads)
        synced, _ = self._hp_reducer.reduce(flat_grads, flat_sources)
        return tf.nest.pack_sequence_as(grads, synced)


def DistributedGradientTape(  # noqa: N802  (Horovod's spelling: it returns a tape)
    tape: tf.GradientTape,
    compression: Any = None,
    op: str = Average,
    sparse_as_dense: bool = True,
    gradient_predivide_factor: float = 1.0,
    **codec_params: Any,
) -> tf.GradientTape:
    """Wrap ``tape`` so that ``gradient()`` returns gradients synchronized across ranks.

    Args:
        tape: a ``tf.GradientTape`` (usually right after its ``with`` block).
        compression: None to follow the config policy (``compression.algorithm``, rules,
            ``min_compress_bytes``, warm-up), a codec name (``"none"``, ``"onebit"``,
            ``"tbq"``, ``"terngrad"``, ``"dgc"``, ``"graddrop"``, ``"powersgd"``, ...) or
            ``hp.Compression.<name>`` (``hp.Compression.none`` is exact, not the policy),
            a ``.hpc`` CompLL spec, or a :class:`hipress.codecs.Codec`. An explicit codec
            is used for every tensor, whatever its size and the step; only None (or
            ``"auto"``) applies ``min_compress_bytes``, rules and warm-up.
        op: ``hp.Average`` (default) or ``hp.Sum``.
        sparse_as_dense: densify ``IndexedSlices`` gradients (default) or raise.
        gradient_predivide_factor: Horovod's ``f`` in ``[1, world size]``: gradients are
            divided by ``f`` before the sum and the sum by ``size / f`` after it (the
            result is still the average). Needs ``op=hp.Average``.
        **codec_params: constructor parameters of the named codec. Horovod arguments
            HiPress does not implement (``process_set``, ``num_groups``, ...) raise
            ``UnsupportedArgumentError``.

    Returns:
        An instance of a subclass of ``type(tape)`` sharing the tape's state.

    Raises:
        TypeError: ``tape`` is not a ``tf.GradientTape``.
        ConfigError: ``gradient_predivide_factor`` outside ``[1, size]`` or with ``hp.Sum``.
        UnsupportedArgumentError: a Horovod argument HiPress does not implement, or
            ``op=hp.Adasum``; the message names it and the alternative.
        CodecError: unknown codec name (valid names listed) or bad parameters.
        HiPressError: :func:`hipress.init` was not called.
    """
    import hipress

    check_horovod_args(codec_params, "DistributedGradientTape")
    check_horovod_op(op, "DistributedGradientTape")

    if not isinstance(tape, tf.GradientTape):
        raise TypeError(f"expect a tf.GradientTape, got {type(tape)}")
    if not hipress.is_initialized():
        raise HiPressError("hipress is not initialized; call hipress.tensorflow.init() first")
    if isinstance(tape, _DistributedGradientTape):
        raise ValueError("the tape is already a DistributedGradientTape")
    base = type(tape)
    cls = type(base.__name__, (_DistributedGradientTape, base), {"__module__": base.__module__})
    dist = cls.__new__(cls)
    dist.__dict__.update(tape.__dict__)
    dist._hp_reducer = GradientReducer(compression, op, 1, sparse_as_dense, codec_params,
                                        source="DistributedGradientTape",
                                        gradient_predivide_factor=gradient_predivide_factor)
    return dist
