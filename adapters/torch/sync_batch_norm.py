"""``SyncBatchNorm``: batch normalization whose batch statistics cover every rank's batch.

A drop-in for ``torch.nn.SyncBatchNorm`` and ``horovod.torch.SyncBatchNorm``::

    import hipress.torch as hp
    hp.init()
    model = hp.SyncBatchNorm.convert_sync_batchnorm(model)   # every BatchNorm*d replaced

With small per-rank batches (detection, segmentation, large models) the local batch is too
small for good statistics; synchronizing them makes ``N`` ranks of batch ``B`` normalize
like one process with batch ``N * B``.

How a training-mode forward runs (input ``x`` of shape ``(B, C, *)``, any float dtype):

1. per channel, this rank's sum of ``x`` and of ``x**2`` (accumulated in float64) and its
   element count ``B * prod(*)`` are packed into one float64 array of ``2C + 1`` values;
2. :func:`hipress.allreduce` sums it over all ranks, exactly (no codec, whatever the
   compression policy), under the name ``sync_batch_norm.<layer>.stats``;
3. ``mean = sum / n`` and the biased ``var = sum_sq / n - mean**2`` normalize ``x``:
   ``y = (x - mean) / sqrt(var + eps) * weight + bias`` (in ``x``'s dtype);
4. the running statistics are updated as by ``torch.nn.BatchNorm*d``:
   ``running = (1 - momentum) * running + momentum * stat`` with the *unbiased* variance
   ``var * n / (n - 1)`` (``momentum=None``: the cumulative average).

The backward pass (an autograd Function) reduces, per channel, the sums of ``dy`` and of
``dy * xhat`` over all ranks in the same way (``sync_batch_norm.<layer>.grads``, one
``2C`` array) and returns ``dx = (dy - mean(dy) - xhat * mean(dy * xhat)) * weight /
sqrt(var + eps)``: the gradient of the sum of every rank's loss, i.e. what one process
would compute on the concatenated batch. ``weight`` and ``bias`` get this rank's own
gradient (the sum over its batch), which the ``DistributedOptimizer`` then averages, as
for any parameter. Ranks may hold batches of different sizes (even empty ones); the total
count must exceed 1.

In evaluation mode (or with ``track_running_stats=False`` outside training), and at world
size 1, the layer is exactly ``torch.nn.BatchNorm*d``: nothing is communicated.

Every rank must run the layer's forward (and, when the input needs a gradient, its
backward) the same number of times in the same order, as with any collective; layers are
told apart by a number given at construction, so build the model the same way everywhere.
"""

from __future__ import annotations

import itertools
import threading
from typing import Any, Optional, Tuple

import numpy as np
import torch
from torch.autograd.function import once_differentiable

import hipress
from hipress.adapter_common import UnsupportedArgumentError

_layer_ids = itertools.count()
_layer_ids_lock = threading.Lock()


def _next_layer_id() -> int:
    with _layer_ids_lock:
        return next(_layer_ids)


def _allreduce_sum(values: torch.Tensor, name: str) -> torch.Tensor:
    """Return the exact sum over ranks of a small float64 tensor (a new tensor, same device)."""
    array = np.ascontiguousarray(values.detach().to("cpu", torch.float64).numpy())
    total = hipress.allreduce(array, name=name, op="sum")
    return torch.from_numpy(np.asarray(total, dtype=np.float64).copy()).to(values.device)


class _SyncBatchNormFunction(torch.autograd.Function):
    """Synchronized batch normalization (forward and backward reduce over every rank)."""

    @staticmethod
    def forward(  # noqa: PLR0913  (autograd passes every input positionally)
        ctx: Any,
        x: torch.Tensor,
        weight: Optional[torch.Tensor],
        bias: Optional[torch.Tensor],
        running_mean: Optional[torch.Tensor],
        running_var: Optional[torch.Tensor],
        eps: float,
        momentum: float,
        name: str,
    ) -> torch.Tensor:
        channels = x.shape[1]
        dims = [0] + list(range(2, x.dim()))
        shape = [1, channels] + [1] * (x.dim() - 2)
        count = x.numel() // channels if channels else 0
        local = torch.cat([
            x.sum(dim=dims, dtype=torch.float64),
            (x * x).sum(dim=dims, dtype=torch.float64),
            torch.tensor([float(count)], dtype=torch.float64, device=x.device),
        ])
        total = _allreduce_sum(local, f"{name}.stats")
        n = float(total[-1])
        if n <= 1:
            raise ValueError(
                f"SyncBatchNorm needs more than 1 value per channel over all ranks when "
                f"training, got {int(n)} (input of shape {tuple(x.shape)} on this rank); use "
                "larger batches or put the layer in eval mode"
            )
        mean = total[:channels] / n
        var = (total[channels:2 * channels] / n - mean * mean).clamp_(min=0.0)
        invstd = torch.rsqrt(var + eps)
        if running_mean is not None and running_var is not None:
            with torch.no_grad():
                running_mean.mul_(1.0 - momentum).add_(mean.to(running_mean.dtype),
                                                       alpha=momentum)
                unbiased = var * (n / (n - 1.0))
                running_var.mul_(1.0 - momentum).add_(unbiased.to(running_var.dtype),
                                                      alpha=momentum)
        mean_x = mean.to(x.dtype).view(shape)
        invstd_x = invstd.to(x.dtype).view(shape)
        xhat = (x - mean_x) * invstd_x
        out = xhat
        if weight is not None:
            out = out * weight.to(x.dtype).view(shape)
        if bias is not None:
            out = out + bias.to(x.dtype).view(shape)
        ctx.save_for_backward(x, weight, mean_x, invstd_x)
        ctx.count = n
        ctx.name = name
        ctx.has_bias = bias is not None
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_out: torch.Tensor) -> Tuple[Optional[torch.Tensor], ...]:
        x, weight, mean_x, invstd_x = ctx.saved_tensors
        channels = x.shape[1]
        dims = [0] + list(range(2, x.dim()))
        shape = [1, channels] + [1] * (x.dim() - 2)
        xhat = (x - mean_x) * invstd_x
        sum_dy = grad_out.sum(dim=dims, dtype=torch.float64)
        sum_dy_xhat = (grad_out * xhat).sum(dim=dims, dtype=torch.float64)
        grad_x = grad_weight = grad_bias = None
        if weight is not None and ctx.needs_input_grad[1]:
            grad_weight = sum_dy_xhat.to(weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = sum_dy.to(weight.dtype if weight is not None else x.dtype)
        if ctx.needs_input_grad[0]:
            total = _allreduce_sum(torch.cat([sum_dy, sum_dy_xhat]), f"{ctx.name}.grads")
            mean_dy = (total[:channels] / ctx.count).to(x.dtype).view(shape)
            mean_dy_xhat = (total[channels:] / ctx.count).to(x.dtype).view(shape)
            scale = invstd_x if weight is None else invstd_x * weight.to(x.dtype).view(shape)
            grad_x = (grad_out - mean_dy - xhat * mean_dy_xhat) * scale
        return grad_x, grad_weight, grad_bias, None, None, None, None, None


class SyncBatchNorm(torch.nn.modules.batchnorm._BatchNorm):
    """Batch normalization over the union of every rank's batch (training mode).

    Same constructor, parameters, buffers and ``state_dict`` keys as
    ``torch.nn.BatchNorm2d`` (and 1d/3d: any input of shape ``(B, C, *)`` with at least 2
    dimensions), so checkpoints move between the two.

    Args:
        num_features: ``C``, the number of channels (dimension 1 of the input).
        eps: added to the variance for numerical stability.
        momentum: weight of the new batch in the running statistics; None for a
            cumulative average.
        affine: learnable per-channel ``weight`` and ``bias``.
        track_running_stats: keep ``running_mean`` / ``running_var`` (used in eval mode).
        process_group: must be None (HiPress synchronizes over all ranks).
        device, dtype: of the parameters and buffers.
        bias: with ``affine``, learn a bias too (False needs a torch with that option).

    Raises:
        UnsupportedArgumentError: a ``process_group`` was given.
    """

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: Optional[float] = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        process_group: Any = None,
        device: Any = None,
        dtype: Any = None,
        *,
        bias: bool = True,
    ) -> None:
        if process_group is not None:
            raise UnsupportedArgumentError(
                "SyncBatchNorm(process_group=...): process groups are not supported by "
                "HiPress; statistics are synchronized over all ranks of the job. Drop the "
                "argument"
            )
        extra = {} if bias else {"bias": False}  # torch >= 2.13 can drop the bias alone
        super().__init__(num_features, eps, momentum, affine, track_running_stats,
                         device=device, dtype=dtype, **extra)
        self.layer_id = _next_layer_id()

    def _check_input_dim(self, input: torch.Tensor) -> None:  # noqa: A002  (torch's name)
        if input.dim() < 2:
            raise ValueError(
                f"SyncBatchNorm expects an input of shape (batch, channels, ...) with at least "
                f"2 dimensions, got {input.dim()}D of shape {tuple(input.shape)}"
            )

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002
        """Normalize ``input`` of shape ``(B, C, *)``; statistics over every rank in training.

        Returns:
            A tensor of the input's shape and dtype.

        Raises:
            ValueError: the input has fewer than 2 dimensions, or in training the total
                count per channel over all ranks is 1 or less.
            HiPressError: the synchronization failed (e.g. a rank never ran this layer).
        """
        if not (self.training and hipress.is_initialized() and hipress.size() > 1):
            return super().forward(input)  # exactly torch's BatchNorm
        self._check_input_dim(input)
        if input.shape[1] != self.num_features:
            raise ValueError(
                f"SyncBatchNorm({self.num_features}) got an input with {input.shape[1]} "
                f"channels (shape {tuple(input.shape)}); dimension 1 must be the channels"
            )
        factor = 0.0 if self.momentum is None else float(self.momentum)
        if self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:
                factor = 1.0 / float(self.num_batches_tracked)
        running = self.track_running_stats
        return _SyncBatchNormFunction.apply(
            input, self.weight, self.bias,
            self.running_mean if running else None, self.running_var if running else None,
            self.eps, factor, f"sync_batch_norm.{self.layer_id}",
        )

    @classmethod
    def convert_sync_batchnorm(cls, module: torch.nn.Module,
                               process_group: Any = None) -> torch.nn.Module:
        """Return ``module`` with every ``BatchNorm*d`` (and torch ``SyncBatchNorm``) replaced.

        As ``torch.nn.SyncBatchNorm.convert_sync_batchnorm``: the new layers share the old
        ones' ``weight``/``bias`` parameters and running buffers and keep their training
        flag, so call it before building the optimizer. Layers are numbered in module
        order, the same on every rank that builds the same model.

        Args:
            module: any module (a bare batch-norm layer is replaced and returned).
            process_group: must be None.

        Returns:
            The converted module (``module`` itself unless it is a batch-norm layer).

        Raises:
            UnsupportedArgumentError: a ``process_group`` was given.
        """
        if process_group is not None:
            raise UnsupportedArgumentError(
                "convert_sync_batchnorm(process_group=...): process groups are not supported "
                "by HiPress; statistics are synchronized over all ranks. Drop the argument"
            )
        out = module
        if (isinstance(module, torch.nn.modules.batchnorm._BatchNorm)
                and not isinstance(module, cls)):
            out = cls(module.num_features, module.eps, module.momentum, module.affine,
                      module.track_running_stats,
                      bias=module.bias is not None or not module.affine)
            if module.affine:
                with torch.no_grad():
                    out.weight = module.weight
                    out.bias = module.bias
            out.running_mean = module.running_mean
            out.running_var = module.running_var
            out.num_batches_tracked = module.num_batches_tracked
            out.training = module.training
            if hasattr(module, "qconfig"):
                out.qconfig = module.qconfig
        for name, child in module.named_children():
            out.add_module(name, cls.convert_sync_batchnorm(child))
        return out
