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
from typing import Any, Callable, Dict, List, Tuple, Type

import numpy as np

from hipress.backend import array_module, compute_dtype, to_host
from hipress.errors import CodecError


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

    def encode(self, codec: Any, name: str, grad: Any) -> Tuple[Any, Any]:
        """Run the error-feedback step of the module docstring for one gradient.

        Args:
            codec: the :class:`hipress.codecs.Codec`.
            name: the key of the gradient's state.
            grad: the gradient (not modified).

        Returns:
            (payload, decoded): the payload of the compensated gradient, and its decoded
            array when the step computed one anyway (None otherwise; decoding the payload
            gives the same values).

        Raises:
            NonFiniteGradientError: from the codec; the state is then left unchanged.
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
        xp = array_module(like)
        buf = self._state.get(name)
        want = compute_dtype(like.dtype)
        if buf is None:
            buf = xp.zeros(like.shape, dtype=want)
            self._state[name] = buf
        elif array_module(buf) is not xp:
            buf = xp.asarray(buf)
            self._state[name] = buf
        if buf.shape != like.shape:
            raise CodecError(
                f"gradient {name!r} has shape {tuple(like.shape)} but its stored residual "
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

    def encode(self, codec: Any, name: str, grad: Any) -> Tuple[Any, Any]:
        """As :meth:`Memory.encode`, through the codec's fused kernel when it has one.

        With ``beta = 1`` the codec's :meth:`~hipress.codecs.Codec.encode_residual` (if it
        supports the arrays) compensates, encodes and updates in two passes over memory
        without temporaries; the result is bit-identical to the three separate steps.
        """
        if self.beta == 1.0:
            payload = codec.encode_residual(grad, self._buffer(name, grad), name)
            if payload is not None:
                return payload, None
        return super().encode(codec, name, grad)

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
