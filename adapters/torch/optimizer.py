"""``DistributedOptimizer``: wraps a torch optimizer so gradients are synchronized by HiPress.

Usage (as with Horovod)::

    import hipress.torch as hp
    hp.init()
    opt = torch.optim.SGD(model.parameters(), lr=0.1 * hp.size())
    opt = hp.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                  compression="onebit")
    hp.broadcast_parameters(model.state_dict(), root_rank=0)
    hp.broadcast_optimizer_state(opt, root_rank=0)
    for x, y in loader:
        opt.zero_grad()
        loss_fn(model(x), y).backward()   # each gradient is submitted as soon as it is ready
        opt.step()                        # waits for the results, then updates

How a step runs:

1. A ``register_post_accumulate_grad_hook`` on every parameter that requires a gradient
   counts backward passes; on the ``backward_passes_per_step``-th pass it hands ``p.grad``
   (zero-copy, see :mod:`hipress.torch.convert`) to :func:`hipress.allreduce_async`, so
   synchronization overlaps the rest of the backward pass.
2. ``step()`` (or ``synchronize()``) submits what was not submitted: a gradient with fewer
   passes as it is, a parameter without a gradient on this rank (unused in its graph) as
   zeros with ``contributes=False``; waits for every result and writes it into ``p.grad``
   (a parameter whose ``grad`` was None gets the synchronized tensor).
3. The wrapped optimizer's ``step`` runs, then :func:`hipress.step` (warm-up counting).

Local accumulation: passes are summed in ``p.grad`` (autograd's own accumulation) and the
sums are averaged across ranks (Horovod's rule): passes 1, 3 on rank 0 and 5, 7 on rank 1
give (4 + 12) / 2 = 8. A pass beyond ``backward_passes_per_step`` before ``step()``
raises :class:`hipress.adapter_common.BackwardPassError`.

Horovod's ``gradient_predivide_factor`` and ``step(closure)`` work as in Horovod (see
:func:`DistributedOptimizer` and :meth:`_DistributedOptimizer.step`); Horovod arguments
HiPress does not implement (``process_set``, ``num_groups``, ``groups``, ``op=Adasum``)
raise :class:`hipress.adapter_common.UnsupportedArgumentError` naming them.

Sparse gradients (``nn.Embedding(sparse=True)``) are densified before synchronization
(``coalesce().to_dense()``), and ``p.grad`` becomes the dense synchronized gradient;
optimizers that accept dense gradients (SGD, Adam, ...) work unchanged.

The engine's state (error-feedback residuals, PowerSGD matrices, RNG step counters, keyed
by parameter name) is part of ``state_dict()`` under the key ``"hipress"`` (as tensors, so
``torch.load(weights_only=True)`` reads it) and is restored by ``load_state_dict``.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from typing import Any, Dict, Iterable, Iterator, List, Optional, Tuple

import torch

import hipress
from hipress.adapter_common import (
    Average,
    BackwardPassError,
    GradientSynchronizer,
    UnsupportedArgumentError,
    check_horovod_args,
    check_horovod_op,
    check_unique_names,
    default_gradient_name,
    pack_state,
    resolve_codec,
    unpack_state,
)
from hipress.errors import HiPressError

from .convert import (
    engine_state_from_torch,
    engine_state_to_torch,
    from_array,
    shares_memory,
    to_array,
)

logger = logging.getLogger(__name__)


class _DistributedOptimizer:
    """Mixin placed before the wrapped optimizer's class in a dynamic subclass.

    The instance shares the wrapped optimizer's ``__dict__`` entries (param groups, state,
    defaults, hooks), so it *is* that optimizer (``isinstance`` holds, LR schedulers work),
    with ``step``, ``zero_grad``, ``state_dict`` and ``load_state_dict`` extended.
    """

    # ------------------------------------------------------------------ set up
    def _hp_setup(
        self,
        named_parameters: Optional[Iterable[Tuple[str, torch.Tensor]]],
        compression: Any,
        backward_passes_per_step: int,
        op: str,
        codec_params: Dict[str, Any],
        gradient_predivide_factor: float = 1.0,
    ) -> None:
        params = [p for group in self.param_groups for p in group["params"]]
        if named_parameters is not None:
            if isinstance(named_parameters, dict):
                named = list(named_parameters.items())
            else:
                named = list(named_parameters)
            if any(not (isinstance(t, tuple) and len(t) == 2) for t in named):
                raise TypeError(
                    "named_parameters must be (name, parameter) pairs, e.g. "
                    "model.named_parameters()"
                )
            check_unique_names([n for n, _ in named])
            by_id = {id(p): n for n, p in named}
            unnamed = [i for i, p in enumerate(params) if id(p) not in by_id]
            if unnamed:
                raise ValueError(
                    f"named_parameters was given but {len(unnamed)} parameter(s) of the "
                    f"optimizer (positions {unnamed[:10]} in its param groups) are not in it; "
                    "pass the named_parameters() of every model the optimizer updates"
                )
        else:
            by_id = {}
            for gi, group in enumerate(self.param_groups):
                for pi, p in enumerate(group["params"]):
                    by_id[id(p)] = default_gradient_name(gi, pi)
        # names of the trainable parameters this optimizer updates, in param-group order
        self._hp_params: Dict[str, torch.Tensor] = {}
        for p in params:
            if p.requires_grad:
                self._hp_params[by_id[id(p)]] = p
        check_unique_names(self._hp_params)
        self._hp_sync = GradientSynchronizer(
            list(self._hp_params),
            op=op,
            codec=resolve_codec(compression, codec_params, gradients=True),
            backward_passes_per_step=backward_passes_per_step,
            inplace=True,  # results land in p.grad itself: no result tensor, no copy
            gradient_predivide_factor=gradient_predivide_factor,
        )
        hipress.api.note_compression("DistributedOptimizer", self._hp_sync.codec)
        self._hp_synchronized = False
        self._hp_should_synchronize = True
        self._hp_hooks: List[Any] = []
        ref = weakref.ref(self)
        for name, p in self._hp_params.items():
            self._hp_hooks.append(p.register_post_accumulate_grad_hook(_make_hook(ref, name)))

    # ------------------------------------------------------------ gradient I/O
    def _hp_grad_array(self, name: str) -> Optional[Any]:
        grad = self._hp_params[name].grad
        if grad is None:
            return None
        if grad.layout != torch.strided:
            grad = grad.coalesce().to_dense()
        return to_array(grad)

    def _hp_zeros(self, name: str) -> Any:
        p = self._hp_params[name]
        return to_array(torch.zeros(p.shape, dtype=p.dtype, device=p.device))

    # ------------------------------------------------------------- public API
    @property
    def backward_passes_per_step(self) -> int:
        """Local backward passes summed before each synchronization."""
        return self._hp_sync.backward_passes_per_step

    def synchronize(self) -> None:
        """Wait for every gradient of this step and write the results into ``p.grad``.

        Call it before touching gradients between ``backward()`` and ``step()`` (clipping,
        unscaling); ``step()`` then does not synchronize a second time.

        Raises:
            HiPressError: the engine failed (e.g. :class:`hipress.errors.StallError`).
        """
        results = self._hp_sync.synchronize(self._hp_grad_array, self._hp_zeros)
        with torch.no_grad():
            for name, array in results.items():
                p = self._hp_params[name]
                grad = p.grad
                if (grad is not None and grad.layout == torch.strided and grad.shape == p.shape
                        and shares_memory(array, grad)):
                    continue  # the engine wrote the result into p.grad itself
                out = from_array(array, like=p)
                if grad is None or grad.layout != torch.strided or grad.shape != p.shape:
                    p.grad = out
                else:
                    grad.copy_(out)
        self._hp_synchronized = True

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Make ``step()`` skip synchronization (after an explicit ``synchronize()``)."""
        self._hp_should_synchronize = False
        try:
            yield
        finally:
            self._hp_should_synchronize = True

    def step(self, closure: Any = None) -> Any:
        """Synchronize the gradients (unless done already), update, count the step.

        Args:
            closure: optional, as for any torch optimizer (Horovod passes it through too):
                a function that re-evaluates the model and returns the loss, usually
                ``opt.zero_grad(); loss = f(model(x)); loss.backward(); return loss``.
                The wrapped optimizer calls it (SGD, Adam: once; LBFGS: several times);
                after each call that computed gradients (its ``backward()`` submits them
                through the hooks, like any backward pass) the gradients are synchronized
                before the optimizer reads them, so every evaluation sees the cross-rank
                average. A closure may run up to ``backward_passes_per_step`` backward
                passes (they are summed, as usual). Gradients of a ``backward()`` made
                before ``step(closure)`` are synchronized first, as without a closure.
                The loss returned is this rank's own; optimizers that take decisions from
                it (LBFGS's line search and stopping tests) need the same loss on every
                rank, so return ``hp.allreduce(loss.detach())`` from such a closure,
                otherwise the ranks may evaluate it a different number of times and stall.

        Returns:
            What the wrapped optimizer's ``step`` returns (the closure's loss, if any).

        Raises:
            BackwardPassError: the closure ran more than ``backward_passes_per_step``
                backward passes (the message says so).
            HiPressError: synchronization failed.
        """
        # with a closure and no backward() before step(), the closure computes this step's
        # gradients: they are synchronized after it (synchronizing now would send zeros)
        before = closure is None or self._hp_sync.in_progress
        if before and self._hp_should_synchronize and not self._hp_synchronized:
            self.synchronize()
        elif self._hp_sync.in_progress:
            logger.warning(
                "step() inside skip_synchronize() while gradients of this step are "
                "submitted but not synchronized; call synchronize() first"
            )
        self._hp_synchronized = False
        try:
            if closure is None:
                loss = super().step()
            else:
                loss = super().step(self._hp_wrap_closure(closure))
        finally:
            self._hp_synchronized = False
        hipress.step()
        return loss

    def _hp_wrap_closure(self, closure: Any) -> Any:
        """Return ``closure`` followed by a synchronization of the gradients it computed."""
        k = self._hp_sync.backward_passes_per_step

        def synchronized_closure() -> Any:
            try:
                loss = closure()
            except BackwardPassError as exc:
                self._hp_sync.reset()
                raise BackwardPassError(
                    f"the closure given to DistributedOptimizer.step() ran more backward "
                    f"passes than backward_passes_per_step={k}: {exc}. Each evaluation of the "
                    f"closure may run at most {k} backward pass(es) (their gradients are "
                    "summed, then averaged across ranks). Run fewer passes per evaluation or "
                    "raise backward_passes_per_step"
                ) from exc
            if self._hp_sync.in_progress:
                self.synchronize()
            return loss

        return synchronized_closure

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients; refused while a step's gradients are being synchronized.

        Raises:
            RuntimeError: called after ``backward()`` but before ``step()`` or
                ``synchronize()`` (the engine may still read the gradients).
        """
        if self._hp_sync.in_progress:
            raise RuntimeError(
                "optimizer.zero_grad() was called after loss.backward() but before "
                "optimizer.step() or optimizer.synchronize(); the gradients are being "
                "synchronized and may still be read. Call step() (or synchronize()) first"
            )
        super().zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> Dict[str, Any]:
        """Return the wrapped optimizer's state plus HiPress's under ``"hipress"``.

        The HiPress part (residuals, codec state, keyed by parameter name) holds tensors
        and plain values only, so ``torch.load(..., weights_only=True)`` can read it.
        """
        return pack_state(super().state_dict(), engine_state_to_torch(hipress.state_dict()))

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Restore a state from :meth:`state_dict` (the HiPress part bit-identically).

        A plain torch optimizer state (without ``"hipress"``) loads too and leaves the
        engine's state as it is.
        """
        framework_state, engine_state = unpack_state(state_dict)
        super().load_state_dict(framework_state)
        if engine_state is not None:
            hipress.load_state_dict(engine_state_from_torch(engine_state))

    def _hp_framework_state_dict(self) -> Dict[str, Any]:
        """Return the wrapped optimizer's own state (no HiPress part)."""
        return super().state_dict()

    def _hp_load_framework_state_dict(self, state_dict: Dict[str, Any]) -> None:
        super().load_state_dict(state_dict)

    def remove_hooks(self) -> None:
        """Detach the gradient hooks (the optimizer stops synchronizing)."""
        for h in self._hp_hooks:
            h.remove()
        self._hp_hooks = []


def _make_hook(ref: weakref.ReferenceType, name: str) -> Any:
    """Return the post-accumulate-grad hook of parameter ``name`` (holds the optimizer weakly)."""

    def hook(param: torch.Tensor) -> None:
        opt = ref()
        if opt is None:
            return
        opt._hp_sync.gradient_ready(name, lambda: opt._hp_grad_array(name))

    return hook


def DistributedOptimizer(  # noqa: N802  (Horovod's spelling: it returns an optimizer)
    optimizer: torch.optim.Optimizer,
    named_parameters: Optional[Iterable[Tuple[str, torch.Tensor]]] = None,
    compression: Any = None,
    backward_passes_per_step: int = 1,
    op: str = Average,
    gradient_predivide_factor: float = 1.0,
    **codec_params: Any,
) -> torch.optim.Optimizer:
    """Wrap ``optimizer`` so its gradients are synchronized across ranks by HiPress.

    The result is an instance of a subclass of ``type(optimizer)`` that shares the
    wrapped optimizer's param groups and state (keep using the returned object).

    Args:
        optimizer: any ``torch.optim.Optimizer`` (already built over the model's params).
        named_parameters: ``model.named_parameters()`` (or a dict / list of pairs). The
            names key gradients across ranks and in checkpoints; they must be unique and
            cover every parameter of the optimizer. Default: ``param.<group>.<index>``.
        compression: None to follow the config policy (``compression.algorithm``, per-layer
            rules, ``min_compress_bytes``, warm-up), a codec name (``"none"``, ``"onebit"``,
            ``"tbq"``, ``"terngrad"``, ``"dgc"``, ``"graddrop"``, ``"powersgd"``, ``"fp16"``,
            ``"topk"``, ... see :func:`hipress.codecs.codec_names`) or its Horovod-style
            spelling ``hp.Compression.<name>`` (``hp.Compression.none`` is exact, not the
            policy), a ``.hpc`` CompLL spec, or a :class:`hipress.codecs.Codec` instance.
            An explicit codec (name or instance) is used for every tensor, whatever its
            size and the step; only None (or ``"auto"``) applies ``min_compress_bytes``,
            rules and warm-up. The error-feedback memory follows ``compression.memory``,
            and a name equal to ``compression.algorithm`` takes ``compression.params``.
            DGC's default memory applies momentum correction, so give it an optimizer
            without momentum (as in the DGC paper).
        backward_passes_per_step: backward passes summed locally per ``step()`` (>= 1).
        op: ``hp.Average`` (default) or ``hp.Sum`` across ranks.
        gradient_predivide_factor: Horovod's ``f`` in ``[1, world size]``: gradients are
            divided by ``f`` before the sum and the sum by ``size / f`` after it, so the
            result is still the average (1, the default: no extra scaling at all).
            Needs ``op=hp.Average``.
        **codec_params: constructor parameters of the named codec (e.g. ``ratio=0.01``).
            ``sparse_as_dense=True`` (Horovod) is accepted and changes nothing: sparse
            gradients are always densified.

    Returns:
        The distributed optimizer.

    Raises:
        ValueError: duplicate parameter names (listed), parameters missing from
            ``named_parameters``, or ``backward_passes_per_step < 1``.
        ConfigError: ``gradient_predivide_factor`` outside ``[1, size]``, or not 1 with
            ``op=hp.Sum``.
        UnsupportedArgumentError: a Horovod argument HiPress does not implement
            (``process_set``, ``num_groups``, ``groups``, ``sparse_as_dense=False``,
            ``op=hp.Adasum``); the message names it and the alternative.
        CodecError: unknown codec name (valid names listed) or bad codec parameters.
        HiPressError: :func:`hipress.init` was not called.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"expect a torch.optim.Optimizer, got {type(optimizer)}")
    if "sparse_as_dense" in codec_params:
        if codec_params["sparse_as_dense"] is not True:
            raise UnsupportedArgumentError(
                f"DistributedOptimizer(sparse_as_dense={codec_params['sparse_as_dense']!r}): "
                "sparse (allgathered) gradients are not supported by HiPress; the PyTorch "
                "adapter always densifies sparse gradients. Drop the argument (or pass True)"
            )
        codec_params = {k: v for k, v in codec_params.items() if k != "sparse_as_dense"}
    check_horovod_args(codec_params, "DistributedOptimizer")
    check_horovod_op(op, "DistributedOptimizer")
    if not hipress.is_initialized():
        raise HiPressError(
            "hipress is not initialized; call hipress.torch.init() before building the "
            "DistributedOptimizer"
        )
    if isinstance(optimizer, _DistributedOptimizer):
        raise ValueError("the optimizer is already a DistributedOptimizer")
    base = type(optimizer)
    cls = type(base.__name__, (_DistributedOptimizer, base), {"__module__": base.__module__})
    dist = cls.__new__(cls)
    dist.__dict__.update(optimizer.__dict__)
    dist._hp_setup(named_parameters, compression, backward_passes_per_step, op, codec_params,
                   gradient_predivide_factor)
    return dist
