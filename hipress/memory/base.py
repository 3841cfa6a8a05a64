"""Memory contract, the residual memory and the memory registry.

The step with error feedback, for a gradient ``g`` named ``name`` (Seide et al. 2014;
Karimireddy et al., "Error Feedback Fixes SignSGD", ICML 2019)::

    c = memory.compensate(name, g)        # 1. c = g + e   (e starts at 0; float32)
    p = codec.encode(c, name)             # 2. compress the compensated gradient
    memory.update(name, c, codec.decode(p))   # 3. e = c - decode(p)

so over T steps sum(decoded) = sum(g) - e_T: the running sum of what is sent tracks the
running sum of the gradients, off by one bounded residual.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Dict, List, Sequence, Tuple, Type

import numpy as np

from hipress.backend import array_module, compute_dtype, to_host
from hipress.errors import CodecError, NonFiniteGradientError


class Memory:
    """Base memory: per-gradient float32 state, checkpointable; subclasses add the maths."""

    name = ""

    def __init__(self) -> None:
        self._state: Dict[str, Any] = {}

    def compensate(self, name: str, grad: Any) -> Any:
        """Return the array to encode for ``grad`` (never modifies ``grad``)."""
        return grad

    def update(self, name: str, compensated: Any, decoded: Any) -> None:
        """Record what the codec left out of ``compensated``."""

    def encode(self, codec: Any, name: str, grad: Any, finite: bool = False) -> Tuple[Any, Any]:
        """Run the error-feedback step of the module docstring for one gradient.

        Args:
            codec: the :class:`hipress.codecs.Codec`.
            name: the key of the gradient's state.
            grad: the gradient (not modified).
            finite: the caller has checked that ``grad`` holds no inf/NaN (the engine
                does, for every gradient it compresses); memories may then take faster
                paths that cannot leave the state unchanged on an error.

        Returns:
            (payload, decoded): the payload of the compensated gradient, and its decoded
            array when the step computed one anyway (None otherwise; decoding the payload
            gives the same values).

        Raises:
            NonFiniteGradientError: from the codec; the state is then left unchanged
                (with ``finite``, a memory may reset it instead, and says so).
        """
        c = self.compensate(name, grad)
        payload = codec.encode(c, name=name)
        sparse = codec.sparse_entries(payload)
        if sparse is not None:  # decoded = zeros but at the sent indices: never built
            self.update_sparse(name, c, *sparse)
            return payload, None
        decoded = codec.decode(payload)
        self.update(name, c, decoded)
        return payload, decoded

    def update_sparse(self, name: str, compensated: Any, indices: Any, values: Any) -> None:
        """As :meth:`update` for a decoded array of zeros but ``values`` at ``indices``.

        Memories override it to touch only the sent elements; this default builds the
        dense decoded array and calls :meth:`update`.

        Args:
            name: the gradient's name.
            compensated: what :meth:`compensate` returned (NumPy).
            indices: ascending, distinct 1-D integer indices into the flattened gradient.
            values: 1-D values sent at them (the payload's dtype).
        """
        dense = np.zeros(compensated.size, dtype=values.dtype)
        dense[indices] = values
        self.update(name, compensated, dense)

    def reset(self, name: str = "") -> None:
        """Forget the state of one gradient, or of all when ``name`` is empty."""
        if name:
            self._state.pop(name, None)
        else:
            self._state.clear()

    def reset_prefix(self, prefix: str) -> int:
        """Forget the state of every gradient whose name starts with ``prefix``; count them."""
        keys = [k for k in self._state if k.startswith(prefix)]
        for k in keys:
            del self._state[k]
        return len(keys)

    def put(self, name: str, value: Any) -> None:
        """Set the state of ``name`` (a residual: an array shaped like what is encoded)."""
        self._state[name] = value

    def keys(self) -> List[str]:
        """Return the names that have state."""
        return list(self._state)

    def __contains__(self, name: str) -> bool:
        return name in self._state

    def get(self, name: str) -> Any:
        """Return the stored state array of ``name`` (None if it has none yet)."""
        return self._state.get(name)

    def state_dict(self) -> Dict[str, np.ndarray]:
        """Return {gradient name: NumPy copy of its state} (float32; float64 for float64).

        Safe while other threads add gradients (the engine's compute threads do, on the
        first encode of a name): the table is copied in one step (atomic under the GIL)
        before the arrays are. An array being updated at that moment may hold either
        step's values; checkpoint between steps for a consistent state.
        """
        return {k: np.array(to_host(v), copy=True) for k, v in dict(self._state).items()}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Replace the state with ``state`` (arrays are copied, kept in float32 or float64)."""
        new: Dict[str, Any] = {}
        for k, v in state.items():
            a = np.array(v, copy=True)
            if a.dtype.kind != "f":
                raise CodecError(f"memory state of {k!r} has dtype {a.dtype}; expect float")
            new[k] = a
        self._state = new  # all or nothing: a bad entry leaves the old state in place

    def __getstate__(self) -> Dict[str, Any]:
        return {"state": self.state_dict(), "params": self.params()}

    def __setstate__(self, d: Dict[str, Any]) -> None:
        self.__init__(**d["params"])
        self.load_state_dict(d["state"])

    def params(self) -> Dict[str, Any]:
        """Return the constructor parameters."""
        return {}

    def _buffer(self, name: str, like: Any) -> Any:
        """Return the state of ``name``, created as zeros shaped like ``like`` if missing.

        State from a checkpoint (NumPy) moves to ``like``'s device on first use.
        """
        return self._stored(name, tuple(like.shape), like.dtype, array_module(like))

    def _stored(self, name: str, shape: Tuple[int, ...], dtype: Any, xp: Any) -> Any:
        """:meth:`_buffer` for a gradient of ``shape`` and ``dtype`` in module ``xp``."""
        buf = self._state.get(name)
        if buf is None:
            buf = xp.zeros(shape, dtype=compute_dtype(dtype))
            self._state[name] = buf
        elif array_module(buf) is not xp:
            buf = xp.asarray(buf)
            self._state[name] = buf
        if tuple(buf.shape) != shape:
            raise CodecError(
                f"gradient {name!r} has shape {shape} but its stored residual "
                f"has {tuple(buf.shape)}: two tensors share a name, or a checkpoint from "
                "another model was loaded"
            )
        return buf


def adopt(compensated: Any, state: Any) -> Any:
    """Return ``compensated`` to become the new state array in place of ``state``.

    A fresh NumPy array of the state's dtype and shape (what ``compensate`` returns) is
    kept as it is, saving a copy; anything else is copied into a new array of the state's
    dtype and shape.
    """
    if (type(compensated) is np.ndarray and compensated.base is None
            and compensated.dtype == state.dtype and compensated.shape == state.shape):
        return compensated
    return np.array(compensated, dtype=state.dtype).reshape(state.shape)


_REGISTRY: Dict[str, Type[Memory]] = {}


def register_memory(name: str) -> Callable[[Type[Memory]], Type[Memory]]:
    """Register a memory class under ``name`` (class decorator)."""

    def deco(cls: Type[Memory]) -> Type[Memory]:
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            raise CodecError(f"memory name {name!r} is already registered")
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return deco


def memory_names() -> List[str]:
    """Return the registered memory names, sorted."""
    return sorted(_REGISTRY)


def get_memory(name: Any, **params: Any) -> Memory:
    """Build a memory by name (``"none"``, ``"residual"``, ...) or pass an instance through.

    Raises:
        CodecError: unknown name; the message lists the valid ones.
    """
    if isinstance(name, Memory):
        return name
    if name is None:
        name = "none"
    try:
        cls = _REGISTRY[name]
    except KeyError:
        raise CodecError(
            f"unknown memory {name!r}; valid memories: {', '.join(memory_names())}"
        ) from None
    return cls(**params)


@register_memory("none")
class NoMemory(Memory):
    """No error feedback: what the codec drops is lost."""


@register_memory("residual")
class ResidualMemory(Memory):
    """Residual error feedback: e <- (g + beta * e) - decode(encode(g + beta * e)).

    Args:
        beta: decay of the residual before it is added (1.0 = plain error feedback).
    """

    def __init__(self, beta: float = 1.0) -> None:
        super().__init__()
        if not (0.0 <= float(beta) <= 1.0) or math.isnan(float(beta)):
            raise CodecError(f"residual beta must be in [0, 1], got {beta!r}")
        self.beta = float(beta)
        #: name -> (codec, pending) of a deferred residual update: the state of ``name``
        #: then holds the compensated gradient c, and e = c - decode(pending)
        self._pending: Dict[str, Tuple[Any, Any]] = {}

    def params(self) -> Dict[str, Any]:
        """Return the constructor parameters."""
        return {"beta": self.beta}

    def compensate(self, name: str, grad: Any) -> Any:
        """Return g + beta * e in float32 (float64 for float64 gradients)."""
        e = self._buffer(name, grad)
        xp = array_module(e)
        if self.beta == 1.0:
            return xp.add(grad, e, dtype=e.dtype)  # one pass, upcasting on the fly
        return xp.add(grad, e * e.dtype.type(self.beta), dtype=e.dtype)

    def compensate_in_state(self, name: str, grad: Any) -> Any:
        """Return g + beta * e computed into the state of ``name`` itself: no new array.

        :meth:`compensate`'s values, bit for bit, without allocating (for a 400 MB
        gradient, a fresh array a step is 400 MB of page faults). Until the caller's
        :meth:`update` with the returned array (``e = c - decoded``, in place) the state
        of ``name`` holds the compensated gradient, not the residual: call :meth:`update`
        or :meth:`reset` (on an error) before the residual is read again.

        Args:
            name: the gradient's key.
            grad: the gradient, any shape and float dtype (not modified).

        Returns:
            The state array (float32; float64 for float64), ``grad``'s shape.
        """
        e = self._buffer(name, grad)
        xp = array_module(e)
        if self.beta != 1.0:
            xp.multiply(e, e.dtype.type(self.beta), out=e)
        xp.add(grad, e, out=e, dtype=e.dtype)  # g + (beta e): addition commutes exactly
        return e

    def encode(self, codec: Any, name: str, grad: Any, finite: bool = False) -> Tuple[Any, Any]:
        """As :meth:`Memory.encode`, through the codec's fused kernels when it has them.

        With ``beta = 1``:

        - ``finite``: the codec's one-pass
          :meth:`~hipress.codecs.Codec.encode_residual_deferred` (onebit on NumPy)
          stores the compensated gradient and keeps what was sent of it as pending; the
          subtraction that makes it the residual runs inside the next step's pass, or
          when the residual is read (:meth:`get`, :meth:`state_dict`, another path).
          If x + e is not finite it raises NonFiniteGradientError with the residual of
          ``name`` reset to zero (the partial pass cannot be undone).
        - otherwise the codec's :meth:`~hipress.codecs.Codec.encode_residual`
          compensates, encodes and updates in two passes without temporaries, leaving
          the residual unchanged on an error.

        Both are bit-identical to the three separate steps.
        """
        if self.beta == 1.0:
            if finite and type(grad) is np.ndarray:
                done = self._encode_deferred(
                    codec, name, tuple(grad.shape), grad.dtype,
                    lambda state, pend: codec.encode_residual_deferred(grad, state, pend, name))
                if done is not None:
                    return done, None
            payload = codec.encode_residual(grad, self._buffer(name, grad), name)
            if payload is not None:
                return payload, None
        return super().encode(codec, name, grad)

    def merge_encode(self, codec: Any, name: str, payloads: Sequence[Any]) -> Any:
        """Encode the sum of decoded ``payloads`` with error feedback, in one fused pass.

        The aggregator's step (decode the payloads, add them in list order, then
        :meth:`encode` the sum with ``finite``), through the codec's
        :meth:`~hipress.codecs.Codec.merge_encode_residual_deferred`; bit-identical to
        those steps. Host payloads and ``beta = 1`` only.

        Args:
            codec: the codec of the payloads.
            name: the key of the sum's residual.
            payloads: NumPy payloads of ``codec``, all for the same number of elements.

        Returns:
            The payload of the encoded sum, or None when the codec has no fused kernel
            for these payloads (nothing was done: run the separate steps).

        Raises:
            NonFiniteGradientError: as :meth:`encode` with ``finite``.
        """
        if self.beta != 1.0 or not payloads:
            return None
        n = payloads[0].numel
        return self._encode_deferred(
            codec, name, (n,), payloads[0].dtype,
            lambda state, pend: codec.merge_encode_residual_deferred(payloads, state, pend,
                                                                     name))

    def _encode_deferred(self, codec: Any, name: str, shape: Tuple[int, ...], dtype: Any,
                         run: Callable[[Any, Any], Any]) -> Any:
        """Run a deferred encode ``run(state, pending)`` on the stored state of ``name``."""
        prev = self._pending.get(name)
        if prev is not None and type(prev[0]) is not type(codec):
            self._settle(name)
            prev = None
        state = self._stored(name, shape, dtype, np)  # as stored: c while a settle is pending
        try:
            done = run(state, None if prev is None else prev[1])
        except NonFiniteGradientError as exc:
            self._pending.pop(name, None)
            state[...] = 0
            raise NonFiniteGradientError(
                f"{str(exc).rstrip('.')}. Its error-feedback residual was reset to zero."
            ) from exc
        if done is None:
            self._settle(name)
            return None
        self._pending[name] = (codec, done[1])
        return done[0]

    def _settle(self, name: str) -> None:
        """Apply a deferred update of ``name``: its state becomes the residual again."""
        pend = self._pending.pop(name, None)
        if pend is not None:
            pend[0].settle_residual(self._state[name], pend[1])

    def _buffer(self, name: str, like: Any) -> Any:
        self._settle(name)
        return super()._buffer(name, like)

    def get(self, name: str) -> Any:
        """Return the residual of ``name`` (None if it has none yet), settled first."""
        self._settle(name)
        return super().get(name)

    def state_dict(self) -> Dict[str, np.ndarray]:
        """As :meth:`Memory.state_dict`: the residuals, deferred updates applied to the copies.

        The stored states are not touched, so this is as safe as the base method while
        the engine runs; between steps the copies are exact.
        """
        pending = dict(self._pending)
        out = super().state_dict()
        for k, (codec, pend) in pending.items():
            if k in out:
                codec.settle_residual(out[k], pend)
        return out

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """As :meth:`Memory.load_state_dict`; deferred updates are dropped with the state."""
        super().load_state_dict(state)
        self._pending = {}

    def reset(self, name: str = "") -> None:
        """Forget the state (and any deferred update) of one gradient, or of all."""
        super().reset(name)
        if name:
            self._pending.pop(name, None)
        else:
            self._pending.clear()

    def put(self, name: str, value: Any) -> None:
        """As :meth:`Memory.put`; a deferred update of ``name`` is dropped."""
        self._pending.pop(name, None)
        super().put(name, value)

    def reset_prefix(self, prefix: str) -> int:
        """As :meth:`Memory.reset_prefix`, deferred updates included."""
        for k in [k for k in self._pending if k.startswith(prefix)]:
            del self._pending[k]
        return super().reset_prefix(prefix)

    def update_sparse(self, name: str, compensated: Any, indices: Any, values: Any) -> None:
        """Store e = compensated - decoded for a sparse decoded array (see the base class).

        Bit for bit :meth:`update`'s result: ``x - 0.0 == x`` wherever nothing was sent,
        so ``e`` becomes ``compensated`` (kept as the new state when it is a fresh array
        of the state's dtype and shape, else copied) less ``values`` at ``indices``.
        """
        e = self._state[name] = adopt(compensated, self._buffer(name, compensated))
        ef = e.reshape(-1)
        ef[indices] = ef[indices] - values.astype(e.dtype, copy=False)

    def update(self, name: str, compensated: Any, decoded: Any) -> None:
        """Store e = compensated - decoded, in place."""
        e = self._buffer(name, compensated)
        xp = array_module(e)
        xp.subtract(compensated, decoded.astype(e.dtype, copy=False).reshape(e.shape), out=e)
