"""Keras callbacks of the TensorFlow adapter."""

from __future__ import annotations

from typing import Any, Optional

import keras

from .functions import broadcast_variables


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
