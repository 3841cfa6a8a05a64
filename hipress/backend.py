"""Array back ends and dtypes shared by every part of the core.

The core works on NumPy arrays on the CPU and CuPy arrays on the GPU; CuPy is imported
lazily, only when a CuPy array is actually seen. bfloat16 comes from ``ml_dtypes``, the
NumPy extension dtype that TensorFlow and JAX use as well.
"""

from __future__ import annotations

import types
from typing import Any

import ml_dtypes
import numpy as np

bfloat16 = np.dtype(ml_dtypes.bfloat16)

#: Wire codes of the dtypes a payload may carry. Codes are part of the wire format:
#: never renumber one, only append.
DTYPE_CODES: dict[np.dtype, int] = {
    np.dtype(np.float16): 1,
    bfloat16: 2,
    np.dtype(np.float32): 3,
    np.dtype(np.float64): 4,
    np.dtype(np.int8): 5,
    np.dtype(np.uint8): 6,
    np.dtype(np.int16): 7,
    np.dtype(np.uint16): 8,
    np.dtype(np.int32): 9,
    np.dtype(np.uint32): 10,
    np.dtype(np.int64): 11,
    np.dtype(np.uint64): 12,
    np.dtype(np.bool_): 13,
}
CODE_DTYPES: dict[int, np.dtype] = {code: dt for dt, code in DTYPE_CODES.items()}

#: Dtypes uncompressed collectives accept (allreduce with codec=None, allgather, alltoall,
#: reducescatter, broadcast): the floats and every integer dtype with a wire code, bool too.
COLLECTIVE_DTYPES = tuple(DTYPE_CODES)

#: Floating dtypes a gradient may have.
GRADIENT_DTYPES = (np.dtype(np.float16), bfloat16, np.dtype(np.float32), np.dtype(np.float64))


def array_module(x: Any) -> types.ModuleType:
    """Return ``cupy`` for a CuPy array and ``numpy`` for anything else.

    CuPy is imported only when ``x`` is a CuPy array, so CPU-only installs never need it.
    """
    if type(x).__module__.split(".", 1)[0] == "cupy":
        import cupy

        return cupy
    return np


def is_gpu_array(x: Any) -> bool:
    """Return True if ``x`` is a CuPy array (device memory)."""
    return type(x).__module__.split(".", 1)[0] == "cupy"


def to_host(x: Any) -> np.ndarray:
    """Return ``x`` as a NumPy array, copying from the GPU if it is a CuPy array."""
    if is_gpu_array(x):
        return x.get()
    return np.asarray(x)


def dtype_code(dtype: Any) -> int:
    """Return the wire code of ``dtype``.

    Raises:
        ValueError: ``dtype`` is not one a payload can carry; the message lists those.
    """
    dt = np.dtype(dtype)
    try:
        return DTYPE_CODES[dt]
    except KeyError:
        valid = ", ".join(sorted(str(d) for d in DTYPE_CODES))
        raise ValueError(f"dtype {dt} cannot travel in a payload; valid dtypes: {valid}") from None


def check_gradient_dtype(dtype: Any, what: str = "gradient") -> np.dtype:
    """Return ``np.dtype(dtype)`` if it is a floating gradient dtype.

    Raises:
        TypeError: ``dtype`` is not float16, bfloat16, float32 or float64.
    """
    dt = np.dtype(dtype)
    if dt not in GRADIENT_DTYPES:
        raise TypeError(
            f"{what} has dtype {dt}; expect float16, bfloat16, float32 or float64 "
            "(cast integer tensors to a float dtype before synchronizing them)"
        )
    return dt


def check_collective_dtype(dtype: Any, what: str = "tensor") -> np.dtype:
    """Return ``np.dtype(dtype)`` if an uncompressed collective can carry it.

    Raises:
        TypeError: ``dtype`` is not in :data:`COLLECTIVE_DTYPES`; the message lists them.
    """
    dt = np.dtype(dtype)
    if dt not in DTYPE_CODES:
        valid = ", ".join(sorted(str(d) for d in DTYPE_CODES))
        raise TypeError(f"{what} has dtype {dt}, which HiPress collectives cannot carry; "
                        f"valid dtypes: {valid}")
    return dt


def compute_dtype(dtype: Any) -> np.dtype:
    """Return the dtype arithmetic on a gradient of ``dtype`` is done in.

    float16 and bfloat16 are upcast to float32 (their sums overflow or lose bits quickly);
    float32 and float64 are kept.
    """
    dt = np.dtype(dtype)
    return np.dtype(np.float64) if dt == np.float64 else np.dtype(np.float32)


def store_scaled(value: Any, out: Any, divisor: int = 1) -> None:
    """Write ``value / divisor`` into ``out`` (same number of elements), rounded to its dtype.

    The division runs in the compute dtype (float32 for 16-bit floats) and the result is
    cast on store, in one pass; ``divisor == 1`` is a plain copy. ``value`` moves to
    ``out``'s device first. The engine writes every averaged result through this, so the
    rounding is the same on every path and every rank.
    """
    xp = array_module(out)
    value = xp.asarray(value) if xp is not np else to_host(value)
    if divisor != 1:
        value = value.astype(compute_dtype(value.dtype), copy=False).reshape(out.shape)
        xp.divide(value, value.dtype.type(divisor), out=out, casting="unsafe")
    else:
        out[...] = value.reshape(out.shape)
