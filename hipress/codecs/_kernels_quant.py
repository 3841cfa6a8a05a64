"""Shared kernels of the quantization codecs: random stream, lane sums, Numba fast paths.

Two halves live here:

1. **References** (always available; NumPy or CuPy, picked from the input): the
   counter-based uniform stream (:func:`uniform_u24`), the 16-lane float64 sums
   (:func:`lane_sums`), lookup-table decoders. They are the definitions the fast paths are
   tested against.
2. **Numba kernels** (CPU only, optional): fused single-pass encoders and decoders of
   onebit (and the sign codecs), TBQ and TernGrad, and QSGD's level draw.
   :func:`fast_kernels` compiles them on first use and returns None when Numba cannot be
   imported, so the codecs fall back to the references. They run serially
   (``parallel=False``): with two shared cores ``prange`` measured slower or no faster,
   and ``nogil=True`` lets the engine's own compute threads run them concurrently.

The random stream (TernGrad, QSGD):
    Per encode, one 64-bit key ``k`` is drawn from ``ops.rng_for(numpy, seed, name, step,
    rank)`` (:func:`stream_key`). Element pair ``j`` (elements ``2j`` and ``2j + 1``) gets one
    SplitMix64 output (Steele, Lea, Flood, OOPSLA 2014; all arithmetic mod 2**64)::

        z = k + (j + 1) * 0x9E3779B97F4A7C15
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
        z = (z ^ (z >> 27)) * 0x94D049BB133111EB
        z = z ^ (z >> 31)
        u[2j] = z >> 40                 # 24-bit uniform integers in [0, 2**24)
        u[2j + 1] = (z >> 8) & 0xFFFFFF

    A counter-based stream (like Philox in cuRAND / JAX) rather than a sequential
    generator: each element's number depends only on (k, i), so the Numba kernel, the
    NumPy reference and a CuPy kernel draw the *same* numbers in any order, with one hash
    per two elements (NumPy's PCG64 float generation alone runs at ~1.7 GB/s here).

The lane sums (onebit):
    Element ``i`` is added to lane ``i % 16``, each lane sequentially in float64 from
    ``+0.0`` in increasing ``i``; the 16 lanes are then added left to right. This order is
    fixed so the vectorizable Numba loop (16 independent accumulators) and the NumPy
    reference (``sum(axis=0)`` over a (rows, 16) array, which NumPy performs row by row)
    produce bit-identical scales.
"""

from __future__ import annotations

import logging
import threading
import types
from typing import Any, Optional, Tuple

import numpy as np

from hipress.backend import array_module
from hipress.codecs import ops

logger = logging.getLogger(__name__)

#: Number of float64 accumulators (lanes) of :func:`lane_sums`.
LANES = 16
TWO24 = float(1 << 24)


# ----------------------------------------------------------------------- references
_GOLDEN = 0x9E3779B97F4A7C15
_SM1 = 0xBF58476D1CE4E5B9
_SM2 = 0x94D049BB133111EB
_LOW24 = 0xFFFFFF


def stream_key(seed: int, name: str, step: int, rank: int) -> int:
    """Return the 64-bit key of one encode's random stream.

    Drawn on the host from ``ops.rng_for(numpy, seed, name, step, rank)`` so NumPy, CuPy
    and Numba paths use the identical key.
    """
    rng = ops.rng_for(np, seed, name, step, rank)
    return int(rng.integers(0, 1 << 64, dtype=np.uint64))


def splitmix64(xp: Any, key: int, j: Any) -> Any:
    """Return SplitMix64 outputs for counters ``j`` (uint64 array) under ``key``."""
    u64 = np.uint64
    z = u64(key) + (j + u64(1)) * u64(_GOLDEN)
    z = (z ^ (z >> u64(30))) * u64(_SM1)
    z = (z ^ (z >> u64(27))) * u64(_SM2)
    return z ^ (z >> u64(31))


def uniform_u24(xp: Any, n: int, key: int) -> Any:
    """Return the 24-bit uniform integers of elements 0..n-1 of the keyed stream.

    Args:
        xp: ``numpy`` or ``cupy``.
        n: number of elements.
        key: the 64-bit key from :func:`stream_key`.

    Returns:
        uint64 array of shape (n,), values in [0, 2**24).
    """
    pairs = (n + 1) // 2
    z = splitmix64(xp, key, xp.arange(pairs, dtype=np.uint64))
    u = xp.empty(2 * pairs, dtype=np.uint64)
    u[0::2] = z >> np.uint64(40)
    u[1::2] = (z >> np.uint64(8)) & np.uint64(_LOW24)
    return u[:n]


def bernoulli_keep(xp: Any, absx: Any, scale: float, u24: Any) -> Any:
    """Return the Bernoulli(|x| / scale) draws: ``u24 * scale < |x| * 2**24``.

    Both products are exact in float64 (24-bit integer times a float32 scale; a power-of-two
    scaling), so every implementation decides every element identically, and
    ``P(keep) = ceil(|x| * 2**24 / scale) / 2**24`` (|x| / scale to within 2**-24).

    Args:
        xp: ``numpy`` or ``cupy``.
        absx: |x| as a float32 or float64 array.
        scale: the float32 scale (>= max|x|, > 0).
        u24: the stream's uniforms (integers < 2**24), same shape as ``absx``.

    Returns:
        bool array.
    """
    return u24.astype(np.float64) * float(scale) < absx.astype(np.float64) * TWO24


def lane_sums(values: Any) -> Any:
    """Return the 16 float64 lane sums of a 1-D array (lane j holds elements i % 16 == j).

    Each lane is summed sequentially in increasing i (NumPy reduces axis 0 of a C-ordered
    (rows, 16) array row by row; CuPy sums in another order, so GPU scales may differ from
    the CPU's in the last bit); the zero padding of the last row changes nothing because
    a lane sum starting from +0.0 is never -0.0.
    """
    xp = array_module(values)
    n = values.size
    rows = -(-n // LANES)
    padded = xp.zeros(rows * LANES, dtype=np.float64)
    padded[:n] = values
    return padded.reshape(rows, LANES).sum(axis=0)


def host_floats(a: Any) -> list:
    """Return a small NumPy or CuPy array's elements as Python floats (copied to host)."""
    return [float(v) for v in (a.get() if hasattr(a, "get") else np.asarray(a)).tolist()]


def combine_lanes(lanes: Any) -> float:
    """Add 16 lane sums left to right in float64 (the fixed final order)."""
    total = 0.0
    for v in host_floats(lanes):
        total += v
    return total


def code_table_2bit(values: Any, dtype: Any, xp: Any) -> Any:
    """Return the (256, 4) lookup table mapping a byte of four 2-bit codes to values.

    Args:
        values: the 4 values of codes 0..3 (code 3 is never produced; decodes to ``values[3]``).
        dtype: output dtype.
        xp: ``numpy`` or ``cupy``.
    """
    codes = ops.unpack_codes(np.arange(256, dtype=np.uint8), 2, 1024).reshape(256, 4)
    table = np.asarray(values, dtype=np.float64).astype(dtype)[codes]
    return table if xp is np else xp.asarray(table)


def decode_2bit(packed: Any, n: int, values: Any, dtype: Any) -> Any:
    """Decode ``n`` 2-bit codes packed by :func:`ops.pack_codes` into ``values[code]``.

    One lookup of a (256, 4) table per byte (about 4x faster than unpacking then indexing).
    """
    xp = array_module(packed)
    table = code_table_2bit(values, dtype, xp)
    return table[packed].reshape(-1)[:n]


def decode_1bit(packed: Any, n: int, zero_value: Any, one_value: Any, dtype: Any) -> Any:
    """Decode ``n`` bits packed by :func:`ops.pack_bits` (0 -> ``zero_value``, 1 -> ``one_value``).

    One lookup of a (256, 8) table per byte.
    """
    xp = array_module(packed)
    bits = np.unpackbits(np.arange(256, dtype=np.uint8)).reshape(256, 8).astype(bool)
    table = np.where(bits, np.asarray(one_value, dtype), np.asarray(zero_value, dtype))
    table = table.astype(dtype)
    if xp is not np:
        table = xp.asarray(table)
    return table[packed].reshape(-1)[:n]


#: Largest finite float32.
F32_MAX = float(np.finfo(np.float32).max)


def round_up_float32(value: float) -> np.float32:
    """Return the smallest float32 >= ``value`` (a scale that bounds every |x|).

    Values above float32's range give +inf (NaN stays NaN), without a warning.
    """
    value = float(value)
    if value > F32_MAX:
        return np.float32(np.inf)
    if value < -F32_MAX:
        return np.float32(-F32_MAX) if value != -np.inf else np.float32(-np.inf)
    f = np.float32(value)
    if float(f) < value:
        f = np.nextafter(f, np.float32(np.inf))
    return f


def round_down_float32(value: float) -> np.float32:
    """Return the largest float32 <= ``value`` (-inf below float32's range)."""
    return -round_up_float32(-float(value))


# ----------------------------------------------------------------------- numba kernels
_FAST: Optional[types.SimpleNamespace] = None
_FAST_TRIED = False
_FAST_LOCK = threading.Lock()


def fast_kernels() -> Optional[types.SimpleNamespace]:
    """Return the compiled Numba kernels, or None when Numba is not importable.

    Numba is imported on first call (it costs about half a second), never at module import.
    Kernels compile per input dtype on first use and are cached on disk (``cache=True``).
    """
    global _FAST, _FAST_TRIED
    if _FAST_TRIED:
        return _FAST
    with _FAST_LOCK:
        if not _FAST_TRIED:
            try:
                _FAST = _build_kernels()
            except ImportError as exc:  # pragma: no cover - numba is a dependency
                logger.info("numba unavailable (%s); quantization codecs use NumPy", exc)
                _FAST = None
            _FAST_TRIED = True
    return _FAST


def fast_input(x: Any) -> Tuple[Optional[types.SimpleNamespace], Any]:
    """Return (kernels, array for them) for a NumPy gradient, or (None, x).

    float32 and float64 arrays go to the kernels as they are; float16 and bfloat16 are
    upcast to float32 first (exact, and what the references compute in anyway). CuPy
    arrays, or a missing Numba, give (None, x): use the reference.
    """
    if type(x) is not np.ndarray:
        return None, x
    kernels = fast_kernels()
    if kernels is None:
        return None, x
    if x.dtype in (np.float32, np.float64):
        return kernels, x
    return kernels, x.astype(np.float32)


def fast_output(sections: Any) -> Optional[types.SimpleNamespace]:
    """Return the kernels if a decode from these (NumPy) sections can use them, else None."""
    if type(sections) is not np.ndarray:
        return None
    return fast_kernels()


def work_dtype(dtype: Any) -> np.dtype:
    """Return the dtype a Numba decode writes for ``dtype`` (float32 for 16-bit floats)."""
    dt = np.dtype(dtype)
    return dt if dt in (np.float32, np.float64) else np.dtype(np.float32)


def _pinned(decorator: Any) -> Any:
    """Wrap a ``numba.njit(...)`` decorator so its dispatchers get a reproducible UUID.

    Numba keys a cached kernel on its closure's pickled contents, and a dispatcher pickles
    with a UUID drawn at random per process. Every kernel built here closes over other
    dispatchers (the inline helpers), so without this each process missed the disk cache,
    compiled every kernel again on its first call (seconds, on the engine thread at a
    job's first step) and added files to ``__pycache__``. The UUID is derived from the
    function's qualified name and its closure's values, which tell apart the variants a
    factory builds. A Numba without ``_set_uuid`` keeps its random UUIDs.
    """
    def wrap(fn: Any) -> Any:
        disp = decorator(fn)
        cells = [c.cell_contents for c in fn.__closure__ or ()]
        tag = ",".join(str(getattr(v, "_uuid", None) or (
            repr(v) if isinstance(v, (bool, int, float, str, np.generic, type))
            else type(v).__name__)) for v in cells)
        try:
            disp._set_uuid(f"{__name__}:{fn.__qualname__}({tag})")
        except AttributeError:  # pragma: no cover - a Numba without the private API
            pass
        return disp
    return wrap


def _build_kernels() -> types.SimpleNamespace:
    import numba

    njit = _pinned(numba.njit(cache=True, nogil=True, boundscheck=False))
    inline = _pinned(numba.njit(inline="always", nogil=True))
    u64, u32 = np.uint64, np.uint32
    golden, sm1, sm2, low24 = u64(_GOLDEN), u64(_SM1), u64(_SM2), u64(_LOW24)
    sh8, sh27, sh30, sh31, sh40 = u64(8), u64(27), u64(30), u64(31), u64(40)
    two24 = TWO24

    @inline
    def _splitmix(key, j):
        z = key + (u64(j) + u64(1)) * golden
        z = (z ^ (z >> sh30)) * sm1
        z = (z ^ (z >> sh27)) * sm2
        return z ^ (z >> sh31)

    @inline
    def _u24(key, i):
        """Uniform of element i: one SplitMix64 output serves elements 2j and 2j + 1."""
        z = _splitmix(key, i >> 1)
        return np.float64(z >> sh40) if (i & 1) == 0 else np.float64((z >> sh8) & low24)

    # --------------------------------------------------------------- onebit / sign
    @inline
    def _load_plain(x, e, i):
        return np.float64(x[i])

    @inline
    def _load_compensated(x, e, i):
        return np.float64(e.dtype.type(x[i]) + e[i])

    @inline
    def _sign_lane(v, j, acc, cnt):
        """Add ``v`` to lane ``j``'s positive or negative sum; return its sign bit."""
        ng = v < 0.0
        acc[0, j] += 0.0 if ng else v
        acc[1, j] += v if ng else 0.0
        cnt[j] += np.int64(ng)
        return np.int64(ng) << (15 - j)

    def _sign_encoder(load):
        @njit
        def encode(x, e, bits):
            n = x.size
            acc = np.zeros((2, 16), np.float64)
            cnt = np.zeros(16, np.int64)
            nblk = n // 16
            for i in range(nblk):
                k = 16 * i
                b = 0
                for j in range(16):
                    b |= _sign_lane(load(x, e, k + j), j, acc, cnt)
                bits[2 * i] = b >> 8
                bits[2 * i + 1] = b & 255
            k = 16 * nblk
            b = 0
            for j in range(n - k):
                b |= _sign_lane(load(x, e, k + j), j, acc, cnt)
            if n > k:
                bits[2 * nblk] = b >> 8
                if n - k > 8:
                    bits[2 * nblk + 1] = b & 255
            return acc, cnt.sum()
        return encode

    _encode_plain = _sign_encoder(_load_plain)

    def onebit_encode(x, bits):
        """Pack sign bits (1 = negative); return (lane sums (2, 16), negatives count).

        Row 0 of the sums holds the non-negative elements, row 1 the negative ones, lane
        j the elements with i % 16 == j, each added in increasing i from +0.0.
        """
        return _encode_plain(x, x, bits)

    #: :func:`onebit_encode` of c = x + e (rounded to e's dtype), e left unchanged: the
    #: first pass of error-feedback onebit; the compensated gradient is never stored,
    #: :func:`onebit_residual` recomputes it when writing the new residual.
    onebit_encode_ef = _sign_encoder(_load_compensated)

    @njit
    def onebit_residual(x, e, bits, v0, v1):
        """Write e[i] = (x[i] + e[i]) - (v1 if bit i is set else v0), in e's dtype."""
        n = e.size
        nfull = n // 8
        for i in range(nfull):
            b = bits[i]
            k = 8 * i
            for j in range(8):
                c = e.dtype.type(x[k + j]) + e[k + j]
                e[k + j] = c - (v1 if (b >> (7 - j)) & 1 else v0)
        k = 8 * nfull
        if n > k:
            b = bits[nfull]
            for j in range(n - k):
                c = e.dtype.type(x[k + j]) + e[k + j]
                e[k + j] = c - (v1 if (b >> (7 - j)) & 1 else v0)

    @inline
    def _deferred_lane(xi, c, i, settle, pb, j, v0, v1, acc, cnt):
        """Settle c[i] into the residual e, store c[i] = xi + e; return its sign bit."""
        e = c[i]
        if settle:
            e = e - (v1 if (pb >> (15 - j)) & 1 else v0)
        v = c.dtype.type(xi) + e
        c[i] = v
        return _sign_lane(np.float64(v), j, acc, cnt)

    @njit
    def onebit_encode_ef_deferred(x, c, pbits, v0, v1, settle, bits):
        """One pass of error-feedback onebit that leaves the residual update for later.

        On entry ``c`` holds the previous step's compensated gradient and (``settle``)
        ``pbits``/``v0``/``v1`` its sign bits and values, so the residual is
        e = c - (v1 if bit else v0); without ``settle`` ``c`` holds e itself. Stores the
        new compensated gradient c = x + e (in c's dtype) into ``c``, packs its sign bits
        into ``bits`` and returns the lane sums and negatives count of
        :func:`onebit_encode`. Settling the stored c with the new bits and values later
        gives exactly what :func:`onebit_residual` writes: the same two roundings.
        """
        n = x.size
        acc = np.zeros((2, 16), np.float64)
        cnt = np.zeros(16, np.int64)
        nblk = n // 16
        for i in range(nblk):
            k = 16 * i
            pb = (np.int64(pbits[2 * i]) << 8) | np.int64(pbits[2 * i + 1]) if settle else 0
            b = 0
            for j in range(16):
                b |= _deferred_lane(x[k + j], c, k + j, settle, pb, j, v0, v1, acc, cnt)
            bits[2 * i] = b >> 8
            bits[2 * i + 1] = b & 255
        k = 16 * nblk
        if n > k:
            pb = 0
            if settle:
                pb = np.int64(pbits[2 * nblk]) << 8
                if n - k > 8:
                    pb |= np.int64(pbits[2 * nblk + 1])
            b = 0
            for j in range(n - k):
                b |= _deferred_lane(x[k + j], c, k + j, settle, pb, j, v0, v1, acc, cnt)
            bits[2 * nblk] = b >> 8
            if n - k > 8:
                bits[2 * nblk + 1] = b & 255
        return acc, cnt.sum()

    @inline
    def _word(b, i, full):
        """Bits of elements 16 i .. 16 i + 15 (byte 2 i high), the second byte if ``full``."""
        w = np.int64(b[2 * i]) << 8
        return w | np.int64(b[2 * i + 1]) if full else w

    def _merge_encoder(p, has_x):
        """:func:`onebit_encode_ef_deferred` of x plus ``p`` (1 to 4) decoded payloads.

        ``p`` and ``has_x`` are fixed when the kernel is built, so LLVM drops the unused
        payloads' branches from the element loop. With them as run-time arguments the
        pass over 4 float32 payloads ran at 3.8 GB/s of output on 1 M elements (a 4 MiB
        partition) and 0.97 GB/s on 25 M; specialized, at 5.5 and 4.3-5.8 GB/s (this
        machine, 2026-12-06).
        """

        @inline
        def merged(x, i, sh, w0, w1, w2, w3, a0, c0, a1, c1, a2, c2, a3, c3):
            """x[i] (if ``has_x``) plus the payloads' decoded element, added in order.

            Payload r decodes to ``c_r`` where its bit is set, else ``a_r``. Unrolled by
            hand with the values in scalars: a loop over the payloads inside the element
            loop ran 3-10x slower.
            """
            d = c0 if (w0 >> sh) & 1 else a0
            s = x[i] + d if has_x else d
            if p > 1:
                s = s + (c1 if (w1 >> sh) & 1 else a1)
            if p > 2:
                s = s + (c2 if (w2 >> sh) & 1 else a2)
            if p > 3:
                s = s + (c3 if (w3 >> sh) & 1 else a3)
            return s

        @njit
        def merge_encode(x, b0, b1, b2, b3, vals, c, sbits, v0, v1, settle, bits):
            """Encode (as :func:`onebit_encode_ef_deferred`) the sum of x and the payloads.

            Element i of the sum is ``x[i] + d0 + d1 + ...`` added left to right (without
            ``x`` when not ``has_x``): what decoding the first payload and adding the
            others' decodes one by one computes, continued from a partial sum ``x``.
            ``b0``..``b3`` hold the payloads' sign bits (unused ones may be any of them),
            ``vals`` (4, 2) their [non-negative, negative] values in c's dtype;
            ``c``/``sbits``/``v0``/``v1``/``settle``/``bits`` and the result are those of
            :func:`onebit_encode_ef_deferred`.
            """
            n = c.size
            acc = np.zeros((2, 16), np.float64)
            cnt = np.zeros(16, np.int64)
            a0, c0, a1, c1 = vals[0, 0], vals[0, 1], vals[1, 0], vals[1, 1]
            a2, c2, a3, c3 = vals[2, 0], vals[2, 1], vals[3, 0], vals[3, 1]
            nblk = n // 16
            for i in range(nblk):
                k = 16 * i
                w0 = _word(b0, i, True)
                w1 = _word(b1, i, True) if p > 1 else 0
                w2 = _word(b2, i, True) if p > 2 else 0
                w3 = _word(b3, i, True) if p > 3 else 0
                pb = _word(sbits, i, True) if settle else 0
                b = 0
                for j in range(16):
                    b |= _deferred_lane(
                        merged(x, k + j, 15 - j, w0, w1, w2, w3, a0, c0, a1, c1, a2, c2,
                               a3, c3), c, k + j, settle, pb, j, v0, v1, acc, cnt)
                bits[2 * i] = b >> 8
                bits[2 * i + 1] = b & 255
            k = 16 * nblk
            if n > k:
                full = n - k > 8
                w0 = _word(b0, nblk, full)
                w1 = _word(b1, nblk, full) if p > 1 else 0
                w2 = _word(b2, nblk, full) if p > 2 else 0
                w3 = _word(b3, nblk, full) if p > 3 else 0
                pb = _word(sbits, nblk, full) if settle else 0
                b = 0
                for j in range(n - k):
                    b |= _deferred_lane(
                        merged(x, k + j, 15 - j, w0, w1, w2, w3, a0, c0, a1, c1, a2, c2,
                               a3, c3), c, k + j, settle, pb, j, v0, v1, acc, cnt)
                bits[2 * nblk] = b >> 8
                if full:
                    bits[2 * nblk + 1] = b & 255
            return acc, cnt.sum()

        return merge_encode

    #: (payload count, has_x) -> the kernel of :func:`_merge_encoder`, for the mixes the
    #: codec passes: N <= 4 payloads alone, or a partial sum plus the last 4 (N > 4).
    #: Each compiles on its first call.
    onebit_merge_encoders = {(p, has_x): _merge_encoder(p, has_x)
                             for p, has_x in ((1, False), (2, False), (3, False),
                                              (4, False), (4, True))}

    @inline
    def _assign(out, i, v):
        out[i] = v

    @inline
    def _subtract(out, i, v):
        out[i] -= v

    @inline
    def _add(out, i, v):
        out[i] += v

    def _bit_decoder(store):
        @njit
        def decode(bits, v0, v1, out):
            n = out.size
            nfull = n // 8
            for i in range(nfull):
                b = bits[i]
                k = 8 * i
                for j in range(8):
                    store(out, k + j, v1 if (b >> (7 - j)) & 1 else v0)
            k = 8 * nfull
            if n > k:
                b = bits[nfull]
                for j in range(n - k):
                    store(out, k + j, v1 if (b >> (7 - j)) & 1 else v0)
        return decode

    #: out[i] = v1 if bit i is set else v0 (bits MSB first)
    decode_1bit = _bit_decoder(_assign)
    #: acc[i] += v1 if bit i is set else v0 (bits MSB first)
    decode_1bit_add = _bit_decoder(_add)
    #: c[i] -= v1 if bit i is set else v0: settles a deferred onebit residual
    onebit_settle = _bit_decoder(_subtract)

    # --------------------------------------------------------------- 2-bit codes
    @njit
    def decode_2bit(codes, v1, v2, out):
        """Write out[i] = 0, v1, v2 for 2-bit code 0, 1, 2 (3 decodes to 0)."""
        n = out.size
        zero = out.dtype.type(0)
        nfull = n // 4
        for i in range(nfull):
            b = codes[i]
            k = 4 * i
            for j in range(4):
                c = (b >> (6 - 2 * j)) & 3
                out[k + j] = v1 if c == 1 else (v2 if c == 2 else zero)
        k = 4 * nfull
        if n > k:
            b = codes[nfull]
            for j in range(n - k):
                c = (b >> (6 - 2 * j)) & 3
                out[k + j] = v1 if c == 1 else (v2 if c == 2 else zero)

    @inline
    def _tbq_code(v, tau, ntau):
        return u32(v >= tau) | (u32(v <= ntau) << u32(1))

    @njit
    def tbq_encode(x, tau, codes):
        """Write 2-bit codes (1: x >= tau, 2: x <= -tau, else 0); return False on NaN/Inf.

        ``tau`` has x's dtype. Finiteness is tested as ``v - v == 0`` (NaN for NaN/Inf).
        """
        n = x.size
        ntau = -tau
        ok = True
        nfull = n // 4
        for i in range(nfull):
            k = 4 * i
            v0, v1, v2, v3 = x[k], x[k + 1], x[k + 2], x[k + 3]
            codes[i] = (
                (_tbq_code(v0, tau, ntau) << u32(6))
                | (_tbq_code(v1, tau, ntau) << u32(4))
                | (_tbq_code(v2, tau, ntau) << u32(2))
                | _tbq_code(v3, tau, ntau)
            )
            ok &= (v0 - v0 == 0) & (v1 - v1 == 0) & (v2 - v2 == 0) & (v3 - v3 == 0)
        k = 4 * nfull
        if n > k:
            w = u32(0)
            for j in range(n - k):
                v = x[k + j]
                w |= _tbq_code(v, tau, ntau) << u32(6 - 2 * j)
                ok &= v - v == 0
            codes[nfull] = w
        return ok

    # --------------------------------------------------------------- TernGrad
    @njit
    def absmax_bits(xi, mask):
        """Return max over i of (xi[i] & mask): the bits of max|x| for x viewed as uints.

        For IEEE floats, |x|'s bit pattern (sign cleared) orders like |x|, and NaN/Inf
        patterns exceed every finite one, so one integer max (which vectorizes, unlike a
        float max without fast-math) gives max|x| and flags non-finite values at once.
        """
        m = xi.dtype.type(0)
        for i in range(xi.size):
            a = xi[i] & mask
            m = a if a > m else m
        return m

    @inline
    def _tern_code(v, u, s):
        keep = u * s < abs(v) * two24
        return u32(keep) * (u32(1) + u32(v < 0.0))

    @njit
    def terngrad_encode(x, scale, key, codes):
        """Write 2-bit TernGrad codes: 1 (+s) / 2 (-s) with P = |x| / s, else 0.

        Element i is kept iff ``u24_i * s < |x_i| * 2**24`` in float64 (both sides exact).
        """
        n = x.size
        s = np.float64(scale)
        nfull = n // 4
        for q in range(nfull):
            k = 4 * q
            z0 = _splitmix(key, 2 * q)
            z1 = _splitmix(key, 2 * q + 1)
            c0 = _tern_code(np.float64(x[k]), np.float64(z0 >> sh40), s)
            c1 = _tern_code(np.float64(x[k + 1]), np.float64((z0 >> sh8) & low24), s)
            c2 = _tern_code(np.float64(x[k + 2]), np.float64(z1 >> sh40), s)
            c3 = _tern_code(np.float64(x[k + 3]), np.float64((z1 >> sh8) & low24), s)
            codes[q] = (c0 << u32(6)) | (c1 << u32(4)) | (c2 << u32(2)) | c3
        k = 4 * nfull
        if n > k:
            w = u32(0)
            for j in range(n - k):
                c = _tern_code(np.float64(x[k + j]), _u24(key, k + j), s)
                w |= c << u32(6 - 2 * j)
            codes[nfull] = w

    @njit
    def terngrad_ternary(x, scale, key, out):
        """Write sign(x_i) * Bernoulli(|x_i| / s) in {-1, 0, 1} into int8/int16 ``out``."""
        s = np.float64(scale)
        n = x.size
        for q in range(n // 2):
            z = _splitmix(key, q)
            v0 = np.float64(x[2 * q])
            v1 = np.float64(x[2 * q + 1])
            k0 = np.float64(z >> sh40) * s < abs(v0) * two24
            k1 = np.float64((z >> sh8) & low24) * s < abs(v1) * two24
            out[2 * q] = (1 if v0 > 0.0 else -1) if k0 else 0
            out[2 * q + 1] = (1 if v1 > 0.0 else -1) if k1 else 0
        if n & 1:
            v = np.float64(x[n - 1])
            out[n - 1] = (1 if v > 0.0 else -1) if _u24(key, n - 1) * s < abs(v) * two24 else 0

    # --------------------------------------------------------------- QSGD
    @njit
    def sumsq_lanes(x):
        """Return the 16 float64 lane sums of x**2 (lane j: elements i % 16 == j, in order)."""
        acc = np.zeros(16, np.float64)
        n = x.size
        nblk = n // 16
        for i in range(nblk):
            k = 16 * i
            for j in range(16):
                v = np.float64(x[k + j])
                acc[j] += v * v
        k = 16 * nblk
        for j in range(n - k):
            v = np.float64(x[k + j])
            acc[j] += v * v
        return acc

    @njit
    def qsgd_levels(x, mult, levels, key, out):
        """Write QSGD level indices: floor(r) + [u * 2**-24 < r - floor(r)], r = |x| * mult.

        Clipped to ``levels``; float64 arithmetic, the same operations as the reference.
        """
        top = np.float64(levels)
        for i in range(x.size):
            r = abs(np.float64(x[i])) * mult
            low = np.floor(r)
            up = _u24(key, i) * (1.0 / two24) < r - low
            lev = low + (1.0 if up else 0.0)
            out[i] = np.uint8(lev if lev < top else top)

    return types.SimpleNamespace(
        qsgd_levels=qsgd_levels,
        sumsq_lanes=sumsq_lanes,
        onebit_encode=onebit_encode,
        onebit_encode_ef=onebit_encode_ef,
        onebit_residual=onebit_residual,
        onebit_encode_ef_deferred=onebit_encode_ef_deferred,
        onebit_merge_encoders=onebit_merge_encoders,
        onebit_settle=onebit_settle,
        decode_1bit_add=decode_1bit_add,
        decode_1bit=decode_1bit,
        decode_2bit=decode_2bit,
        tbq_encode=tbq_encode,
        absmax_bits=absmax_bits,
        terngrad_encode=terngrad_encode,
        terngrad_ternary=terngrad_ternary,
    )


_ABS_MASK = {
    np.dtype(np.float32): (np.uint32, 0x7FFFFFFF),
    np.dtype(np.float64): (np.uint64, 0x7FFFFFFFFFFFFFFF),
}


def fast_absmax(kernels: types.SimpleNamespace, x: np.ndarray) -> float:
    """Return max|x| of a float32/float64 NumPy array in one integer pass (NaN/Inf kept)."""
    ut, mask = _ABS_MASK[x.dtype]
    bits = kernels.absmax_bits(x.view(ut), ut(mask))
    return float(np.array([bits], dtype=ut).view(x.dtype)[0])
