"""Runs CaSync task graphs as coroutines over non-blocking MPI and a compute pool.

A task graph is a Python generator. It yields the primitives it needs and is resumed with
their results:

- :class:`Send` / :class:`Recv`: point-to-point byte messages, started with ``Isend`` /
  ``Irecv`` (or ``Improbe`` + ``Imrecv`` when the size is not known in advance);
- :class:`Compute`: a function (encode, decode, merge) run on the compute thread pool;
- a list of the above: all of them at once, resumed when every one has finished.

One background thread steps every active graph: while one graph waits for its send to
drain, another encodes, and MPI is polled between them, which is CaSync's pipelining.
Graphs only use point-to-point messages with tags unique to their task, so the order in
which ranks happen to step their graphs never matters.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import time
from typing import Any, Callable, Generator, List, Optional

import numpy as np

from hipress.errors import SyncError


@dataclasses.dataclass
class Send:
    """Send ``buf`` (a uint8 NumPy array) to rank ``dest`` with ``tag``; resumes with None."""

    dest: int
    buf: np.ndarray
    tag: int


@dataclasses.dataclass
class Recv:
    """Receive bytes from rank ``src`` with ``tag``; resumes with a uint8 NumPy array.

    ``nbytes`` preposts a receive of exactly that size; None probes for the size first
    (payloads of variable size).
    """

    src: int
    tag: int
    nbytes: Optional[int] = None


@dataclasses.dataclass
class Compute:
    """Run ``fn(*args)`` on the compute pool; resumes with its return value."""

    fn: Callable[..., Any]
    args: tuple = ()


TaskGen = Generator[Any, Any, None]


class _Op:
    """One started primitive: an MPI request, a pending probe, or a future."""

    __slots__ = ("kind", "req", "buf", "msg_src", "tag", "future", "done", "result", "peer")

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.req: Any = None
        self.buf: Any = None
        self.future: Optional[concurrent.futures.Future] = None
        self.done = False
        self.result: Any = None
        self.peer = -1
        self.tag = 0
        self.msg_src = -1


class _Task:
    __slots__ = ("gen", "ops", "many", "label", "since")

    def __init__(self, gen: TaskGen, label: str) -> None:
        self.gen = gen
        self.ops: List[_Op] = []
        self.many = False
        self.label = label
        self.since = time.monotonic()


class Scheduler:
    """Steps task coroutines; owned and driven by the engine's background thread.

    Args:
        comm: the data communicator (mpi4py).
        mpi: the ``mpi4py.MPI`` module.
        compute_threads: threads for :class:`Compute` steps; 0 runs them inline.
        wait_timeout_s: a primitive that does not finish in this time fails its task with
            a :class:`SyncError` naming the peer rank (a dead or stuck rank).
    """

    def __init__(self, comm: Any, mpi: Any, compute_threads: int, wait_timeout_s: float) -> None:
        self.comm = comm
        self.mpi = mpi
        self.pool = None
        if compute_threads > 0:
            self.pool = concurrent.futures.ThreadPoolExecutor(
                compute_threads, thread_name_prefix="hipress-compute")
        self.wait_timeout_s = wait_timeout_s
        self.tasks: List[_Task] = []
        self.bytes_sent = 0

    def add(self, gen: TaskGen, label: str) -> None:
        """Start a task coroutine (it runs until its first primitive right away)."""
        task = _Task(gen, label)
        self._advance(task, None)
        if task.gen is not None:
            self.tasks.append(task)

    @property
    def busy(self) -> bool:
        """True while any task is in flight."""
        return bool(self.tasks)

    def poll(self) -> bool:
        """Test every pending primitive and resume tasks whose primitives finished.

        Returns:
            True if any task made progress.
        """
        progressed = False
        still: List[_Task] = []
        now = time.monotonic()
        for task in self.tasks:
            if self._test(task):
                progressed = True
                results = [op.result for op in task.ops]
                self._advance(task, results if task.many else results[0])
            elif now - task.since > self.wait_timeout_s:
                waiting = [op for op in task.ops if not op.done]
                peers = sorted({op.peer for op in waiting if op.peer >= 0})
                raise SyncError(
                    f"task {task.label} waited {now - task.since:.1f} s for "
                    f"{', '.join(op.kind for op in waiting)} with rank(s) {peers}: a rank died, "
                    "hangs, or skipped this gradient (raise sync.stall_timeout_s if a step "
                    "legitimately takes longer)"
                )
            if task.gen is not None:
                still.append(task)
        self.tasks = still
        return progressed

    def shutdown(self) -> None:
        """Stop the compute pool."""
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ internals
    def _advance(self, task: _Task, value: Any) -> None:
        """Resume ``task`` with ``value`` until it yields primitives that are not done."""
        while True:
            try:
                req = task.gen.send(value)
            except StopIteration:
                task.gen = None
                return
            task.many = isinstance(req, list)
            reqs = req if task.many else [req]
            task.ops = [self._start(r) for r in reqs]
            task.since = time.monotonic()
            if not self._test(task):
                return
            results = [op.result for op in task.ops]
            value = results if task.many else results[0]

    def _start(self, r: Any) -> _Op:
        MPI = self.mpi
        if isinstance(r, Send):
            op = _Op("send")
            op.peer = r.dest
            op.buf = r.buf
            op.req = self.comm.Isend([r.buf, MPI.BYTE], dest=r.dest, tag=r.tag)
            self.bytes_sent += int(r.buf.nbytes)
            return op
        if isinstance(r, Recv):
            op = _Op("recv")
            op.peer = r.src
            op.tag = r.tag
            if r.nbytes is not None:
                op.buf = np.empty(int(r.nbytes), dtype=np.uint8)
                op.req = self.comm.Irecv([op.buf, MPI.BYTE], source=r.src, tag=r.tag)
            else:
                op.kind = "probe"
            return op
        if isinstance(r, Compute):
            op = _Op("compute")
            if self.pool is None:
                op.result = r.fn(*r.args)
                op.done = True
            else:
                op.future = self.pool.submit(r.fn, *r.args)
            return op
        raise TypeError(f"task yielded {type(r).__name__}; expect Send, Recv, Compute or a list")

    def _test(self, task: _Task) -> bool:
        MPI = self.mpi
        all_done = True
        for op in task.ops:
            if op.done:
                continue
            if op.kind == "probe":
                status = MPI.Status()
                msg = self.comm.Improbe(source=op.peer, tag=op.tag, status=status)
                if msg is None:
                    all_done = False
                    continue
                op.buf = np.empty(status.Get_count(MPI.BYTE), dtype=np.uint8)
                op.req = msg.Irecv([op.buf, MPI.BYTE])
                op.kind = "recv"
            if op.kind in ("send", "recv"):
                if op.req.Test():
                    op.done = True
                    op.result = op.buf if op.kind == "recv" else None
                else:
                    all_done = False
            elif op.kind == "compute":
                if op.future.done():
                    op.result = op.future.result()  # re-raises the task's exception
                    op.done = True
                else:
                    all_done = False
        return all_done
