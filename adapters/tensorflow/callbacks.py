"""Keras callbacks of the TensorFlow adapter (Horovod's ``horovod.tensorflow.keras.callbacks``).

Order matters: Keras calls the callbacks of ``model.fit`` in list order, then its own
``History`` and progress bar. A typical list::

    callbacks = [
        hp.BroadcastGlobalVariablesCallback(0),   # first: every rank starts from rank 0
        hp.MetricAverageCallback(),               # before anything that reads the logs
        hp.LearningRateWarmupCallback(initial_lr=base_lr * hp.size(), warmup_epochs=5),
        keras.callbacks.ReduceLROnPlateau(...),   # reads the averaged logs
        hp.BestModelCheckpoint("best.keras"),     # rank 0 writes, on the averaged metric
    ]

Every rank must pass the same callbacks in the same order: ``MetricAverageCallback`` is a
collective (each rank must call it at every epoch end), and the others assume identical
training on every rank.
"""

from __future__ import annotations

import logging
import numbers
from typing import Any, Dict, List, Optional

import keras
import numpy as np
from keras.src.utils import io_utils  # Keras's own callbacks print their verbose lines here

import hipress

from .functions import broadcast_variables

logger = logging.getLogger(__name__)


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """Give every rank ``root_rank``'s model (and built optimizer) variables before training.

    Use it with ``model.fit`` when the ranks initialize their models independently (as
    Horovod's callback of the same name). It broadcasts ``model.variables`` and, if the
    optimizer is built, ``optimizer.variables``, once, at the start of the first ``fit``.

    Args:
        root_rank: the rank whose values everyone gets.
    """

    def __init__(self, root_rank: int = 0) -> None:
        super().__init__()
        self.root_rank = root_rank
        self.broadcast_done = False

    def on_train_begin(self, logs: Optional[Any] = None) -> None:
        """Broadcast the variables (only the first time)."""
        if self.broadcast_done:
            return
        broadcast_variables(self.model.variables, root_rank=self.root_rank)
        opt = getattr(self.model, "optimizer", None)
        if opt is not None and getattr(opt, "built", False):
            broadcast_variables(opt.variables, root_rank=self.root_rank)
        self.broadcast_done = True


# ------------------------------------------------------------------ metric averaging
def _metric_value(value: Any) -> Optional[float]:
    """Return ``value`` as a float if it is one real number, else None (not a metric).

    Numbers are Python/NumPy reals (``bool`` excluded) and arrays or tensors holding exactly
    one integer or floating element. Strings (even ``"1.5"``), None, lists and larger
    arrays are not.
    """
    if isinstance(value, (bool, np.bool_)):
        return None
    if isinstance(value, numbers.Real):
        return float(value)
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        try:
            arr = np.asarray(value)
        except (TypeError, ValueError):
            return None
        if arr.size == 1 and arr.dtype.kind in "fiu":
            return float(arr.reshape(()))
    return None


class MetricAverageCallback(keras.callbacks.Callback):
    """Average the epoch's metrics over all ranks, so every rank logs the same values.

    Each rank computes its metrics on its own shard of the data; without this callback,
    ``History``, ``ReduceLROnPlateau``, ``EarlyStopping`` or a checkpoint see rank-local
    values, and ranks may take different decisions. At every epoch end the callback
    replaces each numeric entry of ``logs`` (training and ``val_`` metrics alike) by its
    exact average over the ranks, as a Python float.

    Place it *before* every callback that reads the epoch logs (Keras calls callbacks in
    list order; its ``History`` and progress bar come after all of yours, so they show
    the averages). Per-batch logs are left rank-local.

    Steps, per epoch end:

    1. take the numeric entries of ``logs`` (see below) under their keys, sorted;
    2. put their values into one float64 vector and average it over the ranks with one
       exact (uncompressed) :func:`hipress.allreduce` named after the sorted keys;
    3. write the averages back into ``logs`` in place.

    Non-numeric entries (strings, None, lists, arrays of more than one element) are
    skipped, and left as they are. Every rank must have the same numeric keys at each
    epoch end (true when every rank runs the same ``fit`` with the same metrics and
    ``validation_freq``); otherwise the collective's name differs and the engine reports
    a stall naming both names.

    The average of ``x_0, ..., x_{N-1}`` is ``(x_0 + ... + x_{N-1}) / N`` in float64, so
    a metric that is a mean over samples averages exactly only when every rank has the
    same number of samples (as in Horovod).

    Raises:
        hipress.errors.HiPressError: HiPress is not initialized, or the collective failed
            (another rank left or has different metric keys).
    """

    #: prefix of the allreduce name; the sorted metric keys follow
    NAME_PREFIX = "keras.metric_average:"

    def __init__(self) -> None:
        super().__init__()

    def on_epoch_end(self, epoch: int, logs: Optional[Dict[str, Any]] = None) -> None:
        """Replace the numeric entries of ``logs`` by their averages over the ranks."""
        if not logs:
            return
        values = {k: _metric_value(v) for k, v in logs.items()}
        keys = sorted(k for k, v in values.items() if v is not None)
        if not keys:
            return
        local = np.array([values[k] for k in keys], dtype=np.float64)
        mean = hipress.allreduce(local, name=self.NAME_PREFIX + ",".join(keys), op="average")
        for key, value in zip(keys, mean.tolist()):
            logs[key] = value


# ------------------------------------------------------------- learning-rate warm-up
class LearningRateWarmupCallback(keras.callbacks.Callback):
    """Ramp the learning rate linearly from ``initial_lr / size`` to ``initial_lr``, per batch.

    Large-batch data-parallel training scales the learning rate with the number of
    ranks (``initial_lr = base_lr * hp.size()``) and warms up to it gradually (Goyal et
    al., "Accurate, Large Minibatch SGD: Training ImageNet in 1 Hour", 2017). As in
    Horovod, the script builds the optimizer with ``learning_rate=initial_lr`` and this
    callback overrides it for the first ``warmup_epochs`` epochs. Before batch ``b`` of
    epoch ``e`` (with ``S = steps_per_epoch``, ``W = warmup_epochs``, ``N = hp.size()``,
    ``k = e * S + b``) it assigns::

        lr = initial_lr / N * (1 + (k + 1) * (N - 1) / (S * W)),   for e < W

    with ``k + 1`` capped at ``S * W``. The first batch thus runs one step above
    ``initial_lr / N`` and the last warm-up batch (and every later one: the callback
    stops assigning) runs at exactly ``initial_lr`` (Horovod's rounding, which makes the
    learning rate reach round values at epoch ends). At one rank the learning rate is
    ``initial_lr`` throughout. With ``steps_per_execution > 1`` Keras calls the callback
    once per execution, so the rate changes once per execution (``b`` is its first batch).

    Momentum correction (Goyal et al., section 2.2): when the learning rate changes from
    ``old`` to ``new``, the momentum of that one step is scaled by ``new / old`` and then
    restored. It applies only if the optimizer's ``momentum`` attribute is a variable
    (has ``assign``): Keras 3's built-in optimizers (``SGD``, ...) hold ``momentum`` as a
    Python float, which ``model.fit``'s ``tf.function`` freezes into the traced train step,
    so changing it between batches has no effect. For those the correction is skipped and
    a warning is logged once (rank 0); pass ``momentum_correction=False`` to silence it.
    A momentum variable created only at the optimizer's first step (when it builds) is
    corrected from the next batch on; the first step has no velocity to correct anyway.

    Args:
        initial_lr: learning rate at the end of the warm-up, usually
            ``base_lr * hp.size()``; > 0.
        warmup_epochs: number of epochs the ramp lasts; >= 0 (0: the callback does
            nothing).
        momentum_correction: scale the momentum as above when possible.
        steps_per_epoch: batches per epoch; None (default): Keras's
            ``self.params["steps"]``, known when the data has a length (arrays,
            ``keras.utils.PyDataset``, a ``tf.data.Dataset`` of known cardinality) or
            ``fit(steps_per_epoch=...)`` is given.
        verbose: > 0: rank 0 prints a line when the warm-up ends.

    Raises:
        ValueError: bad arguments (at construction), or at the start of ``fit`` when
            neither ``steps_per_epoch`` nor Keras's step count is known.
        TypeError: at the start of ``fit``, when the optimizer's learning rate is a
            ``LearningRateSchedule`` or callable, which cannot be assigned.
    """

    def __init__(self, initial_lr: float, warmup_epochs: int = 5,
                 momentum_correction: bool = True, steps_per_epoch: Optional[int] = None,
                 verbose: int = 0) -> None:
        super().__init__()
        if not isinstance(initial_lr, numbers.Real) or not initial_lr > 0:
            raise ValueError(f"initial_lr must be a number > 0 (the learning rate after "
                             f"warm-up, e.g. base_lr * hp.size()), got {initial_lr!r}")
        if isinstance(warmup_epochs, bool) or not isinstance(warmup_epochs, numbers.Integral) \
                or warmup_epochs < 0:
            raise ValueError(f"warmup_epochs must be an integer >= 0, got {warmup_epochs!r}")
        if steps_per_epoch is not None and (
                isinstance(steps_per_epoch, bool)
                or not isinstance(steps_per_epoch, numbers.Integral) or steps_per_epoch < 1):
            raise ValueError(f"steps_per_epoch must be None (from Keras) or an integer >= 1, "
                             f"got {steps_per_epoch!r}")
        self.initial_lr = float(initial_lr)
        self.warmup_epochs = int(warmup_epochs)
        self.momentum_correction = bool(momentum_correction)
        self.steps_per_epoch = steps_per_epoch
        self.verbose = verbose
        self._steps: Optional[int] = None
        self._epoch = 0
        self._momentum: Any = None  # the momentum variable changed for this batch
        self._restore_momentum: Optional[float] = None
        self._warned_momentum = False

    def learning_rate_at(self, epoch: int, batch: int) -> float:
        """Return the learning rate the callback assigns before ``batch`` of ``epoch``.

        Args:
            epoch: zero-based epoch, < ``warmup_epochs``.
            batch: zero-based batch within the epoch.

        Raises:
            ValueError: the number of steps per epoch is not known yet (before ``fit``
                unless ``steps_per_epoch`` was given).
        """
        steps = self._steps or self.steps_per_epoch
        if steps is None:
            raise ValueError("steps per epoch unknown: pass steps_per_epoch or call fit first")
        n = hipress.size()
        total = steps * self.warmup_epochs
        done = min(epoch * steps + batch + 1, total)
        return self.initial_lr / n * (1.0 + done * (n - 1) / total)

    def _optimizer(self) -> Any:
        opt = getattr(self.model, "optimizer", None)
        if opt is None:
            raise ValueError("LearningRateWarmupCallback needs a compiled model "
                             "(model.compile(optimizer=...)) before fit")
        return opt

    def on_train_begin(self, logs: Optional[Any] = None) -> None:
        """Find the steps per epoch and check that the learning rate can be assigned."""
        if self.warmup_epochs == 0:
            return
        steps = self.steps_per_epoch or (self.params or {}).get("steps")
        if not steps:
            raise ValueError(
                "LearningRateWarmupCallback cannot tell the number of batches per epoch: "
                "Keras does not know it (the data has no length, e.g. a generator or a "
                "tf.data.Dataset of unknown cardinality); pass steps_per_epoch= to the "
                "callback (or to model.fit)")
        self._steps = int(steps)
        opt = self._optimizer()
        lr = getattr(opt, "_learning_rate", None)
        if not hasattr(lr, "assign"):
            raise TypeError(
                f"LearningRateWarmupCallback assigns the optimizer's learning rate, but "
                f"{type(opt).__name__} has a {type(lr).__name__} learning rate (a schedule "
                f"or callable), which cannot be assigned; build the optimizer with a float "
                f"learning_rate (initial_lr = base_lr * hp.size()), or drop this callback and "
                f"put the warm-up into your schedule")
        momentum = getattr(opt, "momentum", None)
        if (self.momentum_correction and not hasattr(momentum, "assign")
                and _metric_value(momentum) and not self._warned_momentum
                and hipress.rank() == 0):
            self._warned_momentum = True
            logger.warning(
                "LearningRateWarmupCallback: momentum correction skipped: %s.momentum is "
                "a Python float, fixed in model.fit's traced train step; pass "
                "momentum_correction=False to silence this", type(opt).__name__)

    def on_epoch_begin(self, epoch: int, logs: Optional[Any] = None) -> None:
        """Remember the epoch (batches are numbered within it)."""
        self._epoch = epoch

    def on_train_batch_begin(self, batch: int, logs: Optional[Any] = None) -> None:
        """Assign the warm-up learning rate (and the corrected momentum) for this batch."""
        if self._epoch >= self.warmup_epochs:
            return
        lr_var = self._optimizer()._learning_rate
        new_lr = self.learning_rate_at(self._epoch, batch)
        old_lr = float(keras.ops.convert_to_numpy(lr_var))
        lr_var.assign(new_lr)
        # looked up per batch: an optimizer may create its variables at its first step
        momentum = getattr(self._optimizer(), "momentum", None)
        if self.momentum_correction and hasattr(momentum, "assign") and old_lr > 0:
            self._momentum = momentum
            self._restore_momentum = float(keras.ops.convert_to_numpy(momentum))
            momentum.assign(self._restore_momentum * new_lr / old_lr)

    def on_train_batch_end(self, batch: int, logs: Optional[Any] = None) -> None:
        """Restore the momentum changed for this batch."""
        if self._restore_momentum is not None:
            self._momentum.assign(self._restore_momentum)
            self._restore_momentum = None

    def on_epoch_end(self, epoch: int, logs: Optional[Any] = None) -> None:
        """Report the end of the warm-up (``verbose > 0``, rank 0)."""
        if self.verbose > 0 and epoch == self.warmup_epochs - 1 and hipress.rank() == 0:
            lr = float(keras.ops.convert_to_numpy(self._optimizer()._learning_rate))
            io_utils.print_msg(f"\nEpoch {epoch + 1}: finished gradual learning rate warm-up "
                               f"to {lr:g}.")


# --------------------------------------------------------------------- checkpointing
class BestModelCheckpoint(keras.callbacks.ModelCheckpoint):
    """Save the model whenever the monitored metric improves, from rank 0 only.

    A ``keras.callbacks.ModelCheckpoint`` with ``save_best_only=True`` whose every hook
    returns at once on ranks other than 0: those ranks never build the file path, create
    a directory or write (the model is the same on every rank, so one copy is enough, and
    ranks sharing a file system do not race on the file). Arguments and file formats are
    ``ModelCheckpoint``'s (``filepath`` ends in ``.keras``, or ``.weights.h5`` with
    ``save_weights_only=True``, and may hold ``{epoch}`` and log keys).

    Which value decides: the monitored entry of rank 0's epoch logs. Place
    :class:`MetricAverageCallback` before this callback to decide on the average over the
    ranks (recommended: ``val_loss`` of one shard is a noisy estimate); without it, rank
    0's own value decides. The callback itself communicates nothing, so it may be used on
    rank 0 only, or with ranks that skip validation.

    Args:
        filepath: where to save (see above); only rank 0 uses it.
        monitor: log key to watch, e.g. ``"val_loss"``.
        mode: ``"auto"``, ``"min"`` or ``"max"``: whether smaller or larger is better
            (``"auto"`` infers it from the name).
        verbose: > 0: rank 0 prints a line on each decision.
        save_weights_only: save only the weights.
        save_freq: ``"epoch"`` or a number of batches (then the batch logs decide).
        initial_value_threshold: the value to beat before the first save (None: any).
        save_best_only: keep True (the point of this class); False saves at every
            ``save_freq``, still on rank 0 only.

    Raises:
        ValueError: ``ModelCheckpoint``'s checks (file extension, ``save_freq``, ``mode``).
    """

    def __init__(self, filepath: str, monitor: str = "val_loss", mode: str = "auto",
                 verbose: int = 0, save_weights_only: bool = False,
                 save_freq: Any = "epoch", initial_value_threshold: Optional[float] = None,
                 save_best_only: bool = True) -> None:
        super().__init__(filepath, monitor=monitor, verbose=verbose,
                         save_best_only=save_best_only, save_weights_only=save_weights_only,
                         mode=mode, save_freq=save_freq,
                         initial_value_threshold=initial_value_threshold)

    @staticmethod
    def _writes() -> bool:
        return hipress.rank() == 0

    def on_train_batch_end(self, batch: int, logs: Optional[Any] = None) -> None:
        """Save on rank 0 when ``save_freq`` batches have passed and the metric improved."""
        if self._writes():
            super().on_train_batch_end(batch, logs)

    def on_epoch_begin(self, epoch: int, logs: Optional[Any] = None) -> None:
        """Remember the epoch (rank 0)."""
        if self._writes():
            super().on_epoch_begin(epoch, logs)

    def on_epoch_end(self, epoch: int, logs: Optional[Any] = None) -> None:
        """Save on rank 0 if the monitored value improved (``save_freq="epoch"``)."""
        if self._writes():
            super().on_epoch_end(epoch, logs)


__all__: List[str] = [
    "BestModelCheckpoint",
    "BroadcastGlobalVariablesCallback",
    "LearningRateWarmupCallback",
    "MetricAverageCallback",
]
