"""PowerSGD: rank-r gradient compression by one step of power iteration.

Vogels, Karimireddy and Jaggi, "PowerSGD: Practical Low-Rank Gradient Compression for
Distributed Optimization", NeurIPS 2019. The codec follows the structure of PyTorch's
``powerSGD_hook`` (a two-round algorithm written as stages run between collectives), but
it never communicates: the engine runs :meth:`PowerSGDCodec.reduce_stages`.

Which tensors are compressed. A gradient of ``ndim >= 2`` is viewed as the matrix
``M`` of shape ``(m, n) = (shape[0], prod(shape[1:]))``; it is compressed only when
``(m + n) * rank * min_compression_rate < m * n``, i.e. when sending ``P`` and ``Q``
is at least ``min_compression_rate`` times smaller than sending ``M``. A 1-D (or 0-d)
gradient is never compressed (biases and norms: PyTorch allreduces them as they are).
With ``rank = 1`` and the default rate 2, a ``(2, 2)`` matrix travels raw and a
``(64, 64)`` one is compressed.

Tuning advice (after PyTorch's ``powerSGD_hook`` docstring):

1. ``rank`` controls the trade-off: start at 1, raise it (2, 4, 8...) until the model
   reaches the accuracy of uncompressed training. Wire bytes grow linearly in ``rank``
   and the local matrix products grow with it too, so on slow CPUs a large rank can cost
   more than it saves (the design notes measured r = 4 slower than no compression on
   VGG-19 with two shared cores).
2. Start compressing only after a warm-up of uncompressed steps (config
   ``compression.warmup_steps``, PyTorch's ``start_powerSGD_iter``, typically 10% of the
   training steps): the engine handles it, the codec does not count steps.
3. Keep error feedback on (the default memory for this codec is ``"residual"``); without
   it PowerSGD's bias hurts accuracy badly.
4. ``min_compression_rate`` (default 2) skips matrices that compress too little to pay
   for the two extra matrix products.

Wire layout of :meth:`encode` (the single-rank view; the engine uses reduce_stages):

- compressed matrix ``(m, n)``, rank ``r``: two sections, ``P`` float32 ``m * r``
  elements (row-major ``(m, r)``, orthonormal columns) then ``Q`` float32 ``n * r``
  elements (row-major ``(n, r)``); the decoded gradient is ``P @ Q.T``.
- otherwise: one section, the gradient's elements in its own dtype (row-major).
"""

from __future__ import annotations

import logging
import math
import numbers
from typing import Any, Dict, Generator, Optional, Sequence, Tuple

import numpy as np

from hipress.backend import array_module, compute_dtype, to_host
from hipress.codecs import ops
from hipress.codecs.base import Codec, Layout, Stage, register_codec
from hipress.codecs.state import check_seed
from hipress.errors import CodecError

logger = logging.getLogger(__name__)


def matrix_view(shape: Tuple[int, ...]) -> Optional[Tuple[int, int]]:
    """Return the ``(m, n)`` matrix a gradient of ``shape`` is viewed as, or None if 1-D.

    Args:
        shape: the gradient's shape.

    Returns:
        ``(shape[0], prod(shape[1:]))`` for ``ndim >= 2``; None for ``ndim <= 1``.
    """
    if len(shape) < 2:
        return None
    return int(shape[0]), int(math.prod(shape[1:]))


def orthogonalize(p: Any, epsilon: float = 0.0) -> Any:
    """Orthonormalize the columns of ``p`` in place by Gram-Schmidt; return ``p``.

    Only elementwise products and sums are used (no BLAS call), so every rank that
    orthogonalizes the same reduced ``P`` gets bit-identical columns, whatever BLAS
    library or CPU it runs on.

    Algorithm (column ``i = 0 .. r-1``):

    1. ``norm = ||p[:, i]||``; a zero column stays zero (it carries no information);
       otherwise ``p[:, i] /= norm + epsilon`` (``epsilon`` guards tiny norms, as
       PyTorch's ``orthogonalization_epsilon`` does).
    2. for each later column ``j``: ``p[:, j] -= (p[:, i] . p[:, j]) * p[:, i]``.

    Args:
        p: float32 or float64 array of shape (m, r), NumPy or CuPy; modified in place.
        epsilon: non-negative number added to every column norm before dividing.

    Returns:
        ``p``, its non-zero columns orthonormal (up to ``epsilon`` and rounding).
    """
    xp = array_module(p)
    r = p.shape[1]
    for i in range(r):
        col = p[:, i]
        norm = float(xp.sqrt(xp.sum(col * col)))
        if norm == 0.0:
            continue
        col /= p.dtype.type(norm + epsilon)
        for j in range(i + 1, r):
            other = p[:, j]
            other -= xp.sum(col * other) * col
    return p


def low_rank_product(p: Any, q: Any, out: Any = None) -> Any:
    """Return ``p @ q.T`` as a sum of ``r`` outer products (deterministic on every rank).

    Args:
        p: array of shape (m, r).
        q: array of shape (n, r), same dtype and module as ``p``.
        out: optional C-contiguous array of shape (m, n) and ``p``'s dtype to write the
            product into (no new array of m * n elements is made).

    Returns:
        ``out``, or a new array of shape (m, n) and ``p``'s dtype. Each element is
        ``((p[i,0] q[j,0] + p[i,1] q[j,1]) + ...)`` summed in column order, so the result
        does not depend on BLAS blocking (ranks must agree bit for bit).
    """
    xp = array_module(p)
    r = p.shape[1]
    out = xp.multiply(p[:, 0:1], q[:, 0][None, :], out=out)
    if r > 1:
        tmp = xp.empty_like(out)
        for k in range(1, r):
            xp.multiply(p[:, k : k + 1], q[:, k][None, :], out=tmp)
            out += tmp
    return out


@register_codec("powersgd", codec_id=30)
class PowerSGDCodec(Codec):
    """Compress matrices to rank ``rank`` by one warm-started power iteration (PowerSGD).

    The engine path is :meth:`reduce_stages` (two summed rounds, P then Q, decoded never);
    :meth:`encode`/:meth:`decode` give the same maths for a single rank so the generic
    codec contract (wire format, round trips, checkpoints) holds.

    Per-gradient state: ``Q`` of shape ``(n, rank)``, warm-started from the previous
    step's reduced ``Q`` (PyTorch's ``warm_start=True``). It is initialized from
    ``ops.rng_for(numpy, seed, name, 0, rank=0)`` (standard normal, then orthogonalized),
    which is identical on every rank and on CPU and GPU; after a step it is the reduced
    ``Q``, identical on every rank as well.

    Args:
        rank: the approximation rank r (PyTorch's ``matrix_approximation_rank``), >= 1.
        min_compression_rate: compress an (m, n) matrix only if
            ``(m + n) * rank * min_compression_rate < m * n``; > 0, default 2.
        seed: seed of the initial ``Q`` (must be equal on every rank).
        orthogonalization_epsilon: >= 0, added to column norms in Gram-Schmidt.

    Raises:
        CodecError: a parameter is out of range.
    """

    summable = True
    stages_out = True
    error_feedback = True
    # P is orthogonalized after the sum: decoding, summing and re-encoding partial sums
    # (CaSync-PS/Ring) is not PowerSGD; only reduce_stages is.
    mergeable = False

    def __init__(
        self,
        rank: int = 1,
        min_compression_rate: float = 2.0,
        seed: int = 0,
        orthogonalization_epsilon: float = 0.0,
    ) -> None:
        if isinstance(rank, bool) or not isinstance(rank, numbers.Integral) or rank < 1:
            raise CodecError(
                f"powersgd rank must be an integer >= 1 (the approximation rank), got {rank!r}"
            )
        try:
            rate = float(min_compression_rate)
            eps = float(orthogonalization_epsilon)
        except (TypeError, ValueError):
            raise CodecError(
                "powersgd min_compression_rate and orthogonalization_epsilon must be numbers, "
                f"got {min_compression_rate!r} and {orthogonalization_epsilon!r}"
            ) from None
        if not (rate > 0.0) or not math.isfinite(rate):
            raise CodecError(
                f"powersgd min_compression_rate must be a finite number > 0, got {rate!r}"
            )
        if not (eps >= 0.0) or not math.isfinite(eps):
            raise CodecError(
                f"powersgd orthogonalization_epsilon must be finite and >= 0, got {eps!r}"
            )
        self.rank = int(rank)
        self.min_compression_rate = rate
        self.seed = check_seed(seed, "powersgd")
        self.orthogonalization_epsilon = eps
        self._q: Dict[str, Any] = {}

    def params(self) -> Dict[str, Any]:
        """Return the constructor parameters."""
        return {
            "rank": self.rank,
            "min_compression_rate": self.min_compression_rate,
            "seed": self.seed,
            "orthogonalization_epsilon": self.orthogonalization_epsilon,
        }

    # ------------------------------------------------------------------ planning
    def compressed_dims(self, shape: Tuple[int, ...]) -> Optional[Tuple[int, int]]:
        """Return the ``(m, n)`` matrix of ``shape`` if it is compressed, else None.

        A gradient is compressed iff ``ndim >= 2`` and
        ``(m + n) * rank * min_compression_rate < m * n``.
        """
        dims = matrix_view(tuple(shape))
        if dims is None:
            return None
        m, n = dims
        if (m + n) * self.rank * self.min_compression_rate < m * n:
            return dims
        return None

    def _layout(self, shape: Tuple[int, ...], dtype: np.dtype) -> Layout:
        dims = self.compressed_dims(shape)
        if dims is None:
            return [(dtype, int(math.prod(shape)))]
        m, n = dims
        f32 = np.dtype(np.float32)
        return [(f32, m * self.rank), (f32, n * self.rank)]

    # --------------------------------------------------------------------- state
    def _initial_q(self, name: str, n: int, dtype: np.dtype) -> np.ndarray:
        rng = ops.rng_for(np, self.seed, name, 0, rank=0)
        q = rng.standard_normal((n, self.rank)).astype(dtype)
        return orthogonalize(q, self.orthogonalization_epsilon)

    def _q_for(self, name: str, n: int, dtype: np.dtype, xp: Any) -> Any:
        """Return the warm-start Q of ``name`` as an (n, rank) ``dtype`` array on ``xp``."""
        q = self._q.get(name)
        if q is None:
            q = self._initial_q(name, n, dtype)
        if tuple(q.shape) != (n, self.rank):
            raise CodecError(
                f"gradient {name!r} needs a PowerSGD Q of shape {(n, self.rank)} but its stored "
                f"Q has {tuple(q.shape)}: two tensors share a name, the rank changed, or a "
                "checkpoint from another model was loaded"
            )
        if array_module(q) is not xp:
            q = xp.asarray(q)
        if q.dtype != dtype:
            q = q.astype(dtype)
        return q

    def state_dict(self) -> Dict[str, Any]:
        """Return ``{gradient name: warm-start Q}`` as NumPy copies (float32 or float64).

        Safe while other threads encode new names: the table is copied in one step
        (atomic under the GIL) before the arrays are.
        """
        return {k: np.array(to_host(v), copy=True) for k, v in dict(self._q).items()}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Replace the warm-start Q matrices by those of :meth:`state_dict` (copied).

        Raises:
            CodecError: a value is not a 2-D float array with ``rank`` columns.
        """
        q = {}
        for k, v in state.items():
            a = np.array(to_host(v), copy=True)
            if a.dtype.kind != "f" or a.ndim != 2 or a.shape[1] != self.rank:
                raise CodecError(
                    f"PowerSGD state of {k!r} has dtype {a.dtype} and shape {a.shape}; expect a "
                    f"float (n, {self.rank}) Q matrix (was the checkpoint made with another rank?)"
                )
            q[str(k)] = a
        self._q = q

    # ----------------------------------------------------------------- the maths
    def _check_p(self, p: Any, name: str) -> None:
        # P = M Q is finite iff M is (Q is finite and has no all-zero row in general):
        # a sum over P's m*r elements is far cheaper than a pass over M.
        ops.check_finite(array_module(p).sum(p), name, "PowerSGD projection P = M Q")

    def reduce_stages(
        self, x: Any, name: str, world_size: int, prescale: float = 1.0, *, out: Any = None
    ) -> Generator[Stage, Any, Any]:
        """Reduce ``x`` across ranks in two summed rounds of size (m + n) * rank.

        Algorithm (compressed matrix; Vogels et al., Algorithm 1, with warm start):

        1. ``M = x`` viewed as (m, n) in the compute dtype (float32; float64 for float64).
        2. ``P = M Q`` with the warm-start ``Q`` (n, r); yield ``(prescale * P, "sum")``.
        3. Orthogonalize the reduced ``P`` (Gram-Schmidt, deterministic).
        4. ``Q = M^T P``; yield ``(prescale * Q, "sum")``.
        5. ``result = P Q^T`` reshaped to ``x``'s shape and cast to its dtype; the reduced
           ``Q`` becomes the warm start of the next step.

        ``feedback`` is the approximation as error feedback should see it: like PyTorch
        (``error = M_local - P Q^T`` after averaging) it is ``result`` itself when
        ``prescale * world_size == 1`` (an average), and ``result / (prescale *
        world_size)`` otherwise, i.e. always the *average* approximation.

        An uncompressed gradient (1-D, or too small for ``min_compression_rate``) goes
        through one ``"sum"`` stage of ``prescale * x`` (in ``x``'s dtype) and returns
        ``(sum, None)``.

        Args:
            x: NumPy or CuPy gradient, any shape, float16/bfloat16/float32/float64; not
                modified.
            name: stable gradient name (keys the warm-start Q).
            world_size: number of ranks taking part (>= 1).
            prescale: factor applied before summing (1 / world_size for an average).
            out: optional C-contiguous array of ``x``'s shape and dtype (``x``'s own
                memory too): ``result`` is written into it (``P Q^T`` straight into it
                when its dtype is the compute dtype) after the last sum, when ``x`` is
                no longer read, and returned.

        Returns:
            ``(result, feedback)`` (generator return value).

        Raises:
            NonFiniteGradientError: ``x`` holds NaN or Inf (compressed path).
            CodecError: the stored Q of ``name`` has the wrong shape.
        """
        xp = array_module(x)
        shape = tuple(int(d) for d in x.shape)
        dims = self.compressed_dims(shape)
        if dims is None:
            if prescale != 1.0:
                cdt = compute_dtype(x.dtype)
                send = (x.astype(cdt) * cdt.type(prescale)).astype(x.dtype)
            else:
                send = x
            total = yield (send, "sum")
            if out is not None:
                out[...] = total.reshape(shape)
                return out, None
            return total.astype(x.dtype, copy=False).reshape(shape), None

        m, n = dims
        cdt = compute_dtype(x.dtype)
        scale = cdt.type(prescale)
        mat = xp.ascontiguousarray(x).reshape(m, n).astype(cdt, copy=False)
        q = self._q_for(name, n, cdt, xp)
        p = mat @ q
        self._check_p(p, name)
        if prescale != 1.0:
            p *= scale
        p_sum = yield (p, "sum")
        p_hat = orthogonalize(xp.array(p_sum, dtype=cdt, copy=True).reshape(m, self.rank),
                              self.orthogonalization_epsilon)
        q_local = mat.T @ p_hat
        if prescale != 1.0:
            q_local *= scale
        q_sum = yield (xp.ascontiguousarray(q_local), "sum")
        q_sum = xp.array(q_sum, dtype=cdt, copy=True).reshape(n, self.rank)
        direct = out is not None and out.dtype == cdt
        approx = low_rank_product(p_hat, q_sum, out.reshape(m, n) if direct else None)
        if out is not None and not direct:
            out[...] = approx.reshape(shape)  # the cast astype would make, in place
        result = out if out is not None else approx.reshape(shape).astype(x.dtype, copy=False)
        self._q[name] = q_sum
        denom = float(prescale) * int(world_size)
        if abs(denom - 1.0) <= 1e-12:
            feedback = result
        else:
            feedback = (approx * cdt.type(1.0 / denom)).reshape(shape).astype(x.dtype,
                                                                              copy=False)
        return result, feedback

    def _encode(self, flat: Any, shape: Tuple[int, ...], name: str) -> Sequence[Any]:
        """Encode as one rank alone: sections P, Q (float32) or the raw gradient.

        Algorithm: steps 1-5 of :meth:`reduce_stages` with a world of one rank (the sum
        of one rank is the array itself); the new Q is kept as the next warm start.
        """
        dims = self.compressed_dims(shape)
        if dims is None:
            return [flat.copy()]
        xp = array_module(flat)
        m, n = dims
        cdt = compute_dtype(flat.dtype)
        mat = flat.reshape(m, n).astype(cdt, copy=False)
        q = self._q_for(name, n, cdt, xp)
        p = mat @ q
        self._check_p(p, name)
        p = orthogonalize(p, self.orthogonalization_epsilon)
        q_new = xp.ascontiguousarray(mat.T @ p)
        self._q[name] = q_new
        return [p.astype(np.float32).reshape(-1), q_new.astype(np.float32).reshape(-1)]

    def _decode(self, sections: Sequence[Any], shape: Tuple[int, ...], dtype: np.dtype) -> Any:
        """Decode ``P @ Q.T`` (compressed) or copy the raw section."""
        dims = self.compressed_dims(shape)
        if dims is None:
            return sections[0].copy()
        m, n = dims
        cdt = compute_dtype(dtype)
        p = sections[0].reshape(m, self.rank).astype(cdt)
        q = sections[1].reshape(n, self.rank).astype(cdt)
        return low_rank_product(p, q).reshape(-1).astype(dtype, copy=False)
