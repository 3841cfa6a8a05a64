"""The codec contract, the wire payload and the codec registry.

A codec turns a gradient array into a :class:`Payload` and back. It never communicates:
it declares what the synchronization engine needs to plan (payload size, whether payloads
may be summed without decoding, whether sizes vary across ranks, whether it is random) and
the engine picks the path from those facts, never from the codec's class.

Wire layout of a payload (all integers little-endian)::

    offset  size      field
    0       2         magic b"HP"
    2       1         version (1)
    3       1         flags (0; reserved)
    4       2         codec id (uint16, from the registry)
    6       1         dtype code of the original gradient (hipress.backend.DTYPE_CODES)
    7       1         ndim of the original gradient (0..32)
    8       8*ndim    shape (uint64 each)
    ...     1         number of sections S (0..255)
    ...     9*S       per section: dtype code (uint8), element count (uint64)
    ...     0..7      zero padding to a multiple of 8 bytes
    ...               section data, each padded with zeros to a multiple of 8 bytes

Nothing is pickled; a truncated, corrupted or foreign buffer raises :class:`PayloadError`.
"""

from __future__ import annotations

import abc
import dataclasses
import math
import struct
import threading
import weakref
from typing import Any, Callable, ClassVar, Dict, Generator, List, Optional, Sequence, Tuple, Type

import numpy as np

from hipress.backend import (
    CODE_DTYPES,
    GRADIENT_DTYPES,
    array_module,
    check_gradient_dtype,
    dtype_code,
    store_scaled,
    to_host,
)
from hipress.codecs import ops
from hipress.errors import CodecError, PayloadError

MAGIC = b"HP"
VERSION = 1
MAX_NDIM = 32
_FIXED = struct.Struct("<2sBBHBB")
_SECTION = struct.Struct("<BQ")

#: (dtype, element count) of each section of a payload.
Layout = List[Tuple[np.dtype, int]]
#: A reduction stage of a summable codec: (array to reduce across ranks, "sum" or "max").
Stage = Tuple[Any, str]


def _pad8(n: int) -> int:
    return (n + 7) & ~7


def header_nbytes(ndim: int, nsections: int) -> int:
    """Return the size in bytes of a payload header (padding included)."""
    return _pad8(_FIXED.size + 8 * ndim + 1 + _SECTION.size * nsections)


def layout_nbytes(ndim: int, layout: Sequence[Tuple[Any, int]]) -> int:
    """Return the wire size in bytes of a payload with this section layout."""
    body = sum(_pad8(np.dtype(dt).itemsize * int(count)) for dt, count in layout)
    return header_nbytes(ndim, len(layout)) + body


def check_numel(shape: Sequence[int], numel: Optional[int]) -> None:
    """Check that a payload's declared ``shape`` holds ``numel`` elements (None: any).

    Raises:
        PayloadError: the counts differ; the message names both. Nothing is allocated
            before this check, so a forged header costs nothing.
    """
    if numel is None:
        return
    claimed = math.prod(int(d) for d in shape)
    if claimed != int(numel):
        raise PayloadError(
            f"payload declares {claimed} elements (shape {tuple(int(d) for d in shape)}) but "
            f"the receiver expects {int(numel)}: the sender encoded a gradient of another "
            "size under this name, or the payload is forged or corrupted. Every rank must "
            "submit the same shape for a name"
        )


@dataclasses.dataclass(frozen=True)
class Payload:
    """An encoded gradient: raw typed sections plus what is needed to rebuild the array.

    Attributes:
        codec_id: registry id of the codec that made it.
        dtype: dtype of the original gradient.
        shape: shape of the original gradient.
        sections: 1-D contiguous arrays (NumPy or CuPy), in the codec's documented order.
    """

    codec_id: int
    dtype: np.dtype
    shape: Tuple[int, ...]
    sections: Tuple[Any, ...]

    @property
    def nbytes(self) -> int:
        """Size in bytes of :meth:`to_bytes`'s result."""
        return layout_nbytes(len(self.shape), [(s.dtype, s.size) for s in self.sections])

    @property
    def numel(self) -> int:
        """Number of elements of the original gradient."""
        return math.prod(self.shape)

    def to_bytes(self) -> bytes:
        """Serialize to the documented wire layout (device sections are copied to host)."""
        return self.to_buffer().tobytes()

    def to_buffer(self) -> np.ndarray:
        """Serialize into a new uint8 NumPy array holding the wire layout."""
        out = np.zeros(self.nbytes, dtype=np.uint8)
        head = [_FIXED.pack(MAGIC, VERSION, 0, self.codec_id, dtype_code(self.dtype),
                            len(self.shape))]
        head += [struct.pack("<Q", d) for d in self.shape]
        head.append(struct.pack("<B", len(self.sections)))
        head += [_SECTION.pack(dtype_code(s.dtype), s.size) for s in self.sections]
        raw = b"".join(head)
        out[: len(raw)] = np.frombuffer(raw, dtype=np.uint8)
        pos = header_nbytes(len(self.shape), len(self.sections))
        for s in self.sections:
            n = s.dtype.itemsize * s.size
            out[pos : pos + n] = to_host(s).reshape(-1).view(np.uint8)
            pos += _pad8(n)
        return out

    @classmethod
    def from_bytes(cls, buf: Any, xp: Any = np, numel: Optional[int] = None) -> Payload:
        """Parse a wire buffer (bytes, bytearray, memoryview or uint8 array).

        Args:
            buf: the serialized payload; it is not copied on the CPU (sections are views).
            xp: ``numpy`` (default) or ``cupy``: where the sections should live.
            numel: the number of gradient elements the caller expects the payload to
                carry (the product of the header's shape), or None to accept any. Give it
                for every payload that came from another process: the header's shape is
                otherwise trusted, and a variable-size (sparse) payload of a few bytes
                may declare up to 2**48 elements, which decoding would allocate.

        Raises:
            PayloadError: the buffer is truncated, too long, has a wrong magic, version,
                dtype code or shape, declares sections that do not fit, or declares a
                number of elements other than ``numel`` (checked before any section is
                looked at or copied).
        """
        mv = np.frombuffer(buf, dtype=np.uint8) if not isinstance(buf, np.ndarray) else buf
        if mv.dtype != np.uint8 or mv.ndim != 1:
            raise PayloadError("expect a 1-D uint8 buffer holding a serialized payload")
        n = mv.size
        if n < _FIXED.size:
            raise PayloadError(f"payload truncated: {n} bytes, the fixed header alone is 8")
        magic, version, _flags, codec_id, dcode, ndim = _FIXED.unpack_from(mv, 0)
        if magic != MAGIC:
            raise PayloadError(f"not a HiPress payload: magic {magic!r}, expect {MAGIC!r}")
        if version != VERSION:
            raise PayloadError(
                f"payload version {version} is not supported by this HiPress (expect "
                f"{VERSION}); run the same HiPress version on every rank"
            )
        if dcode not in CODE_DTYPES:
            raise PayloadError(f"payload names unknown dtype code {dcode}")
        if ndim > MAX_NDIM:
            raise PayloadError(f"payload declares ndim {ndim} > {MAX_NDIM}")
        pos = _FIXED.size
        if n < pos + 8 * ndim + 1:
            raise PayloadError("payload truncated inside its shape")
        shape = struct.unpack_from(f"<{ndim}Q", mv, pos)
        pos += 8 * ndim
        if any(d > 2**48 for d in shape) or math.prod(shape) > 2**48:
            raise PayloadError(f"payload declares an impossible shape {shape}")
        check_numel(shape, numel)
        (nsec,) = struct.unpack_from("<B", mv, pos)
        pos += 1
        if n < pos + _SECTION.size * nsec:
            raise PayloadError("payload truncated inside its section table")
        specs = []
        for i in range(nsec):
            scode, count = _SECTION.unpack_from(mv, pos + i * _SECTION.size)
            if scode not in CODE_DTYPES:
                raise PayloadError(f"payload section {i} names unknown dtype code {scode}")
            specs.append((CODE_DTYPES[scode], count))
        pos = header_nbytes(ndim, nsec)
        expected = pos + sum(_pad8(dt.itemsize * c) for dt, c in specs)
        if expected != n:
            raise PayloadError(
                f"payload is {n} bytes but its header declares {expected}: truncated or "
                "corrupted in transit"
            )
        sections = []
        for dt, count in specs:
            nb = dt.itemsize * count
            sec = mv[pos : pos + nb].view(dt)
            sections.append(sec if xp is np else xp.asarray(sec))
            pos += _pad8(nb)
        return cls(codec_id, CODE_DTYPES[dcode], tuple(int(d) for d in shape), tuple(sections))


class Codec(abc.ABC):
    """Base class of gradient compression codecs.

    Subclasses implement :meth:`_encode`, :meth:`_decode` and :meth:`payload_layout`, and
    set the capability flags. :meth:`encode` and :meth:`decode` validate input, handle
    0-element arrays, and check payload identity, so subclasses see only non-empty arrays
    of a gradient dtype and payloads of their own codec.

    Capability flags (class attributes; the engine plans from these):
        summable: payloads of different ranks can be reduced without decoding, through
            :meth:`reduce_stages` (fp16, TernGrad with a shared scale, PowerSGD P/Q,
            random-k with a shared seed).
        variable_size: payload size depends on the data, so it differs across ranks
            (DGC, GradDrop); the engine must exchange sizes (gather path).
        stochastic: encoding draws random numbers, from a generator seeded by ``seed``,
            the gradient name and a per-name step counter (identical across ranks when
            ``seed`` is).
        lossless: decode(encode(x)) == x exactly.
        error_feedback: the codec is biased and should run with residual error feedback
            (the engine's default memory for it is ``"residual"``).
        sparse_payload: payloads are (ascending indices, values) pairs that decode to
            zeros except ``values`` at ``indices`` (top-k, DGC, GradDrop): decoding adds,
            error feedback and the gather path's sum touch only the sent elements
            (:meth:`sparse_entries`).
        mergeable: decode -> sum -> encode of partial sums keeps most of the information,
            so the codec can run under CaSync-PS and CaSync-Ring. False for sparsifiers
            whose merged sum is denser than one payload (top-k, DGC, GradDrop: the engine
            gathers their payloads instead) and for codecs whose payload only makes sense
            through :meth:`reduce_stages` (PowerSGD).
    """

    name: ClassVar[str] = ""
    codec_id: ClassVar[int] = 0
    summable: ClassVar[bool] = False
    variable_size: ClassVar[bool] = False
    stochastic: ClassVar[bool] = False
    lossless: ClassVar[bool] = False
    error_feedback: ClassVar[bool] = False
    mergeable: ClassVar[bool] = True
    sparse_payload: ClassVar[bool] = False
    #: :meth:`reduce_stages` takes ``out=``: an array of ``x``'s shape and dtype it writes
    #: its result into (the engine passes the gradient's output buffer, saving a pass and,
    #: for a fresh result, its page faults); codecs without it are never passed ``out``
    stages_out: ClassVar[bool] = False
    #: memory the engine uses under ``compression.memory: auto`` when error_feedback is set
    default_memory: ClassVar[str] = "residual"
    #: CompLL spec (``hipress/compll/specs/<name>.hpc``) whose generated kernels compute
    #: this codec's payloads bit for bit (checked on the CPU by tests/test_device_kernels.py):
    #: :meth:`encode` and :meth:`decode` of device (CuPy) arrays of :attr:`device_dtypes`
    #: run those kernels instead of this class's NumPy-style code (see :meth:`_device_codec`)
    device_kernels: ClassVar[Optional[str]] = None
    #: gradient dtypes routed to :attr:`device_kernels` (the kernels read float32; half
    #: precision is widened exactly, float64 is not and stays on this class's code)
    device_dtypes: ClassVar[Tuple[str, ...]] = ("float32", "float16", "bfloat16")
    #: parameters that belong to the codec's error-feedback memory, not to its kernels
    device_params_skip: ClassVar[Tuple[str, ...]] = ()

    def bind(self, rank: int, world_size: int) -> None:  # noqa: B027 - optional hook
        """Tell the codec which rank it runs on (the engine calls this once).

        Stochastic codecs that should draw independently on each rank mix ``rank`` into
        their random streams; the default does nothing.
        """

    def memory_params(self) -> Dict[str, Any]:
        """Return parameters for the codec's default error-feedback memory (none by default)."""
        return {}

    # ----------------------------------------------------------------- public API
    def encode(self, x: Any, name: str = "") -> Payload:
        """Encode a gradient.

        Args:
            x: NumPy or CuPy array of float16, bfloat16, float32 or float64, any shape.
            name: the gradient's stable name; it keys random streams and per-gradient state.

        Returns:
            The payload; ``x`` is not modified.

        Raises:
            TypeError: ``x`` is not of a floating gradient dtype.
            NonFiniteGradientError: ``x`` holds NaN/Inf and the codec computes a scale.
        """
        dt = check_gradient_dtype(x.dtype, f"gradient {name!r}" if name else "gradient")
        shape = tuple(int(d) for d in x.shape)
        if x.size == 0:
            return Payload(self.codec_id, dt, shape, ())
        xp = array_module(x)
        flat = xp.ascontiguousarray(x).reshape(-1)
        sections = (self._device_codec(xp, dt) or self)._encode(flat, shape, name)
        return Payload(self.codec_id, dt, shape, tuple(sections))

    def decode(self, payload: Payload, numel: Optional[int] = None) -> Any:
        """Decode a payload of this codec into an array of the original shape and dtype.

        Args:
            payload: a payload of this codec (e.g. from :meth:`Payload.from_bytes`).
            numel: the number of elements the caller expects (the product of
                ``payload.shape``), or None to trust the payload's header. Give it for
                payloads from another process: a variable-size payload of a few bytes may
                declare up to 2**48 elements, which decoding would allocate.

        Returns:
            An array of ``payload.shape`` and ``payload.dtype`` on the sections' device.

        Raises:
            PayloadError: the payload belongs to another codec, declares a number of
                elements other than ``numel`` (checked before anything is allocated), or
                its sections do not match the layout this codec declares for its shape.
        """
        self._check_payload(payload, numel)
        if payload.numel == 0:
            return np.zeros(payload.shape, dtype=payload.dtype)
        fast = self._device_codec(array_module(payload.sections[0]), payload.dtype)
        out = (fast or self)._decode(payload.sections, payload.shape, payload.dtype)
        return out.reshape(payload.shape)

    def _check_payload(self, payload: Payload, numel: Optional[int]) -> None:
        """Run :meth:`decode`'s checks (element count, codec id, dtype, sections).

        Raises:
            PayloadError: as :meth:`decode`.
        """
        check_numel(payload.shape, numel)
        if payload.codec_id != self.codec_id:
            raise PayloadError(
                f"payload was made by codec id {payload.codec_id}, not by {self.name!r} "
                f"(id {self.codec_id}); every rank must use the same codec per gradient"
            )
        if np.dtype(payload.dtype) not in GRADIENT_DTYPES:
            raise PayloadError(
                f"payload declares gradient dtype {np.dtype(payload.dtype)}; expect float16, "
                "bfloat16, float32 or float64: the payload is corrupted or not a gradient"
            )
        if payload.numel == 0:
            if payload.sections:
                raise PayloadError("payload of a 0-element gradient must have no sections")
            return
        self._check_sections(payload)

    def sparse_entries(self, payload: Payload,
                       numel: Optional[int] = None) -> Optional[Tuple[Any, Any]]:
        """Return a sparse payload's (indices, values), checked as :meth:`decode` checks it.

        ``decode(payload)`` is zeros except ``values`` at ``indices``. Callers use this to
        touch only the sent elements (decode-and-add, error feedback, the gather sum).

        Args:
            payload: a payload of this codec.
            numel: as in :meth:`decode`.

        Returns:
            (1-D integer indices, 1-D values of the payload's dtype), both NumPy arrays,
            or None: the codec is not :attr:`sparse_payload`, the payload has no elements,
            or its sections are not NumPy arrays (device payloads decode as usual).

        Raises:
            PayloadError: as :meth:`decode`; also when the two sections differ in length
                or an index lies outside [0, numel).
        """
        if not self.sparse_payload:
            return None
        self._check_payload(payload, numel)
        if payload.numel == 0 or type(payload.sections[0]) is not np.ndarray:
            return None
        idx, values = payload.sections
        ops.check_sparse(idx, values, payload.numel)
        return idx, values

    def _device_codec(self, xp: Any, dtype: Any) -> Optional[Codec]:
        """Return the generated CompLL codec that runs this codec on ``xp``'s device, or None.

        The paper's point: a codec must run as fused device kernels, while this class's
        array code launches a kernel per NumPy operation (measured on an H200: onebit
        encoded at 2.7 GB/s that way, its generated CompLL kernels at 757 GB/s and more).
        So device arrays of a codec with :attr:`device_kernels` are encoded and
        decoded by ``compll.<device_kernels>`` built with this codec's parameters (less
        :attr:`device_params_skip`); it shares this codec's step counters and rank, so
        the random streams and the checkpointed state are this codec's. Payloads keep this
        codec's id. NumPy arrays, other dtypes, and a CompLL spec that fails to load (its
        error logged once) stay on this class's code.
        """
        if (self.device_kernels is None or not _routes_to_device(xp)
                or np.dtype(dtype).name not in self.device_dtypes):
            return None
        fast = _DEVICE_CODECS.get(self)
        if fast is None:
            fast = _make_device_codec(self)
            if fast is None:
                return None
        if hasattr(self, "rank"):
            fast.rank = self.rank  # set by bind(), which may follow the first encode
        return fast

    # ------------------------------------------------- fused kernels (optional)
    def encode_residual(self, x: Any, residual: Any, name: str = "") -> Optional[Payload]:
        """Error-feedback encode in as few passes as possible, or None if not offered.

        Computes exactly what :class:`hipress.memory.ResidualMemory` (``beta = 1``) does
        in three steps — ``c = x + e``; ``p = encode(c)``; ``e = c - decode(p)`` — but
        without materializing ``c`` or the decoded array. Codecs with a fused kernel
        override it for the arrays it supports and return None otherwise (the caller then
        runs the three steps); results must be bit-identical to the three steps.

        Args:
            x: the gradient (contiguous, any float dtype); not modified.
            residual: its residual ``e``, same shape, updated in place on success.
            name: the gradient's name (random streams, error messages).

        Returns:
            The payload of ``encode(x + e)``, or None (nothing was done).

        Raises:
            NonFiniteGradientError: as :meth:`encode`; ``residual`` is left unchanged.
        """
        return None

    def encode_residual_deferred(self, x: Any, state: Any, pending: Any,
                                 name: str = "") -> Optional[Tuple[Payload, Any]]:
        """Error-feedback encode in one pass, the residual update deferred, or None.

        The single-pass form of :meth:`encode_residual`, used by
        :class:`hipress.memory.ResidualMemory` for gradients known to be finite. Instead
        of the residual e, ``state`` may hold the previous step's compensated gradient c
        with ``pending`` (what this method returned then) saying what was sent of it:
        e = c - decode(pending), as :meth:`settle_residual` computes. This call settles
        that, adds ``x`` and stores the new c = x + e in ``state``; the subtraction of
        this step's decoded payload waits for the next call (or a settle). Results are
        bit-identical to :meth:`encode_residual` followed by the same next steps.

        Args:
            x: the gradient (contiguous); not modified.
            state: the stored c (with ``pending``) or e (``pending`` None), same shape;
                overwritten with the new c.
            pending: what the previous call returned with ``state``, or None.
            name: the gradient's name (error messages).

        Returns:
            (payload of encode(x + e), the new pending value), or None (nothing done).

        Raises:
            NonFiniteGradientError: x + e is not finite. ``state`` then holds a partial
                result: the caller must reset it.
        """
        return None

    def merge_encode_residual_deferred(self, payloads: Sequence[Payload], state: Any,
                                       pending: Any, name: str = ""
                                       ) -> Optional[Tuple[Payload, Any]]:
        """:meth:`encode_residual_deferred` of the sum of decoded payloads, or None.

        What an aggregator does with the payloads of one partition: decode the first,
        add the others' decodes in list order, then encode the sum with error feedback.
        Codecs with a fused kernel do it in one pass without the decoded arrays or the
        sum, bit-identical to those steps; the default offers none.

        Args:
            payloads: payloads of this codec, each for ``state.size`` elements.
            state: as :meth:`encode_residual_deferred` (flat, the sum's length).
            pending: as :meth:`encode_residual_deferred`.
            name: the sum's key (error messages).

        Returns:
            (payload of the encoded sum, the new pending value), or None (nothing done).

        Raises:
            NonFiniteGradientError: as :meth:`encode_residual_deferred`.
        """
        return None

    def settle_residual(self, state: Any, pending: Any) -> None:
        """Turn a deferred ``state`` into the residual in place: ``state -= decode(pending)``.

        Args:
            state: what :meth:`encode_residual_deferred` stored.
            pending: what it returned with it.

        Raises:
            NotImplementedError: the codec has no deferred path.
        """
        raise NotImplementedError(f"codec {self.name!r} has no deferred residual update")

    def decode_add(self, payload: Payload, acc: Any) -> None:
        """Add the decoded payload to ``acc`` in place (``acc += decode(payload)``).

        Args:
            payload: a payload of this codec for ``acc.size`` elements.
            acc: 1-D float array (compute dtype), on the payload's device.

        Raises:
            PayloadError: as :meth:`decode`; in particular when the payload declares a
                number of elements other than ``acc.size`` (a payload of one element is
                never broadcast into ``acc``).

        Sparse codecs (:attr:`sparse_payload`) add only the sent elements on the host.
        Codecs with a fused kernel override it to skip the decoded temporary; they must
        check the count the same way (calling this method for what they do not handle).
        """
        sparse = self.sparse_entries(payload, numel=acc.size)
        if sparse is not None and type(acc) is np.ndarray:
            idx, values = sparse  # ascending and distinct: one add per sent element
            acc[idx] += values.astype(acc.dtype, copy=False)
            return
        acc += self.decode(payload, numel=acc.size).reshape(-1).astype(acc.dtype, copy=False)

    def decode_into(self, payload: Payload, out: Any, divisor: int = 1) -> None:
        """Write ``decode(payload) / divisor`` into ``out``, rounded to ``out``'s dtype.

        The same values as :func:`hipress.backend.store_scaled` of the decoded array.
        Codecs with a fused kernel override it to decode straight into ``out``.

        Args:
            payload: a payload of this codec for ``out.size`` elements.
            out: 1-D array of any float dtype, on the payload's device.
            divisor: positive integer the decoded values are divided by (the world size
                for an average).

        Raises:
            PayloadError: as :meth:`decode`; in particular when the payload declares a
                number of elements other than ``out.size``.
        """
        store_scaled(self.decode(payload, numel=out.size), out, divisor)

    def payload_layout(self, shape: Tuple[int, ...], dtype: Any) -> Layout:
        """Return the (dtype, count) of each section for a gradient of ``shape``.

        For variable-size codecs this is the largest payload the codec can produce.
        """
        if math.prod(shape) == 0:
            return []
        return self._layout(tuple(shape), np.dtype(dtype))

    def payload_nbytes(self, shape: Any, dtype: Any = np.float32) -> int:
        """Return the wire size in bytes of the payload for a gradient of ``shape``.

        Args:
            shape: a shape tuple, or an int n meaning the 1-D shape (n,).
            dtype: the gradient dtype.

        Exact for fixed-size codecs; an upper bound when ``variable_size`` is True.
        """
        shape = (int(shape),) if isinstance(shape, (int, np.integer)) else tuple(shape)
        return layout_nbytes(len(shape), self.payload_layout(shape, dtype))

    def compression_ratio(self, shape: Any, dtype: Any = np.float32) -> float:
        """Return original bytes / payload bytes (≥ 1 means the wire gets smaller)."""
        shape = (int(shape),) if isinstance(shape, (int, np.integer)) else tuple(shape)
        raw = math.prod(shape) * np.dtype(dtype).itemsize
        return raw / self.payload_nbytes(shape, dtype)

    def reduce_stages(
        self, x: Any, name: str, world_size: int, prescale: float = 1.0
    ) -> Generator[Stage, Any, Any]:
        """Describe a reduction across ranks that never decodes a payload.

        Only for codecs with ``summable = True``. The generator yields ``(array, op)``;
        the engine reduces ``array`` across all ranks with ``op`` ("sum" or "max"; the
        result is bit-identical on every rank) and sends the result back in. When the
        generator returns, its value is ``(result, feedback)``:

        - ``result``: the estimate of ``sum(prescale * x)`` over ranks, with ``x``'s shape
          and dtype, identical on every rank;
        - ``feedback``: what error feedback should treat as this rank's decoded
          contribution (``memory.update(name, x, feedback)``), or None when the codec is
          unbiased or lossless and needs no error feedback.

        The codec never communicates. ``x`` is 1-D or any shape; it is not modified.
        Codecs with :attr:`stages_out` also take ``out=`` (keyword): a C-contiguous array
        of ``x``'s shape and dtype, possibly ``x``'s own memory, that ``result`` is then
        written into (and returned as), after the last stage's sum came back and ``x``
        is no longer read.

        Raises:
            CodecError: the codec is not summable.
        """
        raise CodecError(f"codec {self.name!r} is not summable; use encode/decode")

    def state_dict(self) -> Dict[str, Any]:
        """Return the codec's internal state (NumPy arrays and plain values), for checkpoints."""
        return {}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore state returned by :meth:`state_dict`."""
        if state:
            raise CodecError(f"codec {self.name!r} has no state but got keys {sorted(state)}")

    def __repr__(self) -> str:
        params = ", ".join(f"{k}={v!r}" for k, v in self.params().items())
        return f"{type(self).__name__}({params})"

    def params(self) -> Dict[str, Any]:
        """Return the constructor parameters (for logs, plans and reprs)."""
        return {}

    # ----------------------------------------------------------- subclass hooks
    @abc.abstractmethod
    def _encode(self, flat: Any, shape: Tuple[int, ...], name: str) -> Sequence[Any]:
        """Encode a non-empty contiguous 1-D array; return the payload sections."""

    @abc.abstractmethod
    def _decode(self, sections: Sequence[Any], shape: Tuple[int, ...], dtype: np.dtype) -> Any:
        """Decode sections into a 1-D array of ``dtype`` with prod(shape) elements."""

    @abc.abstractmethod
    def _layout(self, shape: Tuple[int, ...], dtype: np.dtype) -> Layout:
        """Return the section layout for a non-empty gradient of ``shape``."""

    def _check_sections(self, payload: Payload) -> None:
        """Check the payload's sections against the declared layout (dtypes and counts)."""
        layout = self._layout(payload.shape, payload.dtype)
        got = [(np.dtype(s.dtype), int(s.size)) for s in payload.sections]
        ok = len(got) == len(layout) and all(
            gd == ld and (gc <= lc if self.variable_size else gc == lc)
            for (gd, gc), (ld, lc) in zip(got, layout)
        )
        if not ok:
            raise PayloadError(
                f"payload sections {got} do not match codec {self.name!r}'s layout {layout} "
                f"for shape {payload.shape}"
            )


# --------------------------------------------------------------------------- registry
_REGISTRY: Dict[str, Type[Codec]] = {}
_BY_ID: Dict[int, Type[Codec]] = {}


def _routes_to_device(xp: Any) -> bool:
    """Whether arrays of module ``xp`` run a codec's :attr:`Codec.device_kernels` (CuPy)."""
    return xp is not np


#: generated codec standing in for each codec instance on the device (off the instance's
#: ``__dict__``, so pickled codecs and checkpoints do not carry it)
_DEVICE_CODECS: weakref.WeakKeyDictionary[Codec, Codec] = weakref.WeakKeyDictionary()
_DEVICE_LOCK = threading.Lock()
_DEVICE_FAILED: Dict[str, str] = {}


def _make_device_codec(codec: Codec) -> Optional[Codec]:
    """Build (once per codec instance) the CompLL codec of :meth:`Codec._device_codec`."""
    import logging

    spec = codec.device_kernels
    with _DEVICE_LOCK:
        fast = _DEVICE_CODECS.get(codec)
        if fast is not None or spec in _DEVICE_FAILED:
            return fast
        params = {k: v for k, v in codec.params().items() if k not in codec.device_params_skip}
        try:  # by name: the registry's loaders build it (this package never imports CompLL)
            fast = get_codec(f"compll.{spec}", **params)
        except Exception as exc:  # noqa: BLE001 - any failure keeps the hand-written code
            _DEVICE_FAILED[spec] = str(exc)
            logging.getLogger(__name__).warning(
                "codec %r runs its array code on the device: its CompLL kernels "
                "(compll.%s) did not load: %s", codec.name, spec, exc)
            return None
        if hasattr(codec, "_next_step"):  # one set of step counters: the codec's
            fast._next_step = _steps_of(weakref.ref(codec))
        _DEVICE_CODECS[codec] = fast
        return fast


def _steps_of(ref: Any) -> Callable[[str], int]:
    """Return ``name -> step`` drawing on the codec behind the weak reference ``ref``.

    Weak, so the generated codec (a value of the weak-keyed :data:`_DEVICE_CODECS`) does
    not keep its codec alive.
    """
    def next_step(name: str) -> int:
        codec = ref()
        if codec is None:
            raise CodecError("the codec of these device kernels was garbage-collected")
        return codec._next_step(name)
    return next_step


def register_codec(name: str, codec_id: int) -> Callable[[Type[Codec]], Type[Codec]]:
    """Register a codec class under ``name`` with a wire id, as a class decorator.

    Ids are part of the wire format: keep them stable across releases.

    Raises:
        CodecError: the name or id is taken by another class.
    """

    def deco(cls: Type[Codec]) -> Type[Codec]:
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            raise CodecError(f"codec name {name!r} is already registered by {_REGISTRY[name]}")
        if codec_id in _BY_ID and _BY_ID[codec_id] is not cls:
            raise CodecError(f"codec id {codec_id} is already registered by {_BY_ID[codec_id]}")
        cls.name = name
        cls.codec_id = codec_id
        _REGISTRY[name] = cls
        _BY_ID[codec_id] = cls
        return cls

    return deco


@dataclasses.dataclass(frozen=True, eq=False)
class CodecLoader:
    """Registers codecs on demand, for names the built-in modules do not define.

    The registry never imports the packages that generate codecs (CompLL builds on the
    registry, not the other way round); they install a loader instead, and a package can
    install a stand-in that only imports the real one (see ``hipress/__init__.py``).

    Attributes:
        prefix: the names it provides start with this (``"compll."``).
        load: ``load(name)`` registers codec ``name`` if it can, else does nothing; it may
            also install another loader for ``prefix``, which is then asked in turn.
        load_all: registers every codec it provides (for :func:`codec_names`).
    """

    prefix: str
    load: Callable[[str], None]
    load_all: Callable[[], None]


_LOADERS: Dict[str, CodecLoader] = {}


def register_codec_loader(prefix: str, load: Callable[[str], None],
                          load_all: Callable[[], None]) -> CodecLoader:
    """Install the loader of codec names starting with ``prefix`` (replacing any earlier one).

    Returns:
        The installed :class:`CodecLoader`.
    """
    loader = CodecLoader(prefix, load, load_all)
    _LOADERS[prefix] = loader
    return loader


def _run_loaders(name: Optional[str]) -> None:
    """Ask the loaders for ``name`` (every loader if None); loaders they install are asked too."""
    asked: set = set()
    while True:
        todo = [ld for ld in list(_LOADERS.values()) if id(ld) not in asked
                and (name is None or name.startswith(ld.prefix))]
        if not todo:
            return
        for ld in todo:
            asked.add(id(ld))
            if name is None:
                ld.load_all()
            elif name not in _REGISTRY:
                ld.load(name)


def registered_codec(name: str) -> Optional[Type[Codec]]:
    """Return the class registered under ``name`` now, or None (loads nothing)."""
    return _REGISTRY.get(name)


def codec_names() -> List[str]:
    """Return the registered codec names, sorted.

    Every :class:`CodecLoader` first registers what it provides, so the CompLL-generated
    ``compll.*`` names are listed too.
    """
    _run_loaders(None)
    return sorted(_REGISTRY)


def codec_class(name: str) -> Type[Codec]:
    """Return the codec class registered under ``name``.

    A name not registered yet goes to the :class:`CodecLoader` of its prefix, if any
    (``compll.onebit`` to CompLL's).

    Raises:
        CodecError: no such codec; the message lists the valid names.
    """
    if name not in _REGISTRY:
        _run_loaders(name)
    try:
        return _REGISTRY[name]
    except KeyError:
        raise CodecError(
            f"unknown codec {name!r}; valid codecs: {', '.join(codec_names())}"
        ) from None


def get_codec(name: Any, **params: Any) -> Codec:
    """Build a codec by name, or return ``name`` itself if it is already a Codec.

    Args:
        name: registered name (see :func:`codec_names`) or a :class:`Codec` instance.
        **params: constructor parameters of that codec.

    Raises:
        CodecError: unknown name (the valid names are listed) or bad parameters.
    """
    if isinstance(name, Codec):
        if params:
            raise CodecError("parameters cannot be given together with a codec instance")
        return name
    cls = codec_class(name)
    try:
        return cls(**params)
    except TypeError as exc:
        raise CodecError(f"bad parameters for codec {name!r}: {exc}") from None
