"""CaSync task graphs: each strategy composed from partition, encode, decode, merge, send, recv.

Every graph is a coroutine for :class:`hipress.engine.scheduler.Scheduler`. They share one
rule that keeps ranks bit-identical: the final value of every element is decoded from the
same bytes (or summed in the same rank order) on every rank, so no rank ever uses a local
pre-encode value that the others do not see.

Payloads always carry *sums*; an average is taken after the final decode (``/ N``), so
error-feedback residuals are in the same units whichever rank merges.

Strategies (after Bai et al., SOSP'21, section 3):

- :func:`ps_task` — CaSync-PS, co-located: the partition's aggregator (round-robin) receives
  every rank's payload, decodes and merges them, encodes the sum once and sends it back;
  :func:`ps_bulk_task` runs the same steps for many small gradients in one task.
- :func:`ring_task` — CaSync-Ring: reduce-scatter whose every hop is recv -> decode ->
  merge -> encode -> send, then an allgather of the compressed chunks (no re-encode).
- :func:`gather_task` — for payloads whose size varies across ranks (DGC, GradDrop): every
  rank sends its payload to every other, each decodes all and sums in rank order.
- :func:`summable_task` — codecs whose payloads reduce without decoding (fp16, TernGrad
  with a shared scale, PowerSGD's P and Q, random-k with a shared seed): drives the
  codec's ``reduce_stages`` with :func:`allreduce_sum`/:func:`allreduce_max`.
- :func:`fused_task` — uncompressed gradients, concatenated into one buffer.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, Generator, List, Optional, Sequence, Tuple

import numpy as np

from hipress.backend import GRADIENT_DTYPES, array_module, compute_dtype, store_scaled, to_host
from hipress.codecs.base import Codec, Payload
from hipress.engine._kernels import add_divide
from hipress.engine.scheduler import Compute, Recv, Send
from hipress.errors import PayloadError
from hipress.memory import Memory
from hipress.timeline import Timeline


@dataclasses.dataclass
class TaskEnv:
    """What every task graph needs from the engine."""

    rank: int
    size: int
    timeline: Timeline
    stats: Dict[str, Dict[str, Any]]


@dataclasses.dataclass
class Job:
    """One submitted gradient as the background thread sees it.

    Attributes:
        name: the gradient's name (agreed across ranks).
        flat: 1-D view of the input (NumPy or CuPy), never modified.
        out: 1-D result buffer of the input's dtype, filled by the tasks.
        average: divide the sum by ``divisor``.
        codec: codec for compressed paths (None for uncompressed).
        memory: error-feedback memory (NoMemory when disabled).
        contributes: False when this rank has no gradient (zeros that must not touch
            the residual).
        parts_left: partitions still running; the handle completes at 0.
        divisor: what an average divides the sum by: the world size, less the ranks
            that only filled in zeros after :func:`hipress.join` (0: the world size).
    """

    name: str
    flat: Any
    out: Any
    shape: Tuple[int, ...]
    average: bool
    codec: Optional[Codec]
    memory: Memory
    contributes: bool
    parts_left: int = 1
    on_done: Any = None
    divisor: int = 0

    def part_done(self) -> None:
        """Mark one partition finished; complete the handle after the last one."""
        self.parts_left -= 1
        if self.parts_left == 0 and self.on_done is not None:
            self.on_done(self)


def _bounds(n: int, parts: int) -> List[int]:
    """Return parts+1 boundaries splitting n elements as evenly as np.array_split does."""
    q, r = divmod(n, parts)
    out = [0]
    for i in range(parts):
        out.append(out[-1] + q + (1 if i < r else 0))
    return out


def _stat(env: TaskEnv, name: str, **add: float) -> None:
    st = env.stats.setdefault(name, {})
    for k, v in add.items():
        st[k] = st.get(k, 0) + v


def _divisor(env: TaskEnv, job: Job) -> int:
    """Return what the job's sum is divided by: 1 for a sum, else its averaging divisor."""
    return (job.divisor or env.size) if job.average else 1


def _write(env: TaskEnv, job: Job, lo: int, hi: int, value: Any, scaled: bool = False) -> None:
    """Store a summed result slice into the job's output, averaged if asked.

    ``scaled`` means ``value`` is already the average (the codec applied ``prescale``).
    """
    store_scaled(value, job.out[lo:hi], 1 if scaled else _divisor(env, job))


# ------------------------------------------------------------------ compute steps
def _encode_step(env: TaskEnv, job: Job, codec: Codec, x: Any, key: str,
                 feedback: bool, part: str) -> Tuple[np.ndarray, Any]:
    """Encode, with error feedback through the job's memory when ``feedback``.

    Returns:
        (wire bytes, decoded payload or None): a decode that error feedback computed
        anyway is handed back so the caller never decodes its own payload twice
        (decoding is deterministic, so it equals what every other rank decodes from the
        bytes); fused error-feedback kernels compute none.
    """
    with env.timeline.span("encode", gradient=job.name, partition=part, numel=int(x.size),
                           codec=codec.name, feedback=bool(feedback)):
        if feedback:
            # compressed gradients were checked finite in negotiation (else they travel
            # uncompressed); an aggregator's sum of them can still overflow, which raises
            # here as on the three-step path (the deferred memory resets that residual)
            payload, decoded = job.memory.encode(codec, key, x, finite=True)
        else:
            payload, decoded = codec.encode(x, name=key), None
        buf = payload.to_buffer()
    return buf, decoded


def _decode_sum_step(env: TaskEnv, job: Job, codec: Codec, bufs: Sequence[Any],
                     part: str, numel: int, extra: Any = None) -> Any:
    """Decode payloads and sum them in the given (rank) order, plus ``extra`` if given.

    An entry of ``bufs`` that is a (bytes, decoded) pair from :func:`_encode_step` with a
    decoded array is used as it is instead of being decoded again. After the first
    payload, each is added with the codec's :meth:`~hipress.codecs.Codec.decode_add`
    (one pass, no decoded temporary where the codec has a fused kernel).

    Raises:
        PayloadError: a payload does not declare exactly ``numel`` elements (the size of
            the chunk being merged), checked before it is decoded.
    """
    xp = array_module(job.flat)
    with env.timeline.span("decode+merge", gradient=job.name, partition=part,
                           payloads=len(bufs), numel=int(numel), codec=codec.name):
        acc = None
        for buf in bufs:
            if acc is None:
                v = _decoded(codec, buf, xp, numel)
                acc = v.astype(compute_dtype(v.dtype), copy=False)  # a new array: ours
            elif isinstance(buf, tuple) and buf[1] is not None:
                acc += buf[1].reshape(-1).astype(acc.dtype, copy=False)
            else:
                raw = buf[0] if isinstance(buf, tuple) else buf
                codec.decode_add(Payload.from_bytes(raw, xp=xp, numel=numel), acc)
        if extra is not None:
            acc = extra.astype(acc.dtype, copy=True) if acc is None else acc.__iadd__(extra)
    return acc


def _sparse_sum_write_step(env: TaskEnv, job: Job, codec: Codec, bufs: Sequence[Any], lo: int,
                           hi: int, part: str) -> None:
    """Sum sparse payloads in rank order straight into ``out[lo:hi]``, averaged if asked.

    The gather path of a :attr:`~hipress.codecs.Codec.sparse_payload` codec on a
    float32/float64 host output: the slice is zeroed, each payload's values are added at
    its indices (rank order, as :func:`_decode_sum_step` adds), then divided in place. No
    dense decoded array per payload: on VGG-19 with DGC those arrays alone held about
    the size of the gradients (4 ranks on 24 GiB ran out of memory). The input slice may
    be the output (``inplace``): this rank's payload was encoded from it already.

    Raises:
        PayloadError: a payload does not declare exactly ``hi - lo`` elements.
    """
    out = job.out[lo:hi]
    with env.timeline.span("decode+merge", gradient=job.name, partition=part,
                           payloads=len(bufs), numel=hi - lo, codec=codec.name):
        out.fill(0)
        for buf in bufs:
            raw = buf[0] if isinstance(buf, tuple) else buf
            codec.decode_add(Payload.from_bytes(raw, xp=np, numel=hi - lo), out)
        divisor = _divisor(env, job)
        if divisor != 1:
            np.divide(out, out.dtype.type(divisor), out=out)


def _decoded(codec: Codec, buf: Any, xp: Any, numel: int) -> Any:
    """Return the decoded payload of wire bytes, or of an (_encode_step) pair.

    Raises:
        PayloadError: the wire bytes do not declare exactly ``numel`` elements.
    """
    if isinstance(buf, tuple):
        buf, dec = buf
        if dec is not None:
            return dec.reshape(-1)
    return codec.decode(Payload.from_bytes(buf, xp=xp, numel=numel), numel=numel).reshape(-1)


def _decode_write_step(env: TaskEnv, job: Job, codec: Codec, buf: Any, lo: int, hi: int,
                       part: str) -> None:
    """Decode the final payload of ``flat[lo:hi]`` into the output, averaged if asked."""
    divisor = _divisor(env, job)
    reused = isinstance(buf, tuple) and buf[1] is not None  # only stored, not decoded
    with env.timeline.span("decode", gradient=job.name, partition=part, numel=hi - lo,
                           codec=codec.name, reused=reused):
        if reused:
            store_scaled(buf[1], job.out[lo:hi], divisor)
            return
        raw = buf[0] if isinstance(buf, tuple) else buf
        codec.decode_into(Payload.from_bytes(raw, xp=array_module(job.flat), numel=hi - lo),
                          job.out[lo:hi], divisor)


def _comm(env: TaskEnv, job: Job, part: str, kind: str, ops: List[Any]) -> Generator:
    """Yield communication ops, recording one timeline event for the wait."""
    start = env.timeline.now_us()
    sent = sum(int(o.buf.nbytes) for o in ops if isinstance(o, Send))
    res = yield ops
    env.timeline.add(kind, start, env.timeline.now_us() - start, gradient=job.name,
                     partition=part, bytes=sent)
    if sent:
        _stat(env, job.name, bytes_sent=sent)
    return res


def _merge_encode_step(env: TaskEnv, job: Job, codec: Codec, bufs: Sequence[Any], part: str,
                       numel: int, key: str, feedback: bool) -> Tuple[np.ndarray, Any]:
    """An aggregator's decode + merge of ``bufs`` and encode of the sum (with feedback).

    One fused pass where the memory and the codec offer it (onebit with residual error
    feedback on the host: :meth:`hipress.memory.ResidualMemory.merge_encode`), timed as
    one ``merge+encode`` span; else :func:`_decode_sum_step` then :func:`_encode_step`.
    Both give the same bytes.

    Returns:
        As :func:`_encode_step`.
    """
    merge_encode = getattr(job.memory, "merge_encode", None)
    if (feedback and merge_encode is not None and array_module(job.flat) is np
            and type(codec).merge_encode_residual_deferred
            is not Codec.merge_encode_residual_deferred):
        with env.timeline.span("merge+encode", gradient=job.name, partition=part,
                               payloads=len(bufs), numel=int(numel), codec=codec.name,
                               feedback=True):
            payloads = [Payload.from_bytes(b[0] if isinstance(b, tuple) else b, numel=numel)
                        for b in bufs]
            payload = merge_encode(codec, key, payloads)
            if payload is not None:
                return payload.to_buffer(), None
    merged = _decode_sum_step(env, job, codec, bufs, part, numel)
    return _encode_step(env, job, codec, merged, key, feedback, part + "@agg")


# ------------------------------------------------------------------ strategies
def ps_task(env: TaskEnv, job: Job, lo: int, hi: int, part: int, aggregator: int,
            tag: int) -> Generator:
    """CaSync-PS for one partition ``flat[lo:hi]`` aggregated by rank ``aggregator``.

    1. encode: each rank compensates its partition with its residual and encodes it;
    2. send/recv: workers send the payload to the aggregator;
    3. decode + merge: the aggregator decodes all N payloads and sums them in rank order;
    4. encode: it compensates the sum with its server residual and encodes it once;
    5. send/recv: it sends that payload to every worker;
    6. decode: every rank (the aggregator too) decodes the same bytes, then averages.
    """
    codec, N, me = job.codec, env.size, env.rank
    label = f"p{part}"
    key = f"{job.name}#{label}"
    x = job.flat[lo:hi]
    fb = job.contributes and job.memory.name != "none"
    own = yield Compute(_encode_step, (env, job, codec, x, key, fb, label))
    if me != aggregator:
        nbytes = None if codec.variable_size else codec.payload_nbytes((hi - lo,), x.dtype)
        _, final = yield from _comm(env, job, label, "send+recv", [
            Send(aggregator, own[0], tag, codec.variable_size),
            Recv(aggregator, tag + 1, nbytes)])
    else:
        nbytes = None if codec.variable_size else own[0].size
        got = yield from _comm(env, job, label, "recv", [
            Recv(r, tag, nbytes) for r in range(N) if r != me])
        bufs = list(got)
        bufs.insert(me, own)
        skey = f"{key}@agg"
        sfb = job.memory.name != "none"
        final = yield Compute(_merge_encode_step, (env, job, codec, bufs, label, hi - lo, skey,
                                                   sfb))
        yield from _comm(env, job, label, "send", [
            Send(r, final[0], tag + 1, codec.variable_size) for r in range(N) if r != me])
    yield Compute(_decode_write_step, (env, job, codec, final, lo, hi, label))
    _stat(env, job.name, payload_bytes=int(own[0].size), raw_bytes=(hi - lo) * x.dtype.itemsize)
    job.part_done()


def ps_bulk_task(env: TaskEnv, items: Sequence[Tuple[Job, int]], tag: int) -> Generator:
    """CaSync-PS for many small gradients in one task: bulk synchronization.

    Each ``(job, aggregator)`` item is one whole gradient (partition ``p0``) with the
    aggregator :func:`ps_task` would give it, and every item goes through
    :func:`ps_task`'s steps with the same residual keys and the same rank order of the
    sum, so payloads and results are bit-identical to one :func:`ps_task` per item.
    Batched is what surrounds the codec calls (after Bai et al., SOSP'21, 3.2: small
    gradients are synchronized in bulk): one compute step encodes every item, one
    message per pair of ranks carries the concatenated payloads to each aggregator (all
    payload sizes follow from the element counts), one compute step merges and
    re-encodes each aggregator's items, one message per pair carries the results back,
    one compute step decodes them all. Sent one task each, a gradient of a few KiB cost
    a scheduler hop per primitive and 2 (N - 1) messages.

    Args:
        env: the engine's task environment.
        items: (job, aggregator rank) pairs, every job on a fixed-size codec.
        tag: this task's base tag (``tag`` and ``tag + 1`` are used).
    """
    N, me = env.size, env.rank
    label = f"bulk[{len(items)}]"
    sizes = [job.codec.payload_nbytes((job.flat.size,), job.flat.dtype) for job, _ in items]
    by_agg: Dict[int, List[int]] = {}
    for i, (_, agg) in enumerate(items):
        by_agg.setdefault(agg, []).append(i)
    mine = by_agg.get(me, [])
    own = yield Compute(_bulk_encode_step, (env, items))
    got = yield from _bulk_comm(env, label, "send+recv", [
        Send(a, _concat([own[i][0] for i in idx]), tag)
        for a, idx in sorted(by_agg.items()) if a != me] + [
        Recv(r, tag, sum(sizes[i] for i in mine)) for r in range(N) if r != me and mine])
    finals: Dict[int, Any] = {}
    if mine:
        received = got[len(got) - (N - 1):]
        bufs = {i: [] for i in mine}
        for r in range(N):
            if r == me:
                for i in mine:
                    bufs[i].append(own[i])
                continue
            raw = received[r if r < me else r - 1]
            for i, piece in zip(mine, _split(raw, [sizes[i] for i in mine])):
                bufs[i].append(piece)
        finals = yield Compute(_bulk_merge_step, (env, items, mine, bufs))
    others = [a for a in sorted(by_agg) if a != me]
    got = yield from _bulk_comm(env, label, "send+recv", [
        Send(r, _concat([finals[i][0] for i in mine]), tag + 1)
        for r in range(N) if r != me and mine] + [
        Recv(a, tag + 1, sum(sizes[i] for i in by_agg[a])) for a in others])
    for a, raw in zip(others, got[len(got) - len(others):]):
        for i, piece in zip(by_agg[a], _split(raw, [sizes[i] for i in by_agg[a]])):
            finals[i] = piece
    yield Compute(_bulk_decode_step, (env, items, finals))
    for i, (job, agg) in enumerate(items):
        _stat(env, job.name, payload_bytes=sizes[i],
              raw_bytes=job.flat.size * job.flat.dtype.itemsize,
              bytes_sent=sizes[i] * ((N - 1) if agg == me else 1) if N > 1 else 0,
              bulk_calls=1)
        job.part_done()


def _bulk_encode_step(env: TaskEnv, items: Sequence[Tuple[Job, int]]) -> List[Any]:
    """:func:`_encode_step` of every item, as :func:`ps_task` encodes partition ``p0``."""
    return [_encode_step(env, job, job.codec, job.flat, f"{job.name}#p0",
                         job.contributes and job.memory.name != "none", "p0")
            for job, _ in items]


def _bulk_merge_step(env: TaskEnv, items: Sequence[Tuple[Job, int]], mine: Sequence[int],
                     bufs: Dict[int, List[Any]]) -> Dict[int, Any]:
    """The aggregator's :func:`_merge_encode_step` of each of its items (index -> result)."""
    out = {}
    for i in mine:
        job = items[i][0]
        out[i] = _merge_encode_step(env, job, job.codec, bufs[i], "p0", job.flat.size,
                                    f"{job.name}#p0@agg", job.memory.name != "none")
    return out


def _bulk_decode_step(env: TaskEnv, items: Sequence[Tuple[Job, int]],
                      finals: Dict[int, Any]) -> None:
    """:func:`_decode_write_step` of every item's final payload."""
    for i, (job, _) in enumerate(items):
        _decode_write_step(env, job, job.codec, finals[i], 0, job.flat.size, "p0")


def _bulk_comm(env: TaskEnv, label: str, kind: str, ops: List[Any]) -> Generator:
    """Yield a bulk task's communication ops, recording one timeline event for the wait."""
    start = env.timeline.now_us()
    res = yield ops
    env.timeline.add(kind, start, env.timeline.now_us() - start, gradient=label,
                     partition="p0",
                     bytes=sum(int(o.buf.nbytes) for o in ops if isinstance(o, Send)))
    return res


def _concat(bufs: Sequence[np.ndarray]) -> np.ndarray:
    """Concatenate uint8 wire buffers (one message)."""
    return bufs[0] if len(bufs) == 1 else np.concatenate(bufs)


def _split(raw: np.ndarray, sizes: Sequence[int]) -> List[np.ndarray]:
    """Cut a received message into views of ``sizes`` bytes each, in order.

    Raises:
        PayloadError: the message does not hold exactly ``sum(sizes)`` bytes.
    """
    if raw.size != sum(sizes):
        raise PayloadError(f"bulk message of {raw.size} bytes, expected {sum(sizes)} "
                           f"for {len(sizes)} payloads")
    out, o = [], 0
    for n in sizes:
        out.append(raw[o:o + n])
        o += n
    return out


def ring_task(env: TaskEnv, job: Job, lo: int, hi: int, part: int, tag: int) -> Generator:
    """CaSync-Ring for one partition ``flat[lo:hi]``.

    The partition is cut into N chunks. In step s (0 <= s < N-1) rank r sends chunk
    (r - s) mod N to rank r+1 and receives chunk (r - s - 1) mod N from rank r-1:

    1. recv the partial sum of the chunk, decode it;
    2. merge: add this rank's own chunk (compensated with this rank's residual for it);
    3. encode the new partial sum (its error becomes that residual) and send it on.

    After N-1 steps rank r holds the fully merged chunk (r + 1) mod N as a payload;
    an allgather of these payloads (no re-encode) lets every rank decode every chunk.
    """
    codec, N, me = job.codec, env.size, env.rank
    label = f"p{part}"
    x = job.flat[lo:hi]
    b = _bounds(hi - lo, N)
    nxt, prv = (me + 1) % N, (me - 1) % N
    fb = job.contributes and job.memory.name != "none"

    def chunk(j: int) -> Any:
        return x[b[j]:b[j + 1]]

    def ckey(j: int) -> str:
        return f"{job.name}#{label}c{j}"

    def nbytes(j: int) -> Optional[int]:
        return None if codec.variable_size else codec.payload_nbytes((b[j + 1] - b[j],),
                                                                     x.dtype)

    send_idx = me
    payload = yield Compute(_encode_step, (env, job, codec, chunk(send_idx), ckey(send_idx),
                                           fb, f"{label}c{send_idx}"))
    for s in range(N - 1):
        recv_idx = (me - s - 1) % N
        _, got = yield from _comm(env, job, label, "send+recv", [
            Send(nxt, payload[0], tag + s, codec.variable_size),
            Recv(prv, tag + s, nbytes(recv_idx))])
        merged = yield Compute(_decode_sum_step, (env, job, codec, [got], f"{label}c{recv_idx}",
                                                  b[recv_idx + 1] - b[recv_idx],
                                                  _own_chunk(job, chunk(recv_idx), ckey(recv_idx),
                                                             fb)))
        payload = yield Compute(_encode_step, (env, job, codec, merged, ckey(recv_idx),
                                               fb, f"{label}c{recv_idx}"))
    owned = (me + 1) % N if N > 1 else me
    finals: Dict[int, Any] = {owned: payload}
    if N > 1:
        got = yield from _comm(env, job, label, "allgather", [
            Send(r, payload[0], tag + N + 0, codec.variable_size) for r in range(N)
            if r != me] + [
            Recv(r, tag + N, nbytes((r + 1) % N)) for r in range(N) if r != me])
        others = [r for r in range(N) if r != me]
        for r, buf in zip(others, got[N - 1:]):
            finals[(r + 1) % N] = buf
    for j in range(N):
        yield Compute(_decode_write_step, (env, job, codec, finals[j], lo + b[j], lo + b[j + 1],
                                           f"{label}c{j}"))
    _stat(env, job.name, payload_bytes=int(sum(_nbytes(v) for v in finals.values())),
          raw_bytes=(hi - lo) * x.dtype.itemsize)
    job.part_done()


def _nbytes(buf: Any) -> int:
    return int((buf[0] if isinstance(buf, tuple) else buf).size)


def _own_chunk(job: Job, x: Any, key: str, feedback: bool) -> Any:
    """Return this rank's contribution to a ring hop: the chunk plus its residual.

    The residual is consumed here and re-filled by the hop's encode (same key), so each
    rank keeps exactly one residual per chunk.
    """
    if not feedback:
        return x
    c = job.memory.compensate(key, x)
    e = job.memory.get(key)
    if e is not None:
        e[...] = 0
    return c


def gather_task(env: TaskEnv, job: Job, lo: int, hi: int, part: int, parts: int,
                tag: int) -> Generator:
    """Gather path for one partition ``flat[lo:hi]`` of a sparse or variable-size codec.

    1. encode with error feedback; 2. send the payload to every other rank and receive
    theirs (sizes differ, so receives probe for the size); 3. decode all N payloads and
    sum them in rank order (value arrays of different ranks are never added element-wise
    before decoding); 4. average. Partitions of a large gradient pipeline like PS ones.
    """
    codec, N, me = job.codec, env.size, env.rank
    fb = job.contributes and job.memory.name != "none"
    label = f"p{part}" if parts > 1 else "all"
    key = f"{job.name}#{label}" if parts > 1 else job.name
    own = yield Compute(_encode_step, (env, job, codec, job.flat[lo:hi], key, fb, label))
    got = yield from _comm(env, job, label, "allgather", [
        Send(r, own[0], tag, probe=True) for r in range(N) if r != me] + [
        Recv(r, tag, None) for r in range(N) if r != me])
    bufs = list(got[N - 1:])
    bufs.insert(me, own)
    out = job.out
    if codec.sparse_payload and type(out) is np.ndarray and out.dtype == compute_dtype(out.dtype):
        yield Compute(_sparse_sum_write_step, (env, job, codec, bufs, lo, hi, label))
    else:
        total = yield Compute(_decode_sum_step, (env, job, codec, bufs, label, hi - lo))
        _write(env, job, lo, hi, total)
    _stat(env, job.name, payload_bytes=int(own[0].size),
          raw_bytes=(hi - lo) * job.flat.dtype.itemsize)
    job.part_done()


def allreduce_sum(env: TaskEnv, arr: np.ndarray, tag: int, label: str = "",
                  op: str = "sum") -> Generator:
    """Sum (or min/max/multiply: ``op``) a 1-D host array over ranks; identical bits.

    Reduce-scatter as an all-to-all of N chunks (each rank combines the chunk it owns in
    rank order, see :func:`combine_chunks`), then an allgather of the reduced chunks: the
    bytes on the wire equal a ring allreduce's, and no element is reduced twice. The
    result has ``arr``'s dtype (the caller picks one wide enough for the sum).
    """
    N, me = env.size, env.rank
    if N == 1:
        return arr.copy()
    b = _bounds(arr.size, N)
    item = arr.dtype.itemsize
    raw = np.ascontiguousarray(arr).view(np.uint8)
    mine = yield from _reduce_scatter(env, raw, [x * item for x in b], arr.dtype, op, tag)
    mine_raw = mine.view(np.uint8)
    got = yield [Send(j, mine_raw, tag + 1) for j in range(N) if j != me] + [
        Recv(i, tag + 1, (b[i + 1] - b[i]) * item) for i in range(N) if i != me]
    out = np.empty_like(arr)
    out_raw = out.view(np.uint8)
    others = [i for i in range(N) if i != me]
    for i, buf in zip(others, got[N - 1:]):
        out_raw[b[i] * item:b[i + 1] * item] = buf
    out_raw[b[me] * item:b[me + 1] * item] = mine_raw
    return out


def _reduce_scatter(env: TaskEnv, raw: np.ndarray, offs: Sequence[int], dtype: np.dtype,
                    op: str, tag: int, job: Optional[Job] = None) -> Generator:
    """Reduce-scatter of byte ranges: rank j reduces ``raw[offs[j]:offs[j+1]]`` of every rank.

    Each rank sends every other rank the range it owns, receives the N-1 copies of its
    own range and combines them in rank order (:func:`combine_chunks`). Returns this
    rank's reduced chunk (of ``dtype``). With ``job``, the messages are recorded as its
    ``reduce-scatter`` timeline event and counted in its ``bytes_sent``.
    """
    N, me = env.size, env.rank
    others = [r for r in range(N) if r != me]
    ops = [Send(j, raw[offs[j]:offs[j + 1]], tag) for j in others] + [
        Recv(i, tag, offs[me + 1] - offs[me]) for i in others]
    if job is None:
        got = yield ops
    else:
        got = yield from _comm(env, job, "all", "reduce-scatter", ops)
    parts = list(got[N - 1:])
    parts.insert(me, raw[offs[me]:offs[me + 1]])
    return (yield Compute(combine_chunks, (parts, dtype, op)))


def combine_chunks(parts: Sequence[np.ndarray], dtype: np.dtype, op: str = "sum") -> np.ndarray:
    """Reduce byte chunks viewed as ``dtype`` in the given (rank) order.

    Args:
        parts: uint8 (or ``dtype``) arrays of equal element count.
        dtype: their element type.
        op: "sum"/"average" (the sum: dividing is the caller's), "min", "max" or
            "product".

    Returns:
        The reduction, of ``dtype``. Sums and products of 16-bit floats accumulate in
        float32, of integers in 64 bits (then wrap to ``dtype`` as integer arithmetic
        does); bool sums and maxima are a logical or, minima and products a logical and.
        Min and max are exact for every dtype.
    """
    dt = np.dtype(dtype)
    if op in ("min", "max"):
        ufunc = np.minimum if op == "min" else np.maximum
        acc = parts[0].view(dt).copy()
        for p in parts[1:]:
            ufunc(acc, p.view(dt), out=acc)
        return acc
    if dt in GRADIENT_DTYPES:
        acc_dt = compute_dtype(dt)
    else:
        acc_dt = np.dtype(np.uint64) if dt.kind == "u" else np.dtype(np.int64)
    if len(parts) == 1:
        return parts[0].view(dt).copy()
    # the first operation allocates the accumulator (no separate copy of parts[0])
    ufunc = np.multiply if op == "product" else np.add
    acc = ufunc(parts[0].view(dt), parts[1].view(dt), dtype=acc_dt)
    for p in parts[2:]:
        ufunc(acc, p.view(dt), out=acc, casting="unsafe")
    return acc.astype(dt, copy=False)


def allreduce_max(env: TaskEnv, arr: np.ndarray, tag: int) -> Generator:
    """Element-wise max of a small 1-D host array over ranks (exact, identical bits)."""
    N, me = env.size, env.rank
    if N == 1:
        return arr.copy()
    raw = np.ascontiguousarray(arr).view(np.uint8)
    got = yield [Send(j, raw, tag) for j in range(N) if j != me] + [
        Recv(i, tag, raw.size) for i in range(N) if i != me]
    out = arr.copy()
    for buf in got[N - 1:]:
        np.maximum(out, buf.view(arr.dtype), out=out)
    return out


def summable_task(env: TaskEnv, job: Job, tag: int) -> Generator:
    """Compressed allreduce: drive the codec's ``reduce_stages`` with sum/max reductions.

    1. compensate with the residual (in the residual's own buffer where the memory can:
    :meth:`~hipress.memory.ResidualMemory.compensate_in_state`); 2. for each stage the
    codec yields, reduce the array across ranks (:func:`allreduce_sum` or
    :func:`allreduce_max`) and hand the result back; 3. the codec returns the reduced
    estimate (written straight into the job's output by codecs with
    :attr:`~hipress.codecs.Codec.stages_out`) and its feedback, which updates the
    residual; 4. average. Steps 1 and 3-4 are timed as ``feedback`` and ``write`` spans.
    For VGG-19's 392 MiB PowerSGD gradient this saves two fresh arrays (their page
    faults) and one pass per step. Until step 3 such a residual's buffer holds the
    compensated gradient: a stage that raises, or the task closed when the engine stops
    (:meth:`~hipress.engine.scheduler.Scheduler.abort`), drops that gradient's residual.
    """
    codec, N = job.codec, env.size
    fb = job.contributes and job.memory.name != "none"
    xp = array_module(job.flat)
    shaped = job.flat.reshape(job.shape)  # low-rank codecs need the matrix, not a vector
    x = shaped
    in_state = getattr(job.memory, "compensate_in_state", None) if fb else None
    if fb:
        with env.timeline.span("feedback", gradient=job.name, numel=int(job.flat.size)):
            x = (in_state or job.memory.compensate)(job.name, shaped)
    kw: Dict[str, Any] = {}
    if codec.stages_out and job.out is not None and job.out.dtype == job.flat.dtype:
        kw["out"] = job.out.reshape(job.shape)
    stages = codec.reduce_stages(x, job.name, N, 1.0 / _divisor(env, job), **kw)
    value: Any = None
    i = 0
    sent = 0
    try:
        while True:
            step = yield Compute(_stage_step, (env, job.name, stages, value, i, codec.name,
                                               int(job.flat.size)))
            if step[0] == "done":
                result, feedback = step[1]
                break
            arr, op = step[1]
            host = to_host(arr).reshape(-1)
            sent += host.nbytes
            start = env.timeline.now_us()
            if op == "sum":
                red = yield from allreduce_sum(env, host, tag + 2 * i)
            elif op == "max":
                red = yield from allreduce_max(env, host, tag + 2 * i)
            else:
                raise ValueError(
                    f"codec {codec.name!r} asked for reduction {op!r}; expect sum or max")
            env.timeline.add("allreduce", start, env.timeline.now_us() - start, gradient=job.name,
                             stage=i, bytes=int(host.nbytes), op=op)
            value = red.reshape(arr.shape) if xp is np else xp.asarray(red).reshape(arr.shape)
            i += 1
        if fb and feedback is not None:
            with env.timeline.span("feedback", gradient=job.name, numel=int(job.flat.size)):
                job.memory.update(job.name, x, feedback)
        elif in_state is not None:
            # sent losslessly (no feedback): all of the compensated gradient went out, so the
            # residual is zero (as before, where such a residual was never anything else)
            x[...] = 0
    except BaseException:
        # Compensated in the residual's buffer, the state holds g + e, not e: a stage that
        # raised here, or this task closed because the engine stopped (a peer's error, a
        # stall; Scheduler.abort), leaves no residual worth keeping, so it is dropped
        if in_state is not None:
            job.memory.reset(job.name)
        raise
    if result is not kw.get("out"):  # the codec did not write into the output itself
        with env.timeline.span("write", gradient=job.name, numel=int(job.flat.size)):
            _write(env, job, 0, job.flat.size, xp.asarray(result).reshape(-1), scaled=True)
    _stat(env, job.name, payload_bytes=sent, raw_bytes=job.flat.nbytes)
    job.part_done()


def _stage_step(env: TaskEnv, name: str, stages: Generator, value: Any, i: int,
                codec: str, numel: int) -> Tuple:
    """Run a codec's reduce_stages up to its next reduction (on the compute pool).

    Its timeline span (``encode`` for stage 0, then ``stage``) names the codec and the
    gradient's elements, so that a refit (:func:`hipress.secopa.profile.refit_from_timeline`)
    can price a gradient's stages together against the profile's ``stages`` fit.
    """
    with env.timeline.span("encode" if i == 0 else "stage", gradient=name, stage=i,
                           codec=codec, numel=numel):
        try:
            return ("stage", stages.send(value))
        except StopIteration as stop:
            return ("done", stop.value)


def fused_task(env: TaskEnv, jobs: Sequence[Job], tag: int) -> Generator:
    """Uncompressed allreduce of several gradients of one dtype through one fused buffer.

    1. concatenate (host); 2. :func:`allreduce_sum`; 3. split and average each (a job
    filled in after :func:`hipress.join` divides by its own ``divisor``).
    """
    N = env.size
    dtype = jobs[0].flat.dtype
    start = env.timeline.now_us()
    buf = np.concatenate([to_host(j.flat) for j in jobs]) if len(jobs) > 1 else to_host(
        jobs[0].flat)
    buf = buf.astype(dtype, copy=False)
    env.timeline.add("fuse", start, env.timeline.now_us() - start, gradients=len(jobs),
                     bytes=int(buf.nbytes))
    start = env.timeline.now_us()
    total = yield from allreduce_sum(env, buf, tag)
    env.timeline.add("allreduce", start, env.timeline.now_us() - start,
                     gradients=[j.name for j in jobs[:8]], bytes=int(buf.nbytes))
    pos = 0
    share = 2.0 * (N - 1) / N if N > 1 else 0.0
    for j in jobs:
        n = j.flat.size
        _write(env, j, 0, n, total[pos:pos + n])
        _stat(env, j.name, bytes_sent=int(j.flat.nbytes * share),
              payload_bytes=int(j.flat.nbytes), raw_bytes=int(j.flat.nbytes))
        pos += n
        j.part_done()


def direct_task(env: TaskEnv, job: Job, lo: int, hi: int, part: int, tag: int) -> Generator:
    """Uncompressed allreduce of ``flat[lo:hi]`` (float32/float64 host arrays), no copies.

    The partition is cut into N chunks; chunk j is owned by rank j.

    1. reduce-scatter: each rank sends chunk j straight from the gradient's memory to
       rank j and receives the N-1 copies of the chunk it owns;
    2. the owner sums its chunk in rank order (and divides by N for an average) directly
       into the output;
    3. allgather: the owner sends the result chunk to every rank, which receives it
       directly into its output.

    Every element is summed once, by its owner, so all ranks hold identical bits; the
    bytes on the wire equal a ring allreduce's. With an in-place job (output = input) the
    output chunk a rank owns is written only after its input was read (a copy of it is
    kept when rank order would overwrite it first).
    """
    N, me = env.size, env.rank
    x, out = job.flat[lo:hi], job.out[lo:hi]
    b = _bounds(hi - lo, N)
    item = x.dtype.itemsize
    raw = x.view(np.uint8)
    label = f"p{part}"
    others = [r for r in range(N) if r != me]
    got = yield from _comm(env, job, label, "reduce-scatter", [
        Send(j, raw[b[j] * item:b[j + 1] * item], tag) for j in others] + [
        Recv(i, tag, (b[me + 1] - b[me]) * item) for i in others])
    mine = out[b[me]:b[me + 1]]
    own = x[b[me]:b[me + 1]]
    if me >= 2 and np.shares_memory(own, mine):
        own = own.copy()
    parts = [g.view(x.dtype) for g in got[N - 1:]]
    parts.insert(me, own)
    yield Compute(_sum_into, (env, job.name, label, parts, mine, _divisor(env, job)))
    out_raw = out.view(np.uint8)
    yield from _comm(env, job, label, "allgather", [
        Send(j, out_raw[b[me] * item:b[me + 1] * item], tag + 1) for j in others] + [
        Recv(i, tag + 1, (b[i + 1] - b[i]) * item, out_raw[b[i] * item:b[i + 1] * item])
        for i in others])
    _stat(env, job.name, payload_bytes=(hi - lo) * item, raw_bytes=(hi - lo) * item)
    job.part_done()


def _sum_into(env: TaskEnv, name: str, label: str, parts: Sequence[np.ndarray],
              out: np.ndarray, divisor: int) -> None:
    """Write (parts[0] + parts[1] + ...) / divisor into out, summed in list order.

    The last addition and the division run as one pass (:func:`add_divide`), with the
    same rounding as separate NumPy passes.
    """
    with env.timeline.span("merge", gradient=name, partition=label, payloads=len(parts)):
        if len(parts) == 1:
            out[...] = parts[0]
            if divisor != 1:
                np.divide(out, out.dtype.type(divisor), out=out)
            return
        first = parts[0]
        if len(parts) > 2:
            np.add(parts[0], parts[1], out=out)
            for p in parts[2:-1]:
                out += p
            first = out
        add_divide(first, parts[-1], out, divisor)


def fused_chain_task(env: TaskEnv, buckets: Sequence[Sequence[Job]],
                     tags: Sequence[int]) -> Generator:
    """Run :func:`fused_task` for each bucket in turn (one fused buffer in flight)."""
    for bucket, tag in zip(buckets, tags):
        yield from fused_task(env, bucket, tag)


#: broadcasts of at most this many bytes go from the root straight to every rank (one
#: message step: latency, not the root's link, bounds them)
BCAST_DIRECT_BYTES = 256 * 1024
#: bytes per message of a larger broadcast's pipeline (see :func:`broadcast_task`)
BCAST_SEGMENT_BYTES = 4 << 20
#: at most this many segments per chunk: two tags each, within a task's tag range
BCAST_MAX_SEGMENTS = 256


def broadcast_task(env: TaskEnv, job: Job, root: int, tag: int, nbytes: int) -> Generator:
    """Give every rank root's bytes (``nbytes`` of them, agreed in negotiation).

    Up to :data:`BCAST_DIRECT_BYTES` (or at world size 2) the root sends the bytes to each
    rank. Larger ones are split into one chunk per non-root rank: the root sends chunk i
    to the i-th non-root only, and the non-roots allgather the chunks among themselves
    (the scatter-allgather broadcast of Barnett et al., "Interprocessor collective
    communication library (InterCom)", SHPCC 1994; Chan et al., "Collective
    communication: theory, practice, and experience", 2007, without the root in the
    allgather). Each chunk moves in segments of about :data:`BCAST_SEGMENT_BYTES`, and a
    non-root forwards segment s while it receives segment s + 1, so the root sends the
    bytes once instead of ``world size - 1`` times and every link carries about
    ``nbytes``: about ``nbytes / bandwidth`` in all, against ``(N - 1) nbytes / bandwidth``
    from the root alone.

    Non-roots receive straight into the result (a uint8 array of ``nbytes``); the root's
    result is its own bytes.

    Raises:
        PayloadError: on the root, its bytes are not the ``nbytes`` it announced (the
            array changed size between submission and start).
    """
    N, me = env.size, env.rank
    raw = None
    if me == root:
        raw = np.ascontiguousarray(to_host(job.flat)).view(np.uint8).reshape(-1)
        if raw.nbytes != nbytes:
            raise PayloadError(f"broadcast {job.name!r}: the root holds {raw.nbytes} bytes "
                               f"but announced {nbytes}; do not resize a tensor while "
                               "its broadcast is in flight")
    if N == 1:
        job.out = raw
    elif N == 2 or nbytes <= BCAST_DIRECT_BYTES:
        if me == root:
            yield from _comm(env, job, "all", "send",
                             [Send(r, raw, tag) for r in range(N) if r != root])
            job.out = raw
        else:
            (job.out,) = yield from _comm(env, job, "all", "recv", [Recv(root, tag, nbytes)])
    else:
        yield from _broadcast_pipelined(env, job, root, tag, nbytes, raw)
    job.part_done()


def _broadcast_pipelined(env: TaskEnv, job: Job, root: int, tag: int, nbytes: int,
                         raw: Optional[np.ndarray]) -> Generator:
    """:func:`broadcast_task`'s scatter-allgather in segments (world size >= 3).

    ``piece(buf, i, s)`` is segment s of chunk i (the i-th non-root's chunk) in ``buf``;
    the root sends it with tag ``tag + 2 s``, the i-th non-root forwards it to the other
    non-roots with tag ``tag + 2 s + 1``. Every chunk has the same number of segments, so
    step s of every non-root posts the same messages.
    """
    N, me = env.size, env.rank
    others = [r for r in range(N) if r != root]
    chunks = _bounds(nbytes, N - 1)
    longest = chunks[1] - chunks[0]
    segs = max(1, min(BCAST_MAX_SEGMENTS, -(-longest // BCAST_SEGMENT_BYTES)))
    cuts = [[chunks[i] + c for c in _bounds(chunks[i + 1] - chunks[i], segs)]
            for i in range(N - 1)]

    def piece(buf: np.ndarray, i: int, s: int) -> np.ndarray:
        return buf[cuts[i][s]:cuts[i][s + 1]]

    if me == root:
        yield from _comm(env, job, "all", "send", [
            Send(others[i], piece(raw, i, s), tag + 2 * s)
            for s in range(segs) for i in range(N - 1)])
        job.out = raw
        return
    i = others.index(me)
    peers = [k for k in range(N - 1) if k != i]
    out = np.empty(nbytes, dtype=np.uint8)
    for s in range(segs + 1):
        ops: List[Any] = []
        if s < segs:  # segment s of this rank's chunk, from the root
            seg = piece(out, i, s)
            ops.append(Recv(root, tag + 2 * s, seg.nbytes, seg))
        if s:  # segment s - 1 of every chunk, among the non-roots
            ops += [Send(others[k], piece(out, i, s - 1), tag + 2 * s - 1) for k in peers]
            for k in peers:
                seg = piece(out, k, s - 1)
                ops.append(Recv(others[k], tag + 2 * s - 1, seg.nbytes, seg))
        yield from _comm(env, job, "all", "recv", ops)
    job.out = out


# ------------------------------------------------------------------ other collectives
def reduce_task(env: TaskEnv, job: Job, op: str, tag: int) -> Generator:
    """Uncompressed allreduce with ``op`` "min", "max" or "product" (any collective dtype)."""
    start = env.timeline.now_us()
    host = np.ascontiguousarray(to_host(job.flat))
    red = yield from allreduce_sum(env, host, tag, op=op)
    env.timeline.add("allreduce", start, env.timeline.now_us() - start, gradient=job.name,
                     bytes=int(host.nbytes), op=op)
    _write(env, job, 0, job.flat.size, red)
    _stat(env, job.name, payload_bytes=int(host.nbytes), raw_bytes=int(host.nbytes))
    job.part_done()


def _row_elems(shape: Sequence[int]) -> int:
    """Elements per row (first-dimension slice) of an array of ``shape`` (ndim >= 1)."""
    return int(np.prod(shape[1:], dtype=np.int64)) if len(shape) > 1 else 1


def _exchange(env: TaskEnv, job: Job, label: str, send: Sequence[np.ndarray],
              recv_rows: Sequence[int], row_bytes: int, out: np.ndarray, tag: int) -> Generator:
    """Send ``send[j]`` to each rank j; receive rank i's rows into ``out``, in rank order.

    ``send`` holds uint8 arrays; ``recv_rows[i]`` rows of ``row_bytes`` come from rank i
    into consecutive slices of ``out``; this rank's own chunk is copied locally.
    """
    N, me = env.size, env.rank
    out_raw = out.view(np.uint8).reshape(-1)
    offs = np.concatenate([[0], np.cumsum([r * row_bytes for r in recv_rows])]).astype(int)
    others = [r for r in range(N) if r != me]
    yield from _comm(env, job, "all", label, [Send(j, send[j], tag) for j in others] + [
        Recv(i, tag, int(offs[i + 1] - offs[i]), out_raw[offs[i]:offs[i + 1]])
        for i in others])
    out_raw[offs[me]:offs[me + 1]] = send[me]


def allgather_task(env: TaskEnv, job: Job, rows: Sequence[int], tag: int) -> Generator:
    """Allgather: every rank gets every rank's array concatenated along dim 0, in rank order.

    ``rows[r]`` is rank r's first dimension (agreed in negotiation, so every receive is
    preposted at its exact size); trailing dimensions are equal on every rank. Sets
    ``job.out`` to ``(result, rows)``: result of shape ``(sum(rows), *shape[1:])``.
    """
    x = np.ascontiguousarray(to_host(job.flat))
    row_bytes = _row_elems(job.shape) * x.dtype.itemsize
    out = np.empty((sum(rows),) + tuple(job.shape[1:]), dtype=x.dtype)
    raw = x.view(np.uint8).reshape(-1)
    yield from _exchange(env, job, "allgather", [raw] * env.size, rows, row_bytes, out, tag)
    _stat(env, job.name, raw_bytes=int(out.nbytes))
    job.out = (out, list(rows))
    job.part_done()


def alltoall_task(env: TaskEnv, job: Job, splits: Sequence[int], recv_splits: Sequence[int],
                  tag: int) -> Generator:
    """Alltoall: rows ``splits[j]`` of this rank's array go to rank j, in order.

    Each rank receives ``recv_splits[i]`` rows from rank i (rank i's ``splits[me]``,
    agreed in negotiation) and concatenates them in source-rank order. Sets ``job.out``
    to ``(result, recv_splits)``.
    """
    x = np.ascontiguousarray(to_host(job.flat))
    row_bytes = _row_elems(job.shape) * x.dtype.itemsize
    raw = x.view(np.uint8).reshape(-1)
    so = np.concatenate([[0], np.cumsum(splits)]).astype(int) * row_bytes
    send = [raw[so[j]:so[j + 1]] for j in range(env.size)]
    out = np.empty((sum(recv_splits),) + tuple(job.shape[1:]), dtype=x.dtype)
    yield from _exchange(env, job, "alltoall", send, recv_splits, row_bytes, out, tag)
    _stat(env, job.name, raw_bytes=int(x.nbytes))
    job.out = (out, list(recv_splits))
    job.part_done()


def reducescatter_task(env: TaskEnv, job: Job, op: str, tag: int) -> Generator:
    """Reduce-scatter along dim 0: rank r gets rows ``bounds[r]:bounds[r+1]`` reduced.

    The first dimension is split as evenly as possible, the first ``dim0 % N`` ranks
    getting one row more (as Horovod). Each rank sends every other rank the rows it owns
    and reduces its own rows in rank order (:func:`combine_chunks`), then divides by the
    averaging divisor for ``"average"``. Sets ``job.out`` to the reduced rows, shape
    ``(bounds[r+1] - bounds[r], *shape[1:])``.
    """
    me = env.rank
    x = np.ascontiguousarray(to_host(job.flat))
    b = _bounds(job.shape[0], env.size)
    row_bytes = _row_elems(job.shape) * x.dtype.itemsize
    raw = x.view(np.uint8).reshape(-1)
    red = yield from _reduce_scatter(env, raw, [r * row_bytes for r in b], x.dtype, op, tag,
                                     job)
    out = np.empty((b[me + 1] - b[me],) + tuple(job.shape[1:]), dtype=x.dtype)
    store_scaled(red, out.reshape(-1), _divisor(env, job))
    _stat(env, job.name, raw_bytes=int(x.nbytes))
    job.out = out
    job.part_done()
