"""``DistributedTrainer``: a Gluon ``Trainer`` whose gradients are synchronized by HiPress.

Usage (as with Horovod)::

    import hipress.mxnet as hp
    hp.init()
    params = net.collect_params()
    hp.broadcast_parameters(params, root_rank=0)
    trainer = hp.DistributedTrainer(params, "sgd", {"learning_rate": 0.05, "momentum": 0.9},
                                    compression="onebit")
    for x, y in batches:
        with autograd.record():
            loss = loss_fn(net(x), y)
        loss.backward()
        trainer.step(batch_size)     # synchronize, then update

How a step runs (``step`` = ``allreduce_grads`` + ``update``, as in Gluon):

1. Every parameter whose ``grad_req`` is not ``"null"`` takes part, named by its Gluon
   name (``dense0_weight``; unique, checked). A parameter whose gradient was computed by
   the last backward pass (MXNet's fresh-gradient flag) is handed to the core zero-copy
   (:mod:`hipress.mxnet.convert`); one without (unused in this rank's graph) is submitted
   as zeros with ``contributes=False`` (nobody waits; this rank's residual is untouched).
2. The results are written into each parameter's gradient (one copy) and every parameter is
   marked fresh, so every rank updates every parameter identically (``ignore_stale_grad``
   no longer skips parameters: a stale parameter is updated with the zero-filled average).
3. **Rescaling is applied exactly once**: the gradients are *averaged* across ranks (the
   engine divides by the world size) and the optimizer then applies ``rescale_grad =
   scale / batch_size`` as in single-process Gluon. Horovod divides ``rescale_grad`` by the
   world size *and* sums, which is the same thing; doing both would halve the step at
   world size 2. World 2, gradients [2, 4] and [4, 8], ``step(1)``: ``param.grad()`` is
   [3, 6] on both ranks and SGD(lr=1) moves the weight by -[3, 6].
4. With ``backward_passes_per_step = k`` the first ``k - 1`` calls of ``step`` only add the
   fresh gradients into local accumulators and update nothing; call ``k`` synchronizes the
   local sums (passes 1, 3 on rank 0 and 5, 7 on rank 1 give 8) and updates, with the
   ``batch_size`` of that call (pass ``k * batch_size`` for the mean over passes). Do not
   combine it with ``grad_req="add"``, MXNet's own accumulation (refused).
5. :func:`hipress.step` counts the step (warm-up).

MXNet has no per-gradient hook, so synchronization starts at ``step`` (every gradient is
submitted before the first is waited for, so encoding, transfer and decoding of different
gradients still overlap each other, but not the backward pass).

Checkpoints: ``save_states(fname)`` writes the optimizer state and the engine's state
(residuals, codec state; :func:`hipress.adapter_common.encode_state`) into one file;
``load_states`` restores both bit-identically (a plain Gluon states file loads too).
Residuals are per rank: save one file per rank.
"""

from __future__ import annotations

import logging
import numbers
import os
import struct
import tempfile
from typing import Any, Dict, Optional, Tuple

import mxnet as mx

import hipress
from hipress.adapter_common import (
    Average,
    PassAccumulator,
    check_horovod_args,
    check_horovod_op,
    check_op,
    check_unique_names,
    decode_state,
    encode_state,
    predivide_scales,
    resolve_codec,
)
from hipress.errors import HiPressError

from .convert import check_dtype, to_array, write_into, zeros_like_array

logger = logging.getLogger(__name__)

#: First bytes of a :meth:`DistributedTrainer.save_states` file.
STATES_MAGIC = b"HIPRESS-MXNET-STATES-1\n"


class DistributedTrainer(mx.gluon.Trainer):
    """A ``mx.gluon.Trainer`` that averages gradients across ranks through HiPress.

    Args:
        params: ``net.collect_params()``, a dict of Parameters or a list of Parameters.
        optimizer: optimizer name (``"sgd"``, ``"adam"``, ...) or ``mx.optimizer.Optimizer``.
        optimizer_params: keyword arguments of the optimizer (``learning_rate``,
            ``momentum``, ``wd``, ``rescale_grad``, ...).
        compression: None to follow the config policy, a codec name (``"none"``,
            ``"onebit"``, ``"tbq"``, ``"terngrad"``, ``"dgc"``, ``"graddrop"``,
            ``"powersgd"``, ...) or ``hp.Compression.<name>`` (``hp.Compression.none``
            is exact, not the policy), a ``.hpc`` CompLL spec, or a Codec instance. An
            explicit codec is used for every tensor, whatever its size and the step;
            only None (or ``"auto"``) applies ``min_compress_bytes``, rules and warm-up.
            DGC's default memory applies momentum correction: use an optimizer without
            momentum.
        backward_passes_per_step: ``step`` calls summed locally per update (>= 1).
        op: ``hp.Average`` (default) or ``hp.Sum`` across ranks.
        gradient_predivide_factor: Horovod's ``f`` in ``[1, world size]``: gradients are
            divided by ``f`` before the sum and the sum by ``size / f`` after it, so the
            result is still the average and ``rescale_grad`` still applies once (1, the
            default: no extra scaling). Needs ``op=hp.Average``.
        **codec_params: constructor parameters of the named codec. Horovod arguments
            HiPress does not implement (``process_set``, ``num_groups``, ``groups``,
            ``sparse_as_dense``) raise ``UnsupportedArgumentError``.

    Raises:
        ValueError: duplicate parameter names (listed), ``backward_passes_per_step < 1``.
        ConfigError: ``gradient_predivide_factor`` outside ``[1, size]`` or with ``hp.Sum``.
        UnsupportedArgumentError: a Horovod argument HiPress does not implement, or
            ``op=hp.Adasum``; the message names it and the alternative.
        TypeError: a parameter with sparse gradients (``sparse_grad=True``).
        CodecError: unknown codec name (valid names listed) or bad parameters.
        HiPressError: :func:`hipress.init` was not called.
    """

    def __init__(
        self,
        params: Any,
        optimizer: Any,
        optimizer_params: Optional[Dict[str, Any]] = None,
        compression: Any = None,
        backward_passes_per_step: int = 1,
        op: str = Average,
        gradient_predivide_factor: float = 1.0,
        **codec_params: Any,
    ) -> None:
        check_horovod_args(codec_params, "DistributedTrainer")
        check_horovod_op(op, "DistributedTrainer")
        if not hipress.is_initialized():
            raise HiPressError("hipress is not initialized; call hipress.mxnet.init() first")
        super().__init__(params, optimizer, optimizer_params=optimizer_params, kvstore=None)
        check_unique_names([p.name for p in self._params])
        sparse = [p.name for p in self._params if p._grad_stype != "default"]
        if sparse:
            raise TypeError(
                f"parameters {sparse} have sparse ({self._params[0]._grad_stype}) gradients; "
                "HiPress synchronizes dense gradients: build them with sparse_grad=False"
            )
        self._hp_codec = resolve_codec(compression, codec_params, gradients=True)
        hipress.api.note_compression("DistributedTrainer", self._hp_codec)
        self._hp_op = check_op(op)
        predivide_scales(gradient_predivide_factor, self._hp_op, hipress.size())  # validates
        self._hp_predivide = gradient_predivide_factor
        k = backward_passes_per_step
        if isinstance(k, bool) or not isinstance(k, numbers.Integral) or k < 1:
            raise ValueError(f"backward_passes_per_step must be an integer >= 1, got {k!r}")
        self._hp_k = int(k)
        self._hp_accumulators: Dict[Tuple[str, ...], PassAccumulator] = {}
        self._hp_state: Optional[str] = None  # None | "apply" | "accumulate"

    # ----------------------------------------------------------------- properties
    @property
    def backward_passes_per_step(self) -> int:
        """``step`` calls summed locally per update."""
        return self._hp_k

    # ------------------------------------------------------------- gradient sync
    def _allreduce_grads(self) -> None:
        """Count one pass; synchronize every gradient on the last pass of a step."""
        params = [p for p in self._params if p.grad_req != "null"]
        if self._hp_k > 1 and any(p.grad_req == "add" for p in params):
            raise ValueError(
                "backward_passes_per_step > 1 accumulates gradients itself; parameters with "
                "grad_req='add' would be counted twice. Use one of the two"
            )
        if self._hp_k == 1 and hipress.size() == 1:
            # nothing travels at world size 1: keep the gradients in place, zero-filling
            # the ones this pass did not compute (as the engine would)
            for p in params:
                data = p.list_data()[0]
                if not data._fresh_grad:
                    p.list_grad()[0][:] = 0
                    data._fresh_grad = True
            self._hp_state = "apply"
            return
        names = tuple(p.name for p in params)
        acc = self._hp_accumulators.get(names)
        if acc is None:
            acc = PassAccumulator(names, self._hp_op, self._hp_codec, self._hp_k,
                                  gradient_predivide_factor=self._hp_predivide)
            self._hp_accumulators[names] = acc
        arrays: Dict[str, Any] = {}
        for p in params:
            grads = p.list_grad()
            if len(grads) != 1:
                raise ValueError(
                    f"parameter {p.name} lives on {len(grads)} contexts; HiPress runs one "
                    "process per device: initialize parameters on a single context"
                )
            data = p.list_data()[0]
            if data._fresh_grad:
                check_dtype(grads[0])
                arrays[p.name] = to_array(grads[0])
                data._fresh_grad = False  # consumed: the next pass sets it again
        by_name = {p.name: p for p in params}
        result = acc.add_pass(arrays, lambda n: zeros_like_array(by_name[n].list_grad()[0]))
        if result is None:
            self._hp_state = "accumulate"
            return
        for name, array in result.items():
            p = by_name[name]
            write_into(p.list_grad()[0], array)
            p.list_data()[0]._fresh_grad = True
        self._hp_state = "apply"

    def _update(self, ignore_stale_grad: bool = False) -> None:
        """Run the optimizer, unless this call only accumulated a pass."""
        state, self._hp_state = self._hp_state, None
        if state == "accumulate":
            return
        if state is None:
            logger.warning(
                "update() without allreduce_grads(): the gradients of this step were not "
                "synchronized; call trainer.step() or allreduce_grads() first"
            )
        super()._update(ignore_stale_grad)

    # ---------------------------------------------------------------- checkpoints
    def save_states(self, fname: str) -> None:
        """Write the optimizer state and the engine's state (this rank's) to ``fname``.

        Layout: :data:`STATES_MAGIC`, the length of the Gluon part as little-endian
        uint64, the Gluon part (``Trainer.save_states`` bytes), then the engine state
        (:func:`hipress.adapter_common.encode_state`).
        """
        fd, tmp = tempfile.mkstemp(prefix="hipress_mx_states_")
        os.close(fd)
        try:
            super().save_states(tmp)
            with open(tmp, "rb") as f:
                gluon_part = f.read()
        finally:
            os.unlink(tmp)
        engine_part = encode_state(hipress.state_dict())
        with open(fname, "wb") as f:
            f.write(STATES_MAGIC + struct.pack("<Q", len(gluon_part)) + gluon_part + engine_part)

    def load_states(self, fname: str) -> None:
        """Restore :meth:`save_states` output (a plain Gluon states file loads too)."""
        with open(fname, "rb") as f:
            data = f.read()
        if not data.startswith(STATES_MAGIC):
            super().load_states(fname)
            return
        start = len(STATES_MAGIC) + 8
        (n,) = struct.unpack("<Q", data[len(STATES_MAGIC):start])
        gluon_part, engine_part = data[start:start + n], data[start + n:]
        fd, tmp = tempfile.mkstemp(prefix="hipress_mx_states_")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(gluon_part)
            super().load_states(tmp)
        finally:
            os.unlink(tmp)
        hipress.load_state_dict(decode_state(engine_part))
        for acc in self._hp_accumulators.values():
            acc.reset()
