"""Runs CaSync task graphs as coroutines over a non-blocking transport and a compute pool.

A task graph is a Python generator. It yields the primitives it needs and is resumed with
their results:

- :class:`Send` / :class:`Recv`: point-to-point byte messages through the transport
  (:mod:`hipress.comm`: MPI ``Isend``/``Irecv``, ``Improbe`` + ``Imrecv`` when the size
  is not known in advance; or ``torch.distributed`` ``isend``/``irecv``);
- :class:`Compute`: a function (encode, decode, merge) run on the compute thread pool;
- a list of the above: all of them at once, resumed when every one has finished.

One background thread steps every active graph: while one graph waits for its send to
drain, another encodes, and the transport is polled between them, which is CaSync's
pipelining.
Graphs only use point-to-point messages with tags unique to their task, so the order in
which ranks happen to step their graphs never matters.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import logging
import threading
import time
from typing import Any, Callable, Deque, Generator, List, Optional, Set

import numpy as np

from hipress.errors import SyncError

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class Send:
    """Send ``buf`` (a uint8 NumPy array) to rank ``dest`` with ``tag``; resumes with None.

    ``probe``: the receiver does not know the size (its :class:`Recv` has ``nbytes``
    None). MPI ignores it (receivers probe); a transport that cannot probe (gloo) sends
    the size first only for such messages.
    """

    dest: int
    buf: np.ndarray
    tag: int
    probe: bool = False


@dataclasses.dataclass
class Recv:
    """Receive bytes from rank ``src`` with ``tag``; resumes with a uint8 NumPy array.

    ``nbytes`` preposts a receive of exactly that size; None probes for the size first
    (payloads of variable size). ``buf`` (a contiguous uint8 NumPy array of ``nbytes``
    bytes, e.g. a view of a result buffer) receives in place instead of into a new array.
    """

    src: int
    tag: int
    nbytes: Optional[int] = None
    buf: Optional[np.ndarray] = None


@dataclasses.dataclass
class Compute:
    """Run ``fn(*args)`` on the compute pool; resumes with its return value."""

    fn: Callable[..., Any]
    args: tuple = ()


TaskGen = Generator[Any, Any, None]


def set_os_thread_name() -> None:
    """Give the calling thread its Python name in the OS too (``top -H``, ``/proc``).

    Linux only (``prctl(PR_SET_NAME)``, 15 characters); elsewhere nothing happens.
    """
    try:
        import ctypes

        name = threading.current_thread().name.encode()[:15]
        ctypes.CDLL(None).prctl(15, ctypes.c_char_p(name), 0, 0, 0)  # 15 = PR_SET_NAME
    except (OSError, AttributeError):
        pass


class _Op:
    """One started primitive: an MPI request, a pending probe, or a future."""

    __slots__ = ("kind", "req", "buf", "msg_src", "tag", "future", "done", "result", "peer",
                 "task")

    def __init__(self, kind: str, task: _Task) -> None:
        self.kind = kind
        self.req: Any = None
        self.buf: Any = None
        self.future: Optional[concurrent.futures.Future] = None
        self.done = False
        self.result: Any = None
        self.peer = -1
        self.tag = 0
        self.msg_src = -1
        self.task = task


class _Task:
    __slots__ = ("gen", "ops", "many", "label", "since", "pending", "on_done")

    def __init__(self, gen: TaskGen, label: str,
                 on_done: Optional[Callable[[], None]] = None) -> None:
        self.gen = gen
        self.on_done = on_done
        self.ops: List[_Op] = []
        self.many = False
        self.label = label
        self.since = time.monotonic()
        self.pending = 0


class Scheduler:
    """Steps task coroutines; owned and driven by the engine's background thread.

    Progress is tested in bulk: every MPI request in flight sits in one list tested with
    a single ``MPI_Testsome`` per :meth:`poll`, and compute steps report completion
    through a callback, so a poll costs one C call plus Python work only for the
    primitives that finished (not for every task in flight).

    Args:
        tx: the transport (:class:`hipress.comm.MpiTransport` or
            :class:`hipress.torch_transport.TorchTransport`).
        compute_threads: threads for :class:`Compute` steps; 0 runs them inline (an error
            of an inline step is raised from the next :meth:`poll`, as a pool thread's is).
        wait_timeout_s: a communication primitive (send, receive, probe) that does not
            finish in this time fails its task with a :class:`SyncError` naming the peer
            rank (a dead or stuck rank). Local compute steps are not timed: a slow one (a
            loaded CPU) is progress, not a stalled peer.
        on_compute_done: called (from a compute thread) whenever a compute step finishes,
            so the driving thread can wake up.
    """

    def __init__(self, tx: Any, compute_threads: int, wait_timeout_s: float,
                 on_compute_done: Optional[Callable[[], None]] = None) -> None:
        self.tx = tx
        self.pool = None
        if compute_threads > 0:
            self.pool = concurrent.futures.ThreadPoolExecutor(
                compute_threads, thread_name_prefix="hipress-compute",
                initializer=set_os_thread_name)
        self.wait_timeout_s = wait_timeout_s
        self.tasks: Set[_Task] = set()
        self.bytes_sent = 0
        #: task-graph steps run so far (each resumption of a task coroutine): what SeCoPa's
        #: cost model charges ``step_overhead_s`` for
        self.task_steps = 0
        self._reqs: List[Any] = []
        self.extra_done: Optional[bool] = None  # see poll()
        self._req_ops: List[_Op] = []
        self._computed: Deque[_Op] = collections.deque()
        self._ready: List[_Task] = []
        self._on_compute_done = on_compute_done
        self._last_timeout_check = time.monotonic()

    def add(self, gen: TaskGen, label: str,
            on_done: Optional[Callable[[], None]] = None) -> None:
        """Start a task coroutine (it runs until its first primitive right away).

        Args:
            gen: the task graph.
            label: its name in timeouts and errors.
            on_done: called (on the driving thread, from :meth:`add` or :meth:`poll`) when
                the coroutine returns; not called when it raises (the error propagates
                and the engine stops).
        """
        task = _Task(gen, label, on_done)
        self._advance(task, None)
        if task.gen is not None:
            self.tasks.add(task)

    @property
    def busy(self) -> bool:
        """True while any task is in flight."""
        return bool(self.tasks)

    def poll(self, extra: Any = None) -> bool:
        """Test every pending primitive and resume tasks whose primitives finished.

        Args:
            extra: one more request of the transport (the negotiation round's), tested in
                the same ``test_some`` as the primitives': one pass of MPI's progress
                engine instead of two. :attr:`extra_done` then says whether it completed
                (None: it was not tested, no primitive was pending).

        Returns:
            True if any task made progress.
        """
        self._test_all(extra)
        progressed = bool(self._ready)
        while self._ready:
            ready, self._ready = self._ready, []
            for task in ready:
                results = [op.result for op in task.ops]
                self._advance(task, results if task.many else results[0])
                if task.gen is None:
                    self.tasks.discard(task)
        now = time.monotonic()
        if now - self._last_timeout_check > 0.5:
            self._last_timeout_check = now
            self._check_timeouts(now)
        return progressed

    def abort(self) -> None:
        """Close every task in flight (the engine stopped on an error) and forget them.

        Each task coroutine gets ``GeneratorExit`` at its pending ``yield``, so it runs its
        own cleanup: :func:`~hipress.engine.tasks.summable_task` drops a residual it
        compensated in place, which would otherwise be read (by ``state_dict``) as a
        residual. Primitives already posted stay in the transport's hands: their requests
        and buffers are kept, never freed under MPI.
        """
        tasks, self.tasks = list(self.tasks), set()
        for task in tasks:
            gen, task.gen = task.gen, None
            if gen is None:
                continue
            try:
                gen.close()
            except Exception:  # noqa: BLE001 - the engine's own error is the one to report
                logger.debug("task %s raised while closed", task.label, exc_info=True)

    def shutdown(self) -> None:
        """Stop the compute pool."""
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ internals
    def _check_timeouts(self, now: float) -> None:
        for task in self.tasks:
            if task.pending and now - task.since > self.wait_timeout_s:
                waiting = [op for op in task.ops if not op.done and op.kind != "compute"]
                if not waiting:  # only local compute left: slow (a loaded CPU), not stalled
                    continue
                peers = sorted({op.peer for op in waiting if op.peer >= 0})
                raise SyncError(
                    f"task {task.label} waited {now - task.since:.1f} s for "
                    f"{', '.join(op.kind for op in waiting)} with rank(s) {peers}: a rank died, "
                    "hangs, or skipped this gradient (raise sync.stall_shutdown_s if a step "
                    "legitimately takes longer)"
                )

    def _finish_op(self, op: _Op, result: Any) -> None:
        op.done = True
        op.result = result
        task = op.task
        task.pending -= 1
        if task.pending == 0:
            self._ready.append(task)

    def _test_all(self, extra: Any = None) -> None:
        """Finish every primitive that completed since the last call."""
        self.extra_done = None
        while self._computed:
            op = self._computed.popleft()
            self._finish_op(op, op.future.result())  # re-raises the step's exception
        if self._reqs:
            n = len(self._reqs)
            idx = self.tx.test_some(self._reqs if extra is None else self._reqs + [extra])
            if extra is not None:
                self.extra_done = n in idx
                idx = [i for i in idx if i < n]
            if idx:
                done = set(idx)
                for i in idx:
                    op = self._req_ops[i]
                    if op.kind == "probe":
                        op.buf = op.req.buf
                    self._finish_op(op, op.buf if op.kind != "send" else None)
                self._reqs = [r for i, r in enumerate(self._reqs) if i not in done]
                self._req_ops = [o for i, o in enumerate(self._req_ops) if i not in done]

    def compute_threads(self) -> List[threading.Thread]:
        """Return the compute pool's threads started so far (none without a pool)."""
        if self.pool is None:
            return []
        # the executor's own set: exact where names are not (a profile's scheduler names
        # its threads alike); private, but unchanged in CPython since 3.x began
        return list(self.pool._threads)

    def _advance(self, task: _Task, value: Any) -> None:
        """Resume ``task`` with ``value`` until it yields primitives that are not done."""
        while True:
            self.task_steps += 1
            try:
                req = task.gen.send(value)
            except StopIteration:
                task.gen = None
                # each _Op points back at its task: without this the pair is a reference
                # cycle that keeps the last primitives' buffers (views of the gradients,
                # receive buffers) alive until Python's cyclic GC runs, so the framework
                # cannot reuse the gradients' memory and faults in fresh pages every step
                task.ops = []
                if task.on_done is not None:
                    task.on_done()
                return
            task.many = isinstance(req, list)
            reqs = req if task.many else [req]
            task.since = time.monotonic()
            task.pending = len(reqs)
            self.tx.begin_batch()
            try:
                task.ops = [self._start(r, task) for r in reqs]
            finally:
                self.tx.end_batch()
            if task.pending:
                return
            results = [op.result for op in task.ops]
            value = results if task.many else results[0]

    def _start(self, r: Any, task: _Task) -> _Op:
        if isinstance(r, Send):
            op = _Op("send", task)
            op.peer = r.dest
            op.buf = r.buf
            op.req = self.tx.isend(r.buf, r.dest, r.tag, r.probe)
            self.bytes_sent += int(r.buf.nbytes)
            self._reqs.append(op.req)
            self._req_ops.append(op)
            return op
        if isinstance(r, Recv):
            op = _Op("recv", task)
            op.peer = r.src
            op.tag = r.tag
            if r.buf is not None or r.nbytes is not None:
                op.buf = r.buf if r.buf is not None else np.empty(int(r.nbytes), dtype=np.uint8)
                op.req = self.tx.irecv(op.buf, r.src, r.tag)
            else:
                op.kind = "probe"
                op.req = self.tx.irecv_probe(r.src, r.tag)
            self._reqs.append(op.req)
            self._req_ops.append(op)
            return op
        if isinstance(r, Compute):
            op = _Op("compute", task)
            if self.pool is None:
                try:
                    op.result = r.fn(*r.args)
                except Exception as exc:  # noqa: BLE001 - raised from poll(), as a pool's
                    # error is: the engine then tells every rank before it stops
                    op.future = concurrent.futures.Future()
                    op.future.set_exception(exc)
                    self._computed.append(op)
                    return op
                op.done = True
                task.pending -= 1
            else:
                try:
                    op.future = self.pool.submit(r.fn, *r.args)
                except RuntimeError as exc:
                    # interpreter exit (after an uncaught exception in the training
                    # script) stops the pool's threads under the engine: a HiPressError
                    # ends the engine quietly, so the script's own exception stays the
                    # cause that hipressrun reports
                    raise SyncError(f"the compute pool has stopped ({exc}): the process "
                                    "is exiting") from exc
                op.future.add_done_callback(lambda _f, op=op: self._computed_cb(op))
            return op
        raise TypeError(f"task yielded {type(r).__name__}; expect Send, Recv, Compute or a list")

    def _computed_cb(self, op: _Op) -> None:
        self._computed.append(op)  # deque.append is atomic; polled by the driving thread
        if self._on_compute_done is not None:
            self._on_compute_done()
