"""Zero-copy conversion between torch tensors and the core's NumPy/CuPy arrays.

- CPU tensors become NumPy arrays sharing their memory (``Tensor.numpy()``); bfloat16,
  which NumPy lacks, is viewed as int16 and reinterpreted as ``hipress.backend.bfloat16``
  (``ml_dtypes``), still without a copy.
- CUDA tensors become CuPy arrays through DLPack (``cupy.from_dlpack``), which also orders
  the CuPy stream after the tensor's producer stream. bfloat16 CUDA tensors (CuPy has no
  bfloat16) cross as a float32 copy (exact widening, one device pass); results come back
  rounded to bfloat16 by the callers' copy into the tensor (``from_array(..., like=t)``),
  since the copy never shares the tensor's memory.
- Arrays come back through ``torch.from_numpy`` / ``torch.from_dlpack``.

The NumPy array keeps the tensor alive (it is the array's base), so a submitted gradient
stays valid until the engine is done with it.
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np
import torch

from hipress.backend import bfloat16, is_gpu_array


def to_array(tensor: torch.Tensor) -> Any:
    """Return a NumPy (CPU) or CuPy (CUDA) array sharing ``tensor``'s memory.

    Args:
        tensor: a dense (strided) tensor on the CPU or a CUDA device; autograd history is
            dropped (``detach``), the memory is shared.

    Returns:
        ``numpy.ndarray`` or ``cupy.ndarray`` of the same shape, strides and dtype
        (bfloat16 as ``ml_dtypes.bfloat16`` on the CPU; on CUDA a float32 copy, which
        :func:`shares_memory` reports as not the tensor's memory).

    Raises:
        TypeError: a sparse tensor, or a device other than CPU/CUDA.
    """
    t = tensor.detach()
    if t.layout != torch.strided:
        raise TypeError(
            f"cannot share a {t.layout} tensor with the core; densify it with .to_dense()"
        )
    if t.is_conj() or t.is_neg():
        t = t.resolve_conj().resolve_neg()
    if t.device.type == "cpu":
        if t.dtype == torch.bfloat16:
            return t.view(torch.int16).numpy().view(bfloat16)
        return t.numpy()
    if t.device.type == "cuda":
        import cupy

        if t.dtype == torch.bfloat16:
            return cupy.from_dlpack(t.float())  # CuPy has no bfloat16: widen (exact)

        return cupy.from_dlpack(t)
    raise TypeError(f"tensors on device {t.device} are not supported; use the CPU or CUDA")


def from_array(array: Any, like: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Return a tensor sharing ``array``'s memory (NumPy -> CPU, CuPy -> CUDA).

    Args:
        array: a NumPy or CuPy array (bfloat16 NumPy arrays become torch.bfloat16).
        like: if given, the result is moved/cast to ``like``'s device and dtype (a copy
            only when they differ).

    Returns:
        The tensor. A read-only NumPy array is copied first (torch tensors are writable).
    """
    if is_gpu_array(array):
        out = torch.from_dlpack(array)
    else:
        a = np.asarray(array)
        if not a.flags.writeable:
            a = a.copy()
        if a.dtype == bfloat16:
            out = torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
        else:
            out = torch.from_numpy(a)
    if like is not None and (out.device != like.device or out.dtype != like.dtype):
        out = out.to(device=like.device, dtype=like.dtype)
    return out


def shares_memory(array: Any, tensor: torch.Tensor) -> bool:
    """Return True if ``array`` (NumPy/CuPy) starts at ``tensor``'s first element.

    With equal shapes and both contiguous this means they are the same buffer, e.g. a
    result the engine wrote in place into a gradient (``allreduce_async(inplace=True)``).
    """
    if not tensor.is_contiguous() or not getattr(array, "flags", None) or \
            not array.flags.c_contiguous:
        return False
    if is_gpu_array(array):
        ptr = array.data.ptr
    elif isinstance(array, np.ndarray):
        ptr = array.__array_interface__["data"][0]
    else:
        return False
    return ptr == tensor.data_ptr() and array.nbytes == tensor.numel() * tensor.element_size()


def is_tensor(x: Any) -> bool:
    """Return True for a torch tensor (the leaf test used on nested states)."""
    return isinstance(x, torch.Tensor)


def is_core_array(x: Any) -> bool:
    """Return True for a NumPy or CuPy array."""
    return isinstance(x, np.ndarray) or is_gpu_array(x)


def tensor_meta(t: torch.Tensor) -> tuple:
    """Return ``(shape, dtype name)`` of ``t``, picklable (the skeleton of a broadcast)."""
    return tuple(t.shape), str(t.dtype).replace("torch.", "")


def empty_from_meta(meta: tuple) -> torch.Tensor:
    """Return an uninitialized CPU tensor for a ``tensor_meta`` result."""
    shape, dtype = meta
    return torch.empty(shape, dtype=getattr(torch, dtype))


def engine_state_to_torch(state: Any) -> Any:
    """Turn the NumPy arrays and NumPy scalars of an engine state into tensors / Python values.

    So that ``torch.save`` of an optimizer state dict loads with ``torch.load``'s default
    ``weights_only=True``.
    """
    from hipress.adapter_common import tree_map

    def conv(x: Any) -> Any:
        if isinstance(x, np.generic):
            return x.item()
        return from_array(np.array(x, copy=True))

    return tree_map(conv, state, lambda x: isinstance(x, (np.ndarray, np.generic)))


def engine_state_from_torch(state: Any) -> Any:
    """Invert :func:`engine_state_to_torch`: tensors become NumPy arrays (copied)."""
    from hipress.adapter_common import tree_map

    def conv(t: torch.Tensor) -> np.ndarray:
        return np.array(to_array(t.detach().cpu()), copy=True)

    return tree_map(conv, state, is_tensor)
