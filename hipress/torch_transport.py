"""The engine's messages over ``torch.distributed`` (gloo): for torchrun and DDP jobs.

Selected by ``transport: torch`` or by ``auto`` when a default process group exists or
``torchrun``'s variables are set (see :func:`hipress.comm.choose_transport`); this module,
and with it torch, is imported only then.

HiPress makes two gloo process groups over all ranks, one for the negotiation and one
for payloads, so its traffic never mixes with the user's own collectives (DDP's buckets
on the default group, NCCL or gloo). With a default group they are ``new_group`` groups of
it; without one (``hipress.init()`` first in a ``torchrun`` script) they are private
gloo groups built on torchrun's ``env://`` store, and the default group stays free for
the user's own ``init_process_group`` later.

Gloo has no probe for messages of unknown size, so a payload whose receiver does not know
its size (variable-size codecs, broadcasts: ``Send.probe``) travels as two messages, an
8-byte length (tag ``2t``) and the bytes (tag ``2t+1``; none when empty); others go as
one message on tag ``2t+1``.
Gloo matches messages of one sender and tag in order, as MPI does, so the engine's task
graphs run unchanged. CUDA payloads are staged through host memory like on MPI
(the engine encodes on the GPU and sends the compressed bytes from the host).
"""

from __future__ import annotations

import concurrent.futures
import datetime
import logging
import os
import pickle
import socket
import threading
import time
import warnings
from typing import Any, List, Optional

import numpy as np
import torch
import torch.distributed as dist

from hipress.comm import World
from hipress.errors import PeerFailure

logger = logging.getLogger(__name__)

#: usable tag bits: gloo tags are 32-bit signed, and each payload uses tags 2t and 2t+1
TAG_BITS = 29
#: gloo's own timeout on every wait; HiPress's stall policy (sync.stall_warning_s,
#: sync.stall_shutdown_s) decides when waiting is a failure, so this only bounds leaks
GROUP_TIMEOUT = datetime.timedelta(days=7)
#: private groups made so far in this process (their store keys must not repeat)
_GENERATION = 0


# a read-only NumPy buffer (a TensorFlow tensor's memory) is only read by a send
warnings.filterwarnings("ignore", message="The given NumPy array is not writable",
                        category=UserWarning)


def _tensor(buf: np.ndarray) -> torch.Tensor:
    """Return a uint8 tensor sharing ``buf``'s memory (read-only buffers too)."""
    return torch.from_numpy(buf)


def _peer_failed(exc: BaseException, what: str) -> PeerFailure:
    """Return the :class:`PeerFailure` for a gloo error: a peer's process went away."""
    return PeerFailure(
        f"{what} failed: {exc}. Another rank most likely failed (its own output and exit "
        "status, reported by torchrun, tell why); every rank stops")


def _wait_all(works: List[Any], peer: int) -> None:
    """Block until every gloo work is done (on a waiter thread).

    Raises:
        PeerFailure: a transfer failed (gloo reports a closed or reset connection).
    """
    try:
        for w in works:
            w.wait()
    except RuntimeError as exc:
        raise _peer_failed(exc, f"a transfer with rank {peer}") from exc


class _Request:
    """One send or known-size receive: its gloo works, waited for by a waiter thread."""

    __slots__ = ("future", "buf", "keep", "works", "peer")

    def __init__(self, works: List[Any], peer: int, buf: Optional[np.ndarray],
                 keep: Any) -> None:
        self.works, self.peer, self.buf, self.keep = works, peer, buf, keep
        self.future: Any = None

    def run(self) -> None:
        """Block until done (on a waiter thread)."""
        _wait_all(self.works, self.peer)

    def test(self) -> bool:
        if not self.future.done():
            return False
        self.future.result()  # re-raises a failed transfer (a peer that died)
        return True


class _ProbeRequest(_Request):
    """A receive of unknown size: the length message, then the bytes."""

    __slots__ = ("tx", "tag", "hdr", "posted")

    def __init__(self, tx: TorchTransport, src: int, tag: int) -> None:
        self.hdr = np.zeros(1, dtype=np.int64)
        with tx.lock:
            first = tx.data.recv([torch.from_numpy(self.hdr)], src, 2 * tag)
        super().__init__([first], src, None, None)
        self.tx, self.tag = tx, tag
        self.posted = False

    def post(self) -> None:
        """Wait for the length, then post the receive of the bytes."""
        if self.posted:
            return
        _wait_all(self.works, self.peer)
        self.buf = np.empty(int(self.hdr[0]), dtype=np.uint8)
        self.works = []
        if self.buf.nbytes:
            with self.tx.lock:
                self.works = [self.tx.data.recv([torch.from_numpy(self.buf)], self.peer,
                                                2 * self.tag + 1)]
        self.posted = True

    def run(self) -> None:
        """Receive the length, then the bytes (on a waiter thread)."""
        self.post()
        _wait_all(self.works, self.peer)


def _run_all(reqs: List[_Request]) -> None:
    """Wait for a batch of requests in turn (one waiter thread for a task's whole step).

    Receives of unknown size post their byte receive first: gloo completes a send only
    once its receiver has posted the matching receive, so waiting for this step's sends
    before posting would deadlock ranks that all send to each other (the gather path).
    """
    for r in reqs:
        if isinstance(r, _ProbeRequest):
            r.post()
    for r in reqs:
        r.run()


def group_allgather(group: Any, outs: List[torch.Tensor], tensor: torch.Tensor) -> Any:
    """Start an allgather of ``tensor`` into ``outs`` on ``group``; return its work."""
    return group.allgather([outs], [tensor])


class _Allgather:
    """Non-blocking allgather of byte strings on the control group: lengths, then bytes."""

    def __init__(self, group: Any, size: int, msg: bytes) -> None:
        self.group, self.size, self.msg = group, size, msg
        self.lens = [torch.zeros(1, dtype=torch.int64) for _ in range(size)]
        self.work = group_allgather(group, self.lens,
                                    torch.tensor([len(msg)], dtype=torch.int64))
        self.phase = 1

    def test(self) -> Optional[List[bytes]]:
        """Return every rank's bytes in rank order once both phases are done, else None.

        Raises:
            PeerFailure: the allgather failed (a rank's process went away).
        """
        try:
            return self._test()
        except RuntimeError as exc:
            raise _peer_failed(exc, "the negotiation allgather") from exc

    def _test(self) -> Optional[List[bytes]]:
        if self.phase == 1 and self.work.is_completed():
            self.work.wait()
            self.counts = [int(t.item()) for t in self.lens]
            width = max(max(self.counts), 1)
            mine = np.zeros(width, dtype=np.uint8)
            mine[:len(self.msg)] = np.frombuffer(self.msg, dtype=np.uint8)
            self.outs = [torch.empty(width, dtype=torch.uint8) for _ in range(self.size)]
            self.work = group_allgather(self.group, self.outs, torch.from_numpy(mine))
            self.phase = 2
        if self.phase == 2 and self.work.is_completed():
            self.work.wait()
            return [bytes(o[:c].numpy()) for o, c in zip(self.outs, self.counts)]
        return None


class TorchTransport:
    """The engine's messages over two gloo groups (see the module docstring).

    Args:
        ctrl: gloo process group of the negotiation collectives.
        data: gloo process group of point-to-point payloads.
        size: ranks in both (every rank of the job, group rank = global rank).
        registered: the groups are ``new_group`` groups of the default group (destroyed in
            :meth:`free`), not private ones.
    """

    name = "torch"
    #: waiter threads: gloo's point-to-point works report completion only from a blocking
    #: ``wait()`` (``is_completed()`` stays False and there is no future), so the messages
    #: of one task step (started between :meth:`begin_batch` and :meth:`end_batch`; the
    #: task resumes only when all are done) are waited for by one pooled thread blocked in
    #: ``wait()`` (the GIL released). Threads start as needed. More steps than this in
    #: flight queue for a thread; with receives of unknown size among them (posted by
    #: their waiter) that could deadlock, so the bound is far above the task steps a
    #: model keeps in flight (one per gradient partition).
    WAITERS = 4096

    def __init__(self, ctrl: Any, data: Any, size: int, registered: bool) -> None:
        self.ctrl, self.data, self.size = ctrl, data, size
        self.registered = registered
        self.rank = 0  # set by torch_world
        self.pool = concurrent.futures.ThreadPoolExecutor(
            self.WAITERS, thread_name_prefix="hipress-gloo")
        self.lock = threading.Lock()  # posts of sends/receives (engine and waiter threads)
        self._batch: Optional[List[_Request]] = None

    def begin_batch(self) -> None:
        """Collect the requests started until :meth:`end_batch` under one waiter."""
        self._batch = []

    def end_batch(self) -> None:
        """Hand the collected requests to one waiter thread."""
        batch, self._batch = self._batch, None
        if batch:
            future = self.pool.submit(_run_all, batch)
            for r in batch:
                r.future = future

    def _watch(self, req: _Request) -> _Request:
        if self._batch is not None:
            self._batch.append(req)
        else:
            req.future = self.pool.submit(req.run)
        return req

    def isend(self, buf: np.ndarray, dest: int, tag: int, probe: bool = False) -> _Request:
        """Start sending the uint8 array ``buf`` to ``dest`` (its length first if ``probe``)."""
        hdr = np.array([buf.nbytes], dtype=np.int64)
        with self.lock:
            works = [self.data.send([torch.from_numpy(hdr)], dest, 2 * tag)] if probe else []
            if buf.nbytes:
                works.append(self.data.send([_tensor(buf)], dest, 2 * tag + 1))
        return self._watch(_Request(works, dest, None, (hdr, buf)))

    def irecv(self, buf: np.ndarray, src: int, tag: int) -> _Request:
        """Start receiving exactly ``buf.nbytes`` bytes from ``src`` into ``buf``."""
        works = []
        if buf.nbytes:
            with self.lock:
                works.append(self.data.recv([torch.from_numpy(buf)], src, 2 * tag + 1))
        return self._watch(_Request(works, src, buf, None))

    def irecv_probe(self, src: int, tag: int) -> _ProbeRequest:
        """Start receiving a message of unknown size; its ``buf`` is set on completion."""
        return self._watch(_ProbeRequest(self, src, tag))

    def test_some(self, reqs: List[Any]) -> List[int]:
        """Return the indices of the requests in ``reqs`` that completed."""
        return [i for i, r in enumerate(reqs) if r.test()]

    def iallgather_bytes(self, msg: bytes) -> _Allgather:
        """Start gathering every rank's ``msg``; ``.test()`` returns them in rank order."""
        return _Allgather(self.ctrl, self.size, msg)

    def gather_all(self, obj: Any) -> List[Any]:
        """Return every rank's picklable ``obj`` in rank order (blocking)."""
        ag = self.iallgather_bytes(pickle.dumps(obj))
        while True:
            got = ag.test()
            if got is not None:
                return [pickle.loads(b) for b in got]
            time.sleep(0.001)

    def gather_object(self, obj: Any, root: int = 0) -> Optional[List[Any]]:
        """Gather picklable objects at ``root`` (blocking; the trace at shutdown)."""
        got = self.gather_all(obj)
        return got if self.rank == root else None

    def free(self) -> None:
        """Destroy HiPress's groups (and the default group if HiPress created it)."""
        self.pool.shutdown(wait=False)
        if self.registered and dist.is_initialized():
            for group in (self.ctrl, self.data):
                try:
                    dist.destroy_process_group(group)
                except Exception:  # noqa: BLE001 - best effort at shutdown
                    pass


def torch_world() -> World:
    """Return the process group of a torch.distributed job.

    With a default process group, HiPress's two gloo groups are ``new_group`` groups of it
    (every rank calls ``hipress.init()``, so every rank creates them in the same order).
    Without one, they are private gloo groups on the ``env://`` store of ``RANK``,
    ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` (torchrun's agent store), leaving
    the default group to the user. Ranks are grouped into hosts by hostname for
    ``local_rank``, ``local_size``, ``cross_rank`` and ``cross_size``.

    Raises:
        ConfigError: torch.distributed is unavailable, or there is no default group and
            torchrun's variables are missing.
    """
    from hipress.errors import ConfigError

    if not dist.is_available():
        raise ConfigError("transport 'torch' needs torch.distributed, which this torch build "
                          "lacks; use transport: mpi")
    registered = dist.is_initialized()
    if registered:
        rank, size = dist.get_rank(), dist.get_world_size()
        ctrl = dist.new_group(backend="gloo", timeout=GROUP_TIMEOUT)
        data = dist.new_group(backend="gloo", timeout=GROUP_TIMEOUT)
    else:
        missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
                   if not os.environ.get(k)]
        if missing:
            raise ConfigError(
                f"transport 'torch' found no torch.distributed process group and "
                f"{', '.join(missing)} not set: start the job with torchrun, or call "
                "torch.distributed.init_process_group() before hipress.init()")
        global _GENERATION
        _GENERATION += 1  # every rank inits as often: a fresh key space per init
        store, rank, size = next(dist.rendezvous("env://", timeout=GROUP_TIMEOUT))
        prefix = f"hipress/{_GENERATION}/"
        ctrl = dist.ProcessGroupGloo(dist.PrefixStore(prefix + "ctrl/", store), rank, size,
                                     GROUP_TIMEOUT)
        data = dist.ProcessGroupGloo(dist.PrefixStore(prefix + "data/", store), rank, size,
                                     GROUP_TIMEOUT)
    tx = TorchTransport(ctrl, data, size, registered)
    tx.rank = rank
    hosts = tx.gather_all(socket.gethostname())
    same = [r for r in range(size) if hosts[r] == hosts[rank]]
    local_rank, local_size = same.index(rank), len(same)
    local_ranks = [[r for r in range(size) if hosts[r] == hosts[q]].index(q) for q in range(size)]
    peers = [r for r in range(size) if local_ranks[r] == local_rank]
    counts = {h: hosts.count(h) for h in hosts}
    world = World(rank=rank, size=size, local_rank=local_rank, local_size=local_size,
                  ctrl=None, data=None, tag_bits=TAG_BITS, mpi=None,
                  cross_rank=peers.index(rank), cross_size=len(peers),
                  homogeneous=len(set(counts.values())) == 1, tx=tx)
    logger.debug("torch.distributed world: rank %d of %d (local %d of %d), groups %s",
                 rank, size, local_rank, local_size,
                 "of the default group" if registered else "private (env:// store)")
    return world
