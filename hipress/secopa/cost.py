"""SeCoPa's cost model: predicted time to synchronize one gradient, for every engine path.

The model follows the task graphs of :mod:`hipress.engine.tasks` primitive by primitive,
with each primitive's cost from a measured :class:`~hipress.secopa.profile.Profile`
(``t(x) = max(floor, a + b*x)``, with a second line for large sizes where measured), and
the payload sizes from the codec itself (``codec.payload_nbytes``, for what the engine
really encodes: 1-D partitions and chunks on PS, Ring and gather, the gradient's own shape
on the compressed allreduce, where low-rank codecs need the matrix).
After Bai et al., SOSP'21, section 4 (SeCoPa), with the cost curves measured instead of
hard-coded and the formulas derived for any world size N and any codec.

Notation (one gradient of n float32 elements, world size N, K partitions):

- ``enc(m), dec(m), mrg(m)``: the codec's encode, decode, decode-and-add of m elements;
  ``ef(m)``: residual error feedback (compensate + update); ``wr(m)``: storing a decoded
  result averaged into the output (after every final decode); ``s``: the engine's overhead
  per task step, compute or communication wait (profile ``step_overhead_s``); every step
  of a task graph below is charged one ``s``, on the compute side;
- ``encs(m) = enc(m) + fb * (dec(m) + ef(m)) + s``: the engine's encode step, which with
  error feedback (``fb``) also decodes its own payload to update the residual;
- ``P(m)``: payload bytes of m elements; message patterns ``G`` (ps_gather), ``B``
  (ps_bcast), ``A`` (allgather), ``R`` (ring_step), ``AR`` (allreduce) from the profile,
  scaled to N (:meth:`Profile.comm_at`).

Paths (the engine picks one per gradient, :meth:`Engine._path`):

- **fused** (uncompressed): gradients are concatenated into buffers of up to
  ``fusion_bytes`` and allreduced. With the per-buffer fixed cost ``F = AR(0) + 3s`` (two
  exchanges and a sum), a gradient of ``X`` bytes adds ``AR.b * X + F * X / fusion_bytes``
  (its bytes, plus its share of the per-buffer fixed cost); ``F`` itself is paid once per
  iteration if anything is uncompressed (:meth:`CostModel.fused_fixed`). At N = 1 it
  costs nothing.
- **ps** (CaSync-PS): per partition of m elements every rank encodes (``encs(m)``), sends
  ``P(m)`` to the partition's aggregator and waits for the result (``s``), the aggregator
  receives (``s``), decodes and adds N payloads and re-encodes
  (``agg(m) = N*mrg(m) + s + encs(m) + 2s``) and sends ``P(m)`` back (``s``), every rank
  decodes and stores (``dec(m) + wr(m) + s``). Aggregators are round-robin, so the busiest
  rank aggregates ``ceil(K/N)`` partitions and the K partitions go in ``ceil(K/N)``
  rounds of up to N concurrent aggregators; a round with r aggregators costs
  ``G(P) + (r-1)/(N-1) * max(0, A(P) - G(P))`` to gather (one incast at r = 1, an
  all-to-all at r = N; interpolated between) and likewise with ``B`` to broadcast.
  With K < N the average rank aggregates K/N partitions, not one: the difference,
  ``(ceil(K/N) - K/N) * agg``, is :attr:`Cost.remote_s` (other ranks' engine work that
  delays this gradient, for the pipeline simulation).
- **ring** (CaSync-Ring): each partition is cut into N chunks of c = ceil(m/N); per
  partition every rank does ``encs(c)``, then N-1 hops of ``R(P(c)) + s`` +
  ``mrg(c) + s`` + ``encs(c)``, then ``A(P(c)) + s`` and N decodes
  ``dec(c) + wr(c) + s``.
- **gather** (variable-size or non-mergeable codecs): the engine cuts the gradient into
  its own ``K = ceil(4n / partition_bytes)`` partitions (a plan's K is for PS and Ring
  only); per partition of m elements ``encs(m) + s + N*mrg(m) + s + wr(m)`` compute and
  one ``A(P(m))``, pipelined like PS and Ring (below).
- **allreduce** (summable, non-mergeable codecs, or summable codecs under strategy auto):
  the codec's ``reduce_stages`` compute (profiled as ``stages``) plus one ``AR`` per stage
  over ``P(shape)`` bytes split evenly across the stages (3 steps each: two exchanges and a
  sum), plus ``fb * ef(n) + wr(n)``.

Pipelining (PS, Ring and gather, K partitions in flight at once): each rank has one compute
resource (the engine's compute pool) and one network resource. With ``C_tot`` the compute
time of the busiest rank over all partitions, ``N_tot`` the network time of all of them,
and ``C_1``, ``N_1`` the compute and network time on one partition's critical path::

    T(K) = max(C_tot + N_1, N_tot + C_1)

i.e. the busier resource works throughout, plus the other resource's share of one
partition that cannot overlap (the first partition's fill or the last one's drain). At
K = 1 this is exactly the serial sum ``C_1 + N_1``. More partitions shrink ``C_1``,
``N_1`` and the aggregator imbalance but pay each primitive's fixed cost K times: that
trade-off is what the planner optimizes.

Totals over a model are sums over gradients (gradients are taken to synchronize one after
the other, as they become ready during the backward pass); see the planner.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Dict, List, Optional, Tuple

from hipress.codecs import Codec
from hipress.secopa.errors import SeCoPaError
from hipress.secopa.profile import CodecProfile, Fit, Profile

#: the engine's default ``sync.partition_bytes`` (the gather path's partition size)
DEFAULT_PARTITION_BYTES = 4 * 1024 * 1024

#: engine paths a compressed gradient can take
COMPRESSED_PATHS = ("ps", "ring", "allreduce", "gather")
#: the engine's default fused-buffer size (sync.fusion_threshold_bytes)
DEFAULT_FUSION_BYTES = 64 * 1024 * 1024
#: bytes of one element: the engine computes in float32 on the compressed paths
ITEMSIZE = 4


@dataclasses.dataclass(frozen=True)
class Cost:
    """A predicted synchronization time and its parts.

    Attributes:
        total_s: predicted time, seconds.
        compute_s: compute on the busiest rank (``C_tot``), seconds.
        network_s: time on the wire (``N_tot``), seconds.
        path: engine path: fused, ps, ring, allreduce or gather.
        partitions: partitions K (PS and Ring as asked; gather the engine's own; else 1).
        remote_s: of ``compute_s``, the part an average rank does not run itself, seconds:
            on PS with K < N partitions the busiest rank aggregates one partition while
            the average one aggregates K/N of one, ``(ceil(K/N) - K/N) * agg``. It is on
            the partitions' critical path (some rank's engine runs it) but does not load
            this rank's engine (0 on the other paths).
        link_s: of ``network_s``, the time the messages hold the link, seconds: each
            message's bytes times its pattern's per-byte slope (the rest is fixed latency,
            which messages of other gradients overlap). None: all of ``network_s``.
    """

    total_s: float
    compute_s: float
    network_s: float
    path: str
    partitions: int
    remote_s: float = 0.0
    link_s: Optional[float] = None


def engine_paths(codec: Optional[Codec], strategy: str) -> Tuple[str, ...]:
    """Return the compressed paths the engine may take for ``codec`` under ``strategy``.

    Mirrors :meth:`hipress.engine.engine.Engine._path`: codecs that are not mergeable or
    whose payload size varies never run under PS/Ring (allreduce if summable and of fixed
    size, else gather); otherwise ``ps`` or ``ring`` as asked, and for ``auto`` the planner
    may choose among ps, ring and (summable codecs) allreduce.

    Raises:
        SeCoPaError: unknown strategy.
    """
    if strategy not in ("ps", "ring", "auto", "allreduce", "gather"):
        raise SeCoPaError(f"strategy must be ps, ring or auto, got {strategy!r}")
    if codec is None:
        return ()
    if not codec.mergeable or codec.variable_size:
        return ("allreduce",) if codec.summable and not codec.variable_size else ("gather",)
    if strategy in ("ps", "ring", "gather"):
        return (strategy,)
    if strategy == "allreduce":
        return ("allreduce",) if codec.summable else ("ps",)
    return ("ps", "ring", "allreduce") if codec.summable else ("ps", "ring")


def _occupancy(fit: Fit) -> Callable[[float], float]:
    """Return a message pattern's link occupancy: ``min(t(x), slope * x)``.

    ``slope`` is the fit's per-byte cost (the steeper of its two lines); what the fit adds
    on top, its intercept or floor, is latency: messages of other gradients overlap it.
    """
    t = _line(fit)
    slope = max(float(fit.b), float(fit.b2 or 0.0))

    def occ(x: float) -> float:
        return min(t(x), slope * x)

    return occ


def _line(fit: Optional[Fit], k: float = 1.0) -> Optional[Callable[[float], float]]:
    """Return ``k * fit`` as a plain function of bytes (the planner calls it ~10^5 times)."""
    if fit is None:
        return None
    a, b, floor = k * float(fit.a), k * float(fit.b), k * float(fit.floor)
    if fit.b2 is not None:
        a2, b2 = k * float(fit.a2), k * float(fit.b2)

        def f2(x: float) -> float:
            v = max(a + b * x, a2 + b2 * x)
            return v if v > floor else floor

        return f2

    def f(x: float) -> float:
        v = a + b * x
        return v if v > floor else floor

    return f


class CostModel:
    """Predicts synchronization times from a profile for one world size.

    Args:
        profile: the measured :class:`Profile`.
        world_size: N (the profile's message costs are scaled to it, see
            :meth:`Profile.comm_at`).
        fusion_bytes: the engine's fused-buffer size (``sync.fusion_threshold_bytes``).
        partition_bytes: the engine's ``sync.partition_bytes``: the gather path's
            partitions are ``ceil(bytes / partition_bytes)``, whatever a plan says.

    Compute costs (codec fits, ``ef``, ``write``, ``step_overhead_s``) are the profile's
    CPU costs times :attr:`contention`, ``1 / profile.cpu_share_backward``: what the
    engine's work takes while the backward pass holds the cores (1 for a profile taken
    alone; a refit from a job's timeline measures the share). The pipeline simulation
    divides it out again where the backward pass has ended.

    Raises:
        ProfileError: N > 1 and the profile has no communication measurements.
    """

    def __init__(self, profile: Profile, world_size: int,
                 fusion_bytes: int = DEFAULT_FUSION_BYTES,
                 partition_bytes: int = DEFAULT_PARTITION_BYTES) -> None:
        if int(world_size) < 1:
            raise SeCoPaError(f"world size must be >= 1, got {world_size}")
        self.profile = profile
        self.N = int(world_size)
        self.comm = profile.comm_at(self.N)
        #: wall seconds per CPU second of engine work during the backward pass
        self.contention = 1.0 / float(profile.cpu_share_backward)
        self.s = float(profile.step_overhead_s) * self.contention
        self.fusion_bytes = max(int(fusion_bytes), 1)
        self.partition_bytes = max(int(partition_bytes), 1)
        self._cp: Dict[int, CodecProfile] = {}
        self._fns: Dict[int, Tuple[Any, ...]] = {}
        self._payloads: Dict[Tuple[int, int], int] = {}
        self._shaped: Dict[Tuple[int, Tuple[int, ...]], int] = {}
        self._alive: Dict[int, Codec] = {}
        c = self.comm
        self._G, self._B, self._A = _line(c.ps_gather), _line(c.ps_bcast), _line(c.allgather)
        self._R, self._AR = _line(c.ring_step), _line(c.allreduce)
        # the same patterns' link occupancy: bytes times the per-byte slope
        self._Go, self._Bo, self._Ao = _occupancy(c.ps_gather), _occupancy(c.ps_bcast), \
            _occupancy(c.allgather)
        self._Ro, self._ARo = _occupancy(c.ring_step), _occupancy(c.allreduce)
        self._ef = _line(profile.ef, self.contention)
        self._wr = _line(profile.write, self.contention)

    # ------------------------------------------------------------------ helpers
    def codec_profile(self, codec: Codec) -> CodecProfile:
        """Return the profile's compute fits for ``codec`` (cached per codec object)."""
        got = self._cp.get(id(codec))
        if got is None:
            got = self._cp[id(codec)] = self.profile.codec(codec)
            self._alive[id(codec)] = codec
        return got

    def _codec_fns(self, codec: Codec) -> Tuple[Any, ...]:
        got = self._fns.get(id(codec))
        if got is None:
            cp = self.codec_profile(codec)
            k = self.contention
            got = self._fns[id(codec)] = (_line(cp.encode, k), _line(cp.decode, k),
                                          _line(cp.merge, k), _line(cp.stages, k),
                                          max(cp.n_stages, 1))
        return got

    def payload(self, codec: Codec, m: int) -> int:
        """Return the wire bytes of a payload of ``m`` elements (1-D, as the engine encodes)."""
        key = (id(codec), int(m))
        got = self._payloads.get(key)
        if got is None:
            self._alive[id(codec)] = codec  # keeps id(codec) from being reused meanwhile
            got = self._payloads[key] = int(codec.payload_nbytes((int(m),)))
        return got

    def payload_shaped(self, codec: Codec, shape: Tuple[int, ...]) -> int:
        """Return the wire bytes of a payload of a gradient of ``shape`` (cached)."""
        key = (id(codec), tuple(int(d) for d in shape))
        got = self._shaped.get(key)
        if got is None:
            self._alive[id(codec)] = codec
            got = self._shaped[key] = int(codec.payload_nbytes(key[1]))
        return got

    def _phase(self, single: Callable[[float], float], x: float, active: int,
               allgather: Optional[Callable[[float], float]] = None) -> float:
        """Cost of one PS phase with ``active`` concurrent aggregators (see module doc).

        ``allgather`` is the all-to-all pattern to interpolate towards (default ``A``; its
        link occupancy for the occupancy of the phase).
        """
        if self.N == 1 or active <= 0:
            return 0.0
        g = single(x)
        if active == 1:
            return g
        full = (allgather or self._A)(x)
        return g + (active - 1) / (self.N - 1) * max(0.0, full - g)

    # ------------------------------------------------------------------ paths
    def fused_fixed(self) -> float:
        """Return the per-iteration fixed cost of the fused uncompressed allreduce (s)."""
        return 0.0 if self.N == 1 else self._AR(0.0) + 3 * self.s

    def uncompressed(self, numel: int, itemsize: int = ITEMSIZE) -> Cost:
        """Return the marginal cost of leaving a gradient uncompressed (fused path)."""
        if self.N == 1 or numel == 0:
            return Cost(0.0, 0.0, 0.0, "fused", 1)
        nbytes = float(numel) * itemsize
        ar = self.comm.allreduce
        t = ar.b * nbytes + self.fused_fixed() * nbytes / self.fusion_bytes
        return Cost(t, 0.0, t, "fused", 1, link_s=ar.b * nbytes)

    def compressed(self, codec: Codec, numel: int, path: str, partitions: int = 1,
                   feedback: bool = False, shape: Optional[Tuple[int, ...]] = None) -> Cost:
        """Return the predicted time of synchronizing a compressed gradient.

        Args:
            codec: the codec (its payload sizes and profiled compute are used).
            numel: elements of the gradient (>= 1).
            path: ps, ring, allreduce or gather.
            partitions: K for ps and ring (clamped to ``numel``); ignored otherwise (gather
                takes the engine's ``ceil(4 * numel / partition_bytes)``, the returned
                :attr:`Cost.partitions`).
            feedback: residual error feedback is on (the engine's encode step then also
                decodes and updates the residual).
            shape: the gradient's shape, for the payload of the allreduce path (default
                ``(numel,)``).

        Raises:
            SeCoPaError: unknown path or numel < 1.
            ProfileError: the profile has no entry for the codec.
        """
        n = int(numel)
        if n < 1:
            raise SeCoPaError(f"a compressed gradient needs >= 1 element, got {numel}")
        f_enc, f_dec, f_mrg, f_stages, n_stages = self._codec_fns(codec)
        f_ef, f_wr = self._ef, self._wr
        fb = 1.0 if feedback else 0.0
        s, N = self.s, self.N

        def enc(m: int) -> float:
            return f_enc(ITEMSIZE * m) if m else 0.0

        def dec(m: int) -> float:
            return f_dec(ITEMSIZE * m) if m else 0.0

        def mrg(m: int) -> float:
            return f_mrg(ITEMSIZE * m) if m else 0.0

        def dec_out(m: int) -> float:
            return f_dec(ITEMSIZE * m) + f_wr(ITEMSIZE * m) if m else 0.0

        def encs(m: int) -> float:
            if not m:
                return s
            x = ITEMSIZE * m
            if fb:
                return f_enc(x) + f_dec(x) + f_ef(x) + s
            return f_enc(x) + s

        if path == "ps":
            return self._ps(codec, n, max(1, min(int(partitions), n)), enc, dec_out, mrg,
                            encs)
        if path == "ring":
            return self._ring(codec, n, max(1, min(int(partitions), n)), dec_out, mrg, encs)
        if path == "gather":
            k = max(1, min(math.ceil(ITEMSIZE * n / self.partition_bytes), n))
            return self._gather(codec, n, k, mrg, encs)
        if path == "allreduce":
            k = n_stages
            c = (f_stages(ITEMSIZE * n) if f_stages is not None else enc(n) + dec(n)) + 3 * k * s
            c += fb * f_ef(ITEMSIZE * n) + f_wr(ITEMSIZE * n)
            p = self.payload(codec, n) if shape is None else self.payload_shaped(codec, shape)
            w = k * self._AR(p / k) if N > 1 else 0.0
            link = k * self._ARo(p / k) if N > 1 else 0.0
            return Cost(c + w, c, w, "allreduce", 1, link_s=link)
        raise SeCoPaError(f"unknown path {path!r}; expect one of {COMPRESSED_PATHS}")

    def _sizes(self, n: int, k: int) -> List[Tuple[int, int]]:
        """Return [(elements, count)] of the K partitions (as np.array_split cuts them)."""
        q, r = divmod(n, k)
        out = [(q + 1, r)] if r else []
        if k - r:
            out.append((q, k - r))
        return out

    def _ps(self, codec: Codec, n: int, k: int, enc: Any, dec: Any, mrg: Any,
            encs: Any) -> Cost:
        N, s = self.N, self.s
        sizes = self._sizes(n, k)
        big = sizes[0][0]

        def agg(m: int) -> float:
            return N * mrg(m) + s + encs(m) + 2 * s

        worker = sum(cnt * (encs(m) + s + dec(m) + s) for m, cnt in sizes)
        c_tot = worker + math.ceil(k / N) * agg(big)
        c_1 = encs(big) + s + agg(big) + dec(big) + s
        p = self.payload(codec, big)
        full, rem = divmod(k, N)
        n_tot = l_tot = 0.0
        if N > 1:
            g, b, go, bo, ao = self._G, self._B, self._Go, self._Bo, self._Ao
            n_tot = full * (self._phase(g, p, N) + self._phase(b, p, N))
            l_tot = full * (self._phase(go, p, N, ao) + self._phase(bo, p, N, ao))
            if rem:
                n_tot += self._phase(g, p, rem) + self._phase(b, p, rem)
                l_tot += self._phase(go, p, rem, ao) + self._phase(bo, p, rem, ao)
            n_1 = g(p) + b(p)
        else:
            n_1 = 0.0
        remote = (math.ceil(k / N) - k / N) * agg(big)
        return Cost(max(c_tot + n_1, n_tot + c_1), c_tot, n_tot, "ps", k, remote, l_tot)

    def _gather(self, codec: Codec, n: int, k: int, mrg: Any, encs: Any) -> Cost:
        N, s, f_wr = self.N, self.s, self._wr

        def part(m: int) -> Tuple[float, float, float]:
            comp = encs(m) + s + N * mrg(m) + s + (f_wr(ITEMSIZE * m) if m else 0.0)
            if N == 1:
                return comp, 0.0, 0.0
            p = self.payload(codec, m)
            return comp, self._A(p), self._Ao(p)

        return self._pipelined(self._sizes(n, k), part, "gather", k)

    def _pipelined(self, sizes: List[Tuple[int, int]],
                   part: Callable[[int], Tuple[float, float, float]], path: str, k: int) -> Cost:
        """Return ``T(K)`` (module doc) of partitions of ``part(m) = (compute, network, link)``."""
        c_tot = n_tot = l_tot = 0.0
        for m, cnt in sizes:
            cm, nm, lm = part(m)
            c_tot += cnt * cm
            n_tot += cnt * nm
            l_tot += cnt * lm
        c_1, n_1, _ = part(sizes[0][0])
        return Cost(max(c_tot + n_1, n_tot + c_1), c_tot, n_tot, path, k, link_s=l_tot)

    def _ring(self, codec: Codec, n: int, k: int, dec: Any, mrg: Any, encs: Any) -> Cost:
        N, s = self.N, self.s

        def part(m: int) -> Tuple[float, float, float]:
            c = -(-m // N)
            comp = encs(c) + (N - 1) * (s + mrg(c) + s + encs(c)) + N * (dec(c) + s)
            comp += s if N > 1 else 0.0  # the allgather wait
            if N == 1:
                return comp, 0.0, 0.0
            pc = self.payload(codec, c)
            return (comp, (N - 1) * self._R(pc) + self._A(pc),
                    (N - 1) * self._Ro(pc) + self._Ao(pc))

        return self._pipelined(self._sizes(n, k), part, "ring", k)
