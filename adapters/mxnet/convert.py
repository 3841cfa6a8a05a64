"""Conversion between MXNet NDArrays and the core's NumPy/CuPy arrays.

Where a copy happens and what it costs (this machine's CPU, 16 MiB float32):

- **Into the core, zero-copy.** ``mx.nd.to_dlpack_for_read`` waits for the array's pending
  writes (MXNet's engine is asynchronous) and exports its buffer; NumPy (>= 1.22) wraps it
  with ``np.from_dlpack``: a read-only view, about 6 us, where ``asnumpy()`` copies
  (1.5 ms). CPU contexts only give NumPy; GPU contexts go to CuPy (``cupy.from_dlpack``
  on the same capsule; untested here, no GPU).
- **Back into the gradient, one copy.** The engine returns a new array; it is written into
  the existing gradient NDArray (``grad[:] = result``, MXNet's synchronous copy from host
  memory): 1.3 ms per 16 MiB. The gradient must stay the array autograd writes into, so
  this copy stays unless the engine learns to reduce in place.
"""

from __future__ import annotations

from typing import Any

import mxnet as mx
import numpy as np

from hipress.backend import is_gpu_array

#: NDArray dtypes a gradient may have (MXNet's CPU bfloat16 has no NumPy/DLPack twin).
FLOAT_DTYPES = (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64))


class _Capsule:
    """Adapts a DLPack capsule to NumPy's ``from_dlpack`` protocol (``__dlpack__``)."""

    __slots__ = ("capsule",)

    def __init__(self, capsule: Any) -> None:
        self.capsule = capsule

    def __dlpack__(self, stream: Any = None, **kwargs: Any) -> Any:
        return self.capsule

    def __dlpack_device__(self) -> tuple:
        return (1, 0)  # kDLCPU, device 0


def is_gpu(nd: mx.nd.NDArray) -> bool:
    """Return True if ``nd`` lives on a GPU context."""
    return nd.context.device_type == "gpu"


def to_array(nd: mx.nd.NDArray, any_dtype: bool = False) -> Any:
    """Return a NumPy (CPU) or CuPy (GPU) array sharing ``nd``'s memory (read-only on CPU).

    Waits for pending writes to ``nd`` first (the gradient of a backward pass in flight).

    Args:
        nd: a dense float16/float32/float64 NDArray; a ``row_sparse``/``csr`` array is
            densified first (a copy).
        any_dtype: accept integer dtypes too (uncompressed collectives; the core checks).

    Returns:
        ``numpy.ndarray`` (read-only view) or ``cupy.ndarray``.

    Raises:
        TypeError: another dtype.
    """
    if nd.stype != "default":
        nd = nd.tostype("default")
    if not any_dtype:
        check_dtype(nd)
    capsule = nd.to_dlpack_for_read()
    if is_gpu(nd):
        import cupy

        return cupy.from_dlpack(capsule)
    return np.from_dlpack(_Capsule(capsule))


def write_into(nd: mx.nd.NDArray, array: Any) -> None:
    """Copy ``array`` (NumPy or CuPy, ``nd``'s shape) into the existing NDArray ``nd``."""
    if is_gpu_array(array):
        nd[:] = mx.nd.from_dlpack(array.toDlpack())
    else:
        nd[:] = np.asarray(array, dtype=nd.dtype)


def from_array(array: Any, ctx: Any = None) -> mx.nd.NDArray:
    """Return a new NDArray holding ``array`` (on ``ctx``, default the CPU)."""
    if is_gpu_array(array):
        out = mx.nd.from_dlpack(array.toDlpack())
        return out.copyto(ctx) if ctx is not None and ctx != out.context else out
    return mx.nd.array(np.asarray(array), ctx=ctx or mx.cpu(), dtype=np.asarray(array).dtype)


def zeros_like_array(nd: mx.nd.NDArray) -> Any:
    """Return NumPy (CPU) or CuPy (GPU) zeros of ``nd``'s shape and dtype."""
    if is_gpu(nd):
        import cupy

        return cupy.zeros(nd.shape, dtype=np.dtype(nd.dtype))
    return np.zeros(nd.shape, dtype=np.dtype(nd.dtype))


def check_dtype(nd: mx.nd.NDArray) -> None:
    """Raise ``TypeError`` unless ``nd`` is float16/float32/float64."""
    if np.dtype(nd.dtype) not in FLOAT_DTYPES:
        raise TypeError(
            f"NDArray of dtype {np.dtype(nd.dtype)} cannot be synchronized; HiPress reduces "
            "float16, float32 and float64 arrays (cast the parameter or keep it out of the "
            "trainer)"
        )
