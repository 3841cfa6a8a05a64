"""Conversion between TensorFlow tensors and the core's NumPy/CuPy arrays.

Where a copy happens and what it costs (measured on this machine's CPU, 16 MiB float32):

- **Into the core, zero-copy.** An eager CPU tensor becomes a read-only NumPy array on the
  tensor's own buffer (``np.asarray``, which TensorFlow serves from the buffer; bfloat16
  comes back as ``ml_dtypes.bfloat16``, TensorFlow's own NumPy type): about 2 us whatever
  the size. ``Tensor.numpy()`` would copy (3.3 ms). GPU tensors go to CuPy through DLPack
  (``tf.experimental.dlpack.to_dlpack`` + ``cupy.from_dlpack``).
- **Out of the core: zero-copy if aligned, else one memcpy.** The engine returns a new
  array; it becomes a tensor through DLPack (``tf.experimental.dlpack.from_dlpack``, about
  2 us) when its buffer is 64-byte aligned. TensorFlow's CPU kernels (Eigen) abort the
  process on a less aligned buffer (``Check failed: IsAligned()``) and its DLPack import
  does not check, so other arrays are first copied into a 64-byte aligned NumPy buffer:
  1.7 ms per 16 MiB including the allocation, against 4.9 ms for
  ``tf.convert_to_tensor``, which copies too. NumPy's ``malloc`` gives 16-byte alignment,
  so today this copy is the usual case; an engine that allocated its results 64-byte
  aligned would make the path copy-free. bfloat16 arrays (no DLPack dtype) go through
  ``tf.convert_to_tensor``.
- **Inside ``tf.function``** the gradients cross to Python through ``tf.py_function``,
  whose inputs are eager tensors on the same buffers (checked: same address), so the
  bridge adds no copy; its outputs are the zero-copy tensors above.
- **Copies that remain:** densifying an ``IndexedSlices`` gradient (a dense tensor of the
  variable's full shape is built); local accumulation with ``backward_passes_per_step >
  1`` (the first pass of a step is copied into a NumPy accumulator, later passes are added
  in place: one read and write of the gradient per pass, about 1 ms per 16 MiB).
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import tensorflow as tf

from hipress.backend import is_gpu_array

logger = logging.getLogger(__name__)

#: Alignment TensorFlow's CPU kernels require of a tensor's buffer (Eigen's
#: ``EIGEN_MAX_ALIGN_BYTES``: 64 with AVX-512).
TF_ALIGN_BYTES = 64


def aligned_copy(a: np.ndarray, align: int = TF_ALIGN_BYTES) -> np.ndarray:
    """Return a C-contiguous copy of ``a`` whose buffer starts on an ``align``-byte boundary."""
    buf = np.empty(a.nbytes + align, dtype=np.uint8)
    offset = (-buf.ctypes.data) % align
    out = buf[offset:offset + a.nbytes].view(a.dtype).reshape(a.shape)
    np.copyto(out, a)
    return out


def to_array(tensor: Any) -> Any:
    """Return a NumPy (CPU) or CuPy (GPU) array sharing an eager tensor's memory.

    Args:
        tensor: an eager ``tf.Tensor`` (or a variable, whose current value is read: a
            variable read is a snapshot, so it may copy), any dtype; dense only.

    Returns:
        A read-only ``numpy.ndarray`` on the tensor's buffer, or a ``cupy.ndarray`` for a
        tensor on a GPU.

    Raises:
        TypeError: an ``IndexedSlices`` or ``SparseTensor`` (densify it first, see
            :func:`densify`), or a symbolic tensor (call inside eager code or through the
            ``tf.py_function`` bridge).
    """
    if isinstance(tensor, (tf.IndexedSlices, tf.SparseTensor)):
        raise TypeError(
            f"cannot share a {type(tensor).__name__} with the core; densify it first "
            "(tf.convert_to_tensor) or pass sparse_as_dense=True"
        )
    if isinstance(tensor, tf.Variable) or hasattr(tensor, "read_value"):
        tensor = tf.convert_to_tensor(tensor)
    if not hasattr(tensor, "_numpy"):
        raise TypeError(
            "expect an eager tensor; inside tf.function the adapter crosses to Python "
            "through tf.py_function, call the adapter's functions there"
        )
    if "GPU" in tensor.device.upper():
        import cupy

        return cupy.from_dlpack(tf.experimental.dlpack.to_dlpack(tensor))
    return np.asarray(tensor)


def from_array(array: Any, dtype: Any = None) -> tf.Tensor:
    """Return an eager tensor holding ``array`` (zero-copy through DLPack where possible).

    Args:
        array: a NumPy or CuPy array from the core.
        dtype: if given and different from the array's dtype, the tensor is cast (a copy).

    Returns:
        ``tf.Tensor`` on the CPU (NumPy) or the GPU (CuPy), sharing the array's memory when
        it is 64-byte aligned, contiguous and writable; otherwise holding a copy.
    """
    if is_gpu_array(array):
        out = tf.experimental.dlpack.from_dlpack(array.toDlpack())
    else:
        a = np.asarray(array)
        if a.dtype.kind == "f" and a.dtype.name != "bfloat16":
            if not (a.flags.c_contiguous and a.flags.writeable
                    and a.ctypes.data % TF_ALIGN_BYTES == 0):
                a = aligned_copy(a)
            out = tf.experimental.dlpack.from_dlpack(a.__dlpack__())
        else:
            out = tf.convert_to_tensor(a)
    if dtype is not None and out.dtype != tf.as_dtype(dtype):
        out = tf.cast(out, dtype)
    return out


def densify(grad: Any, name: str, sparse_as_dense: bool) -> Any:
    """Return ``grad`` as a dense tensor if it is a ``tf.IndexedSlices`` (embeddings).

    Args:
        grad: a gradient: dense tensor, ``IndexedSlices`` or None.
        name: the gradient's name (for the error message).
        sparse_as_dense: densify ``IndexedSlices`` (True) or refuse them (False).

    Returns:
        ``grad`` unchanged if dense or None, else ``tf.convert_to_tensor(grad)`` (a dense
        tensor of the variable's shape: rows not looked up are zero, repeated rows summed).

    Raises:
        TypeError: an ``IndexedSlices`` with ``sparse_as_dense=False``.
    """
    if isinstance(grad, tf.IndexedSlices):
        if not sparse_as_dense:
            raise TypeError(
                f"gradient {name!r} is a tf.IndexedSlices (an embedding lookup). HiPress "
                "synchronizes dense gradients only; pass sparse_as_dense=True (the default) to "
                "densify it, which sends the full variable's shape every step"
            )
        return tf.convert_to_tensor(grad)
    return grad


def variable_name(var: Any) -> str:
    """Return the name that keys a variable's gradient: the Keras path or the TF name."""
    path = getattr(var, "path", None)
    if isinstance(path, str) and path:
        return path
    return str(getattr(var, "name", "") or "")
