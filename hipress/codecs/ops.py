"""The operator library codecs are built from (the library half of CompLL).

Pure functions over NumPy or CuPy arrays (the module is picked from the input with
:func:`hipress.backend.array_module`): bit packing, k for a ratio, sampled thresholds,
sparsify/desparsify, seeded random streams and finiteness checks. Each is small enough to
read next to the paper it serves, and each is what a CompLL spec calls by name.
"""

from __future__ import annotations

import math
import zlib
from typing import Any, Tuple

import numpy as np

from hipress.backend import array_module
from hipress.errors import CodecError, NonFiniteGradientError


def check_ratio(ratio: float, what: str = "ratio") -> float:
    """Return ``ratio`` as a float if 0 < ratio <= 1.

    Raises:
        CodecError: the ratio is outside (0, 1]; the message gives the valid range.
    """
    try:
        r = float(ratio)
    except (TypeError, ValueError):
        raise CodecError(f"{what} must be a number in (0, 1], got {ratio!r}") from None
    if not (0.0 < r <= 1.0) or math.isnan(r):
        raise CodecError(f"{what} must be in (0, 1] (fraction of elements kept), got {ratio!r}")
    return r


def k_for_ratio(ratio: float, n: int) -> int:
    """Return k = clamp(floor(ratio * n), 1, n): elements a sparsifier keeps out of ``n``.

    Example: n = 100, ratio 0.1 -> 10; n = 5, ratio 0.1 -> 1; n = 0 -> 0.
    """
    if n <= 0:
        return 0
    return min(max(int(math.floor(ratio * n)), 1), n)


def check_finite(value: Any, name: str, what: str = "scale") -> None:
    """Raise if a reduction of a gradient (its scale, norm or threshold) is NaN or Inf.

    A reduction such as max|g| or sum|g| is non-finite exactly when the gradient holds a
    NaN or an Inf, so codecs check the scalar they compute anyway instead of making a
    separate pass over the gradient.

    Raises:
        NonFiniteGradientError: naming the gradient.
    """
    v = float(value)
    if not math.isfinite(v):
        label = repr(name) if name else "(unnamed)"
        raise NonFiniteGradientError(
            f"gradient {label} holds NaN or Inf (its {what} is {v}); lossy codecs refuse "
            "non-finite gradients. Lower the learning rate, enable loss scaling or gradient "
            "clipping, or skip the step when the loss is not finite"
        )


# ------------------------------------------------------------------------ bit packing
def pack_bits(bits: Any) -> Any:
    """Pack a boolean (or 0/1) 1-D array into uint8, 8 per byte, most significant bit first.

    Args:
        bits: 1-D array of n booleans.

    Returns:
        uint8 array of ceil(n / 8) bytes; the last byte is zero-padded.
    """
    xp = array_module(bits)
    return xp.packbits(bits.astype(bool, copy=False))


def unpack_bits(packed: Any, n: int) -> Any:
    """Unpack ``n`` booleans packed by :func:`pack_bits` (padding bits are dropped).

    Returns:
        bool array of shape (n,).
    """
    xp = array_module(packed)
    if xp is np:
        return np.unpackbits(packed, count=n).view(bool)
    return xp.unpackbits(packed)[:n].astype(bool)


def pack_codes(codes: Any, bits: int) -> Any:
    """Pack unsigned integer codes of ``bits`` bits each (1, 2, 4 or 8) into uint8.

    Code i sits in byte i // (8 / bits), at bit offset (i mod (8 / bits)) * bits counted
    from the most significant end, so ``bits = 1`` equals :func:`pack_bits`. The tail is
    zero-padded.

    Args:
        codes: 1-D uint8 array of n codes, each < 2**bits.
        bits: code width.

    Returns:
        uint8 array of ceil(n * bits / 8) bytes.
    """
    if bits not in (1, 2, 4, 8):
        raise CodecError(f"code width must be 1, 2, 4 or 8 bits, got {bits}")
    xp = array_module(codes)
    codes = codes.astype(np.uint8, copy=False)
    if bits == 8:
        return codes.copy()
    per = 8 // bits
    n = codes.size
    full = -(-n // per) * per
    if full != n:
        codes = xp.concatenate([codes, xp.zeros(full - n, dtype=np.uint8)])
    grid = codes.reshape(-1, per)
    out = xp.zeros(grid.shape[0], dtype=np.uint8)
    for j in range(per):
        out |= grid[:, j] << np.uint8(8 - bits * (j + 1))
    return out


def unpack_codes(packed: Any, bits: int, n: int) -> Any:
    """Inverse of :func:`pack_codes`: return ``n`` uint8 codes of ``bits`` bits each."""
    if bits not in (1, 2, 4, 8):
        raise CodecError(f"code width must be 1, 2, 4 or 8 bits, got {bits}")
    xp = array_module(packed)
    if bits == 8:
        return packed[:n].copy()
    per = 8 // bits
    mask = np.uint8((1 << bits) - 1)
    out = xp.empty((packed.size, per), dtype=np.uint8)
    for j in range(per):
        out[:, j] = (packed >> np.uint8(8 - bits * (j + 1))) & mask
    return out.reshape(-1)[:n]


# ------------------------------------------------------------------- random streams
def name_key(name: str) -> int:
    """Return a stable 32-bit key of a gradient name (CRC-32; identical on every rank)."""
    return zlib.crc32(name.encode("utf-8"))


def rng_for(xp: Any, seed: int, name: str, step: int, rank: int = 0) -> Any:
    """Return a random generator for one encode of one gradient.

    The stream depends only on (seed, name, step, rank), never on process state, so ranks
    that pass the same arguments draw identical numbers (shared-seed codecs pass rank 0),
    and a checkpoint that stores ``step`` resumes the same stream.
    """
    key = [int(seed) & 0xFFFFFFFF, name_key(name), int(step) & 0xFFFFFFFF, int(rank)]
    if xp is np:
        return np.random.default_rng(key)
    return xp.random.default_rng(int(np.random.SeedSequence(key).generate_state(1)[0]))


# ------------------------------------------------------------------------- sparsity
def sampled_threshold(absx: Any, k: int, sample_size: int, rng: Any) -> float:
    """Estimate the magnitude above which about ``k`` of ``absx``'s elements lie.

    Draws ``sample_size`` elements uniformly (with replacement) and returns the
    (1 - k/n) quantile of the sample: the sampled-threshold selection of DGC (Lin et al.,
    ICLR 2018, section 3) and GradDrop (Aji & Heafield, EMNLP 2017). It costs a pass over
    the sample only, not a sort of the gradient.

    Args:
        absx: 1-D array of magnitudes (n elements).
        k: elements wanted (1 <= k <= n).
        sample_size: sample size; if ≥ n the exact k-th largest magnitude is returned.
        rng: generator from :func:`rng_for`.
    """
    xp = array_module(absx)
    n = absx.size
    if sample_size >= n:
        return float(xp.partition(absx, n - k)[n - k])
    idx = rng.integers(0, n, size=sample_size)
    sample = absx[idx]
    ks = max(1, int(round(k / n * sample_size)))
    return float(xp.partition(sample, sample_size - ks)[sample_size - ks])


def sparsify(flat: Any, indices: Any) -> Tuple[Any, Any]:
    """Return (int32 indices, values) of ``flat`` at ``indices`` (int32 if n < 2**31)."""
    idx_dtype = np.int32 if flat.size < 2**31 else np.int64
    indices = indices.astype(idx_dtype, copy=False)
    return indices, flat[indices]


def check_sparse(indices: Any, values: Any, n: int) -> None:
    """Check a sparse (indices, values) payload of ``n`` elements.

    Raises:
        PayloadError: the two differ in length, or an index is outside [0, n) (a
            corrupted payload).
    """
    from hipress.errors import PayloadError

    if indices.size != values.size:
        raise PayloadError(
            f"sparse payload holds {indices.size} indices but {values.size} values: corrupted"
        )
    if indices.size and (int(indices.min()) < 0 or int(indices.max()) >= n):
        raise PayloadError(f"sparse payload holds an index outside [0, {n}): corrupted")


def desparsify(indices: Any, values: Any, n: int, dtype: Any) -> Any:
    """Scatter ``values`` at ``indices`` into a zero array of ``n`` elements of ``dtype``.

    Raises:
        PayloadError: as :func:`check_sparse`.
    """
    xp = array_module(values)
    check_sparse(indices, values, n)
    out = xp.zeros(n, dtype=dtype)
    out[indices] = values.astype(dtype, copy=False)
    return out
