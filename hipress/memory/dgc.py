"""DGC memory: momentum correction, momentum factor masking and local gradient clipping.

Lin et al., "Deep Gradient Compression", ICLR 2018, sections 3.1-3.2. Sparsifying plain
gradients with error feedback loses the optimizer's momentum on the delayed elements; DGC
instead accumulates the *velocity* locally and sparsifies that. Per gradient ``name``, with
momentum ``m``, N ranks and the codec's decoded output ``d_t``::

    g_t <- g_t * min(1, c / ||g_t||_2),  c = clip_norm / sqrt(N)   # 3.2 local clipping
    u_t = m * u_{t-1} + g_t                                        # momentum correction
    v_t = v_{t-1} + u_t                                            # accumulation
    send sparse(v_t)                                               # the codec
    v_t <- v_t - d_t                      (zero where sent: values are exact copies)
    u_t <- u_t with zeros where d_t != 0                           # momentum factor masking

The aggregated sparse update is applied by an optimizer *without* momentum (momentum is
already in ``u``). State is kept in float32 (float64 for float64 gradients) under two keys
per gradient, ``f"{name}/u"`` and ``f"{name}/v"``, so :meth:`state_dict` stays a flat
``{str: float ndarray}`` dict like every memory's.

Sent positions are recovered as ``d_t != 0``: an element sent with the value exactly 0
keeps its momentum, which is what DGC does for an element it did not send (and ``v`` is 0
there either way).
"""

from __future__ import annotations

import math
from typing import Any, Dict, Optional

import numpy as np

from hipress.backend import array_module, compute_dtype
from hipress.codecs import ops
from hipress.codecs.dgc import check_clip_norm, check_momentum
from hipress.errors import CodecError
from hipress.memory.base import Memory, adopt, register_memory

_SUFFIXES = ("/u", "/v")


@register_memory("dgc")
class DGCMemory(Memory):
    """Momentum correction and masking of Deep Gradient Compression (Lin et al., 2018).

    :meth:`compensate` computes the new momentum ``u`` and accumulation ``v`` without
    storing them and returns ``v`` (the array to encode); :meth:`update` stores them with
    the sent elements masked. So a step whose encode fails (e.g. a NaN gradient) leaves the
    state untouched.

    Algorithm (one step of gradient ``name``):
        1. If ``clip_norm`` is set: c = clip_norm / sqrt(world_size); if ||g||_2 > c,
           g = g * (c / ||g||_2). A non-finite norm raises NonFiniteGradientError.
        2. u' = momentum * u + g; v' = v + u' (float32, or float64 for float64 gradients).
        3. Return v' for the codec to encode.
        4. update(name, v', d): v = v' - d; u = u' with u[d != 0] = 0.

    Args:
        momentum: momentum factor m, in [0, 1) (0.9 in the paper; 0 gives plain residual
            error feedback).
        clip_norm: clipping norm for the whole model's gradient in the paper's setting; each
            rank clips each gradient tensor to ``clip_norm / sqrt(world_size)``. None
            disables clipping.
        world_size: number of ranks N (scales the clipping threshold by N^-1/2).

    Raises:
        CodecError: a parameter is out of range.
    """

    def __init__(self, momentum: float = 0.9, clip_norm: Optional[float] = None,
                 world_size: int = 1) -> None:
        super().__init__()
        self.momentum = check_momentum(momentum, "dgc memory")
        self.clip_norm = check_clip_norm(clip_norm, "dgc memory")
        if isinstance(world_size, bool) or not isinstance(world_size, (int, np.integer)) \
                or world_size < 1:
            raise CodecError(f"dgc memory world_size must be an integer >= 1, got {world_size!r}")
        self.world_size = int(world_size)
        self._pending: Dict[str, Any] = {}

    def params(self) -> Dict[str, Any]:
        """Return the constructor parameters."""
        return {"momentum": self.momentum, "clip_norm": self.clip_norm,
                "world_size": self.world_size}

    @property
    def clip_threshold(self) -> Optional[float]:
        """Return the per-rank clipping norm clip_norm / sqrt(world_size), or None."""
        if self.clip_norm is None:
            return None
        return self.clip_norm / math.sqrt(self.world_size)

    def _clip(self, name: str, grad: Any, cdt: np.dtype) -> Any:
        """Return ``grad`` in ``cdt``, scaled to norm <= clip_threshold when clipping is on."""
        xp = array_module(grad)
        g = grad.astype(cdt, copy=False)
        thr = self.clip_threshold
        if thr is None:
            return g
        norm = float(xp.sqrt(xp.vdot(g.reshape(-1), g.reshape(-1))))
        ops.check_finite(norm, name, "L2 norm")
        if norm > thr:
            g = g * cdt.type(thr / norm)
        return g

    def compensate(self, name: str, grad: Any) -> Any:
        """Return v' = v + (momentum * u + clip(g)) for the codec; store nothing yet.

        Args:
            name: stable gradient name.
            grad: the gradient (NumPy or CuPy, any shape, a floating dtype); not modified.

        Returns:
            New array v' of ``grad``'s shape in float32 (float64 for float64 gradients).

        Raises:
            NonFiniteGradientError: clipping is on and ``grad``'s norm is NaN/Inf.
            CodecError: the stored state has another shape (name clash or wrong checkpoint).
        """
        u = self._buffer(f"{name}/u", grad)
        v = self._buffer(f"{name}/v", grad)
        xp = array_module(u)
        cdt = compute_dtype(grad.dtype)
        g = self._clip(name, grad, cdt)
        if self.momentum != 0.0:
            u_new = u * cdt.type(self.momentum)
            u_new += g
        else:
            u_new = g.copy() if g is grad else g
        self._pending[name] = u_new
        return xp.add(v, u_new)

    def update(self, name: str, compensated: Any, decoded: Any) -> None:
        """Store v = compensated - decoded and the new momentum masked where sent.

        Args:
            name: the gradient name given to :meth:`compensate`.
            compensated: the array :meth:`compensate` returned (v').
            decoded: the codec's decoded output for it (zeros where nothing was sent).

        Raises:
            CodecError: :meth:`compensate` was not called for ``name`` first.
        """
        u_new = self._pop_pending(name)
        v = self._buffer(f"{name}/v", compensated)
        xp = array_module(v)
        d = xp.asarray(decoded).reshape(v.shape)  # a host decode of a device gradient too
        xp.subtract(compensated, d.astype(v.dtype, copy=False), out=v)
        u_new[d != 0] = 0
        self._state[f"{name}/u"] = u_new

    def update_sparse(self, name: str, compensated: Any, indices: Any, values: Any) -> None:
        """:meth:`update` for a sparse decoded array, touching only the sent elements.

        Bit for bit :meth:`update`'s state: ``v`` becomes ``compensated`` (a fresh array
        from :meth:`compensate`) less ``values`` at ``indices``; the momentum is zeroed
        where a nonzero value was sent.

        Raises:
            CodecError: :meth:`compensate` was not called for ``name`` first.
        """
        u_new = self._pop_pending(name)
        v = adopt(compensated, self._buffer(f"{name}/v", compensated))
        vf = v.reshape(-1)
        vf[indices] = vf[indices] - values.astype(v.dtype, copy=False)
        u_new.flat[indices[values != 0]] = 0  # any layout
        self._state[f"{name}/v"] = v
        self._state[f"{name}/u"] = u_new

    def _pop_pending(self, name: str) -> Any:
        try:
            return self._pending.pop(name)
        except KeyError:
            raise CodecError(
                f"dgc memory update({name!r}) without a compensate({name!r}) before it; "
                "call compensate, encode, decode, update in that order"
            ) from None

    def reset(self, name: str = "") -> None:
        """Forget the momentum and accumulation of one gradient, or of all."""
        if name:
            for s in _SUFFIXES:
                self._state.pop(name + s, None)
            self._pending.pop(name, None)
        else:
            self._state.clear()
            self._pending.clear()

    def reset_prefix(self, prefix: str) -> int:
        """Forget momentum and accumulation of every gradient starting with ``prefix``."""
        for k in [k for k in self._pending if k.startswith(prefix)]:
            del self._pending[k]
        return super().reset_prefix(prefix)

    def __contains__(self, name: str) -> bool:
        return f"{name}/v" in self._state

    def get(self, name: str) -> Any:
        """Return the accumulation ``v`` of gradient ``name`` (what is still unsent).

        A key ending in ``/u`` or ``/v`` (as in :meth:`state_dict`) returns that array.
        """
        if name in self._state:
            return self._state[name]
        return self._state.get(f"{name}/v")

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Replace the state with :meth:`state_dict`'s ``{f"{name}/u" or "/v": array}``.

        Raises:
            CodecError: a key does not end in ``/u`` or ``/v``, a gradient lacks one of the
                two, or a value is not a float array.
        """
        for k in state:
            if not str(k).endswith(_SUFFIXES):
                raise CodecError(
                    f"dgc memory state key {k!r} must end in '/u' or '/v' (was the checkpoint "
                    "made with another memory?)"
                )
        names = {str(k)[:-2] for k in state}
        missing = sorted(f"{n}{s}" for n in names for s in _SUFFIXES if f"{n}{s}" not in state)
        if missing:
            raise CodecError(f"dgc memory state lacks {missing}: a truncated checkpoint")
        super().load_state_dict(state)
        self._pending.clear()
