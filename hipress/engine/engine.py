"""The CaSync engine: negotiation by name, planning per gradient, a background thread.

User threads call :meth:`Engine.submit`, which resolves the gradient's codec from the
policy and queues it; it never touches MPI. One background thread owns MPI:

1. *Negotiation* — every cycle (up to ``sync.max_cycle_time_ms`` while less than a
   partition's worth of bytes is queued) each rank contributes the names it has newly
   submitted (with numel, dtype, codec and op) to a non-blocking allgather on the control
   communicator. Every rank thus sees the same table and starts a gradient once every
   rank has submitted it, in an order all ranks derive identically (the round in which
   it became ready, then rank 0's submission order). Submission order and hash seeds of
   individual ranks never matter. Mismatched metadata and stalls are detected from the
   same table, so every rank raises the same error in the same round.
2. *Planning* — the gradient's path: uncompressed (fused with other small gradients),
   compressed allreduce (summable codecs), gather (variable-size payloads), CaSync-PS or
   CaSync-Ring, split into partitions (round-robin aggregators for PS).
3. *Execution* — the task graphs of :mod:`hipress.engine.tasks`, stepped by the
   :class:`~hipress.engine.scheduler.Scheduler` so that encoding one partition overlaps
   the communication of another and gradients submitted during the backward pass start
   at once.
"""

from __future__ import annotations

import collections
import fnmatch
import functools
import json
import logging
import math
import os
import threading
import time
import zlib
from typing import Any, Deque, Dict, List, Optional, Tuple

import numpy as np

from hipress.backend import (
    CODE_DTYPES,
    DTYPE_CODES,
    array_module,
    check_collective_dtype,
    check_gradient_dtype,
    compute_dtype,
    dtype_code,
    to_host,
)
from hipress.codecs import Codec, get_codec
from hipress.config import summarize_effective
from hipress.engine import tasks as T
from hipress.engine.blas import limit_numpy_blas
from hipress.engine.planning import FixedPolicy, GradientPlanner
from hipress.engine.scheduler import Scheduler, set_os_thread_name
from hipress.errors import (
    CollectiveArgumentError,
    ConfigError,
    HiPressError,
    PeerFailure,
    StallError,
    SyncError,
)
from hipress.memory import Memory, ResidualMemory, get_memory
from hipress.timeline import Timeline, write_trace

logger = logging.getLogger(__name__)

STRATEGIES = ("ps", "ring", "allreduce", "gather")
#: reduction ops of allreduce and reducescatter; codecs apply to the first two only
OPS = ("average", "sum", "min", "max", "product")
#: collectives other than allreduce and broadcast (whose argument checks differ); argument
#: errors of every kind fail the handle on every rank (CollectiveArgumentError), and the
#: engine goes on
_DATA_KINDS = ("allgather", "alltoall", "reducescatter")
#: negotiation metadata of one submission, after its name (see _make_message)
_META_KEYS = ("numel", "dtype", "codec", "op", "kind", "root", "strategy", "partitions",
              "shape", "finite", "extra", "filler")
#: the ``codec`` argument that applies the job's compression policy (what the optimizer
#: wrappers, DDP hooks and trainers pass); ``None`` means exact, a name means that codec
POLICY = "auto"
_SUB_BITS = 12  # tags per task: ring steps and allgather need world_size + 2
#: uncompressed gradients of at least this size are reduced in place, not fused
_DIRECT_MIN_BYTES = 1 << 20
#: partition size of such in-place reductions (pipelines large gradients)
_DIRECT_PARTITION_BYTES = 16 << 20
_DIRECT_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))
#: compressed PS gradients of at most this size that need one partition are synchronized
#: in bulk, many per task (tasks.ps_bulk_task), up to sync.partition_bytes of them
BULK_MAX_BYTES = 256 << 10
#: MPI polling back-off while transfers are in flight (each wake-up costs CPU that the
#: training step needs; compute steps wake the thread at once, they are not polled).
#: While a thread of this rank waits for a result (:meth:`Handle.wait`) the step is
#: blocked on the engine: for _SPIN_S after progress (a finished primitive, a processed
#: round) it polls back to back, yielding the CPU in between (a peer on this host answers
#: within tens of us), then every _POLL_MIN_S.
_POLL_MIN_S = 0.0005
_POLL_MAX_S = 0.004
_SPIN_S = 0.0003
#: small uncompressed gradients ready on every rank are held until this many bytes of them
#: can go in one fused allreduce, or a rank waits for a result (Engine._release_fused)
FUSION_HOLD_BYTES = 1 << 20
#: longest interval between negotiation rounds while no rank has new names
_IDLE_ROUND_MAX_S = 0.05


#: orders a handle's completion against a waiter creating its event (see Handle._block)
_HANDLE_LOCK = threading.Lock()


class Handle:
    """Completion handle of an asynchronous operation (``allreduce_async``, ``broadcast``).

    Use :func:`hipress.synchronize` (or :meth:`wait`) to get the result.
    """

    __slots__ = ("name", "_done", "_event", "_result", "_error", "_engine")

    def __init__(self, name: str) -> None:
        self.name = name
        self._done = False
        #: created by the first :meth:`wait` that has to block (most handles never need
        #: one: a step submits a hundred gradients and waits on them in turn, and all but
        #: the first are usually done by then; an Event per handle cost a fifth of the
        #: submission time)
        self._event: Optional[threading.Event] = None
        self._result: Any = None
        self._error: Optional[BaseException] = None
        #: the engine that runs the operation (set when it is queued): a rank waiting for
        #: a result tells it so (see :meth:`Engine.flush`)
        self._engine: Optional[Engine] = None

    def done(self) -> bool:
        """Return True once the result (or an error) is available."""
        if self._done:
            return True
        if self._engine is not None:
            self._engine.flush()  # polled: held small gradients start in the next round
        return False

    def _block(self, timeout: Optional[float]) -> bool:
        """Wait until :meth:`_finish` ran or ``timeout`` s passed; True once finished."""
        with _HANDLE_LOCK:
            if self._done:
                return True
            if self._event is None:
                self._event = threading.Event()
            event = self._event
        return event.wait(timeout)

    def wait(self, timeout: Optional[float] = None) -> Any:
        """Block until done and return the result.

        Raises:
            SyncError: the synchronization failed (the cause is chained), or ``timeout``
                seconds passed.
        """
        eng = self._engine
        if self._done:
            finished = True
        elif eng is not None:
            with eng._waiting_lock:
                eng._waiting += 1
            eng.flush()
            try:
                finished = self._block(timeout)
            finally:
                with eng._waiting_lock:
                    eng._waiting -= 1
        else:
            finished = self._block(timeout)
        if not finished:
            raise SyncError(f"timed out after {timeout} s waiting for {self.name!r}")
        if self._error is not None:
            raise self._error
        return self._result

    def _finish(self, result: Any = None, error: Optional[BaseException] = None) -> None:
        self._result, self._error = result, error
        with _HANDLE_LOCK:
            self._done = True
            event = self._event
        if event is not None:
            event.set()


class _Submission:
    """One queued operation; ``metas`` is every rank's negotiation entry once ready."""

    __slots__ = ("name", "array", "average", "op", "codec", "codec_key", "strategy",
                 "contributes", "handle", "kind", "root", "seq", "partitions", "inplace",
                 "extra", "dtype_ok", "filler", "metas", "divisor")

    def __init__(self, **kw: Any) -> None:
        self.extra: Any = None
        self.dtype_ok = True
        self.filler = False
        self.metas: List[list] = []
        self.divisor = 0
        for k, v in kw.items():
            setattr(self, k, v)


class Engine:
    """Compression-aware gradient synchronization over MPI (one per process).

    Args:
        config: a :class:`hipress.config.HiPressConfig`.
        world: the :class:`hipress.comm.World` to run in.
        planner: decides compress / partitions / path per gradient
            (:class:`hipress.engine.planning.GradientPlanner`); None means the fixed
            policy, :class:`~hipress.engine.planning.FixedPolicy`.

    Raises:
        ConfigError: ``sync.plan`` asks for a plan but no planner was given.
    """

    def __init__(self, config: Any, world: Any,
                 planner: Optional[GradientPlanner] = None) -> None:
        self.cfg = config
        self.world = world
        self.rank, self.size = world.rank, world.size
        path = str(config.timeline) if config.timeline else None
        if path and "{rank}" in path:
            path = path.format(rank=self.rank)
        self.timeline = Timeline(bool(path), self.rank, path)
        if path and (self.rank == 0 or "{rank}" in str(config.timeline)):
            # other ranks append from their first flush on, which comes after the first
            # negotiation round, so after rank 0 has started the file here
            self.timeline.create_file()
        self.stats_table: Dict[str, Dict[str, Any]] = {}
        self.env = T.TaskEnv(self.rank, self.size, self.timeline, self.stats_table)
        self.step_count = 0
        #: (engine CPU seconds, task steps) at the last step, for the timeline's engine-cpu
        self._cpu_mark: Tuple[float, int] = (0.0, 0)
        self._codecs: Dict[str, Codec] = {}
        self._warned: set = set()
        self._warned_local = False
        self._warned_uncompressed = False
        self._acct: Dict[str, Any] = {}  # bytes asked/compressed this step (see _account)
        self._ratios: Dict[Any, float] = {}
        self._code_compression: Dict[str, str] = {}  # source -> codec (see note_compression)
        sync = config.sync
        # one watch per thing that can stall: a negotiation round, a name some ranks never
        # submit (rank 0), this rank's goodbye waiting for the others'
        self._round_watch = _StallWatch(sync.stall_warning_s, sync.stall_limit_s)
        self._name_watch = _StallWatch(sync.stall_warning_s, sync.stall_limit_s)
        self._bye_watch = _StallWatch(sync.stall_warning_s, sync.stall_limit_s)
        self._bye_since: Optional[float] = None
        #: this rank shut down while others still waited for its gradients (see _check_byes)
        self._left_early = False
        #: the engine failed on every rank in the same round with nothing in flight
        self._collective_error = False
        #: this rank gave up waiting for the others' goodbye (_wait_for_byes): its own
        #: error, not the others' (they may still be running, e.g. waiting in join())
        self._bye_stalled = False
        self._announced = False
        self._memories: Dict[str, Memory] = {"none": get_memory("none")}
        #: per gradient, the (path, partitions) its residuals are kept for (_fit_state)
        self._layouts: Dict[str, Tuple[str, int]] = {}
        self._warned_regroup = False
        self._lock = threading.Lock()
        self._queue: Deque[_Submission] = collections.deque()
        self._queued_bytes = 0  # bytes of the queue: a partition's worth starts a round
        self._inflight: Dict[str, _Submission] = {}
        self._seq = 0
        self._error: Optional[BaseException] = None
        self._local_error: Optional[BaseException] = None
        self._shutdown = threading.Event()
        self._wake = threading.Event()
        # negotiation state (background thread only)
        self._table: Dict[str, Dict[str, Any]] = {}
        self._round = 0
        self._task_id = 0
        self._pending_local: Dict[str, _Submission] = {}
        # join (see join/_joined_fill): this rank's pending join, and the round in which
        # each rank was first seen joined (to name the last one)
        self._join_handle: Optional[Handle] = None
        self._join_round: Dict[int, int] = {}
        self._outbox: List[list] = []
        self._poke = threading.Event()  # wakes the engine thread: new work or a finished step
        #: a rank waits for or polls a result: start the next round now and say "flush"
        #: in its message (cleared by _make_message)
        self._flush_once = False
        self._waiting = 0  # threads blocked in Handle.wait on this rank
        self._waiting_lock = threading.Lock()
        #: small uncompressed gradients ready on every rank, held for one fused allreduce
        #: (dtype -> jobs, in agreed order) until enough bytes or a rank waits (_release_fused)
        self._fuse_pending: Dict[Any, List[T.Job]] = collections.OrderedDict()
        self._fuse_pending_bytes = 0
        self._sleeping_long = True  # the engine thread sleeps longer than a poll interval
        self._sched = Scheduler(world.tx, config.sync.compute_threads,
                                config.sync.stall_limit_s, on_compute_done=self._poke.set)
        # tags: a task id in the high bits, _SUB_BITS for the messages of one task; ids
        # still held by running tasks are never handed out again (see _launch)
        self._tag_task_bits = world.tag_bits - _SUB_BITS
        if self.size > 1 and self._tag_task_bits < 0:
            raise HiPressError(
                f"this MPI's tag upper bound allows only {world.tag_bits} bits "
                f"(MPI_TAG_UB < {1 << _SUB_BITS}) but HiPress needs {_SUB_BITS} bits of tag "
                "per task; the MPI standard guarantees MPI_TAG_UB >= 32767, so this MPI does "
                "not conform: use Open MPI or MPICH"
            )
        self._tids_busy: set = set()
        self._held: Deque[Tuple[int, Any, str]] = collections.deque()
        self._warned_tags = False
        # the planner (sync.plan): collective on every rank, before the engine thread starts
        if planner is None:
            if str(config.sync.plan).strip().lower() != "none":
                raise ConfigError(
                    f"sync.plan={config.sync.plan!r} needs SeCoPa's planner, which "
                    "hipress.init() builds: start HiPress with hipress.init(), or pass "
                    "planner=hipress.secopa.PlanFollower(config, world, build_codec)")
            planner = FixedPolicy(config)
        self._plan: GradientPlanner = planner
        self._plan.setup()
        if self.size + 2 > (1 << _SUB_BITS):
            raise HiPressError(f"world size {self.size} exceeds {(1 << _SUB_BITS) - 2}")
        self._thread = threading.Thread(target=self._run, name="hipress-engine", daemon=True)
        #: restores NumPy's BLAS thread count at shutdown (see hipress.engine.blas)
        self._restore_blas = limit_numpy_blas(0)  # nothing to restore yet
        if self.size > 1:  # with one rank nothing travels: no thread, no MPI (see _local)
            self._restore_blas = limit_numpy_blas(config.sync.blas_threads)
            self._thread.start()

    # ------------------------------------------------------------------ user side
    def submit(self, array: Any, name: str, op: str = "average", codec: Any = None,
               strategy: Optional[str] = None, contributes: bool = True,
               inplace: bool = False) -> Handle:
        """Queue an allreduce of ``array`` under ``name``; see :func:`hipress.allreduce_async`."""
        sub, handle = self._allreduce_sub(array, name, op, codec, strategy, contributes,
                                          inplace)
        if sub is not None:
            self._enqueue(sub)
        return handle

    def submit_group(self, arrays: List[Any], names: List[str], op: str = "average",
                     codec: Any = None, inplace: bool = False) -> List[Handle]:
        """Queue allreduces in one negotiation round (:func:`hipress.grouped_allreduce_async`).

        Raises:
            ValueError: ``arrays`` and ``names`` differ in length, or a name repeats.
        """
        if len(arrays) != len(names):
            raise ValueError(f"grouped allreduce got {len(arrays)} tensors but {len(names)} "
                             "names; pass one name per tensor")
        if len(set(names)) != len(names):
            raise ValueError(f"grouped allreduce names must be unique, got {names}")
        made = [self._allreduce_sub(a, n, op, codec, None, True, inplace)
                for a, n in zip(arrays, names)]
        subs = [sub for sub, _ in made if sub is not None]
        for sub in subs:  # ranks that group different tensors disagree (_process_round)
            sub.extra = {"group": len(names), "gid": names[0]}
        if subs:
            self._enqueue(*subs)
        return [handle for _, handle in made]

    def _allreduce_sub(self, array: Any, name: str, op: str, codec: Any,
                       strategy: Optional[str], contributes: bool,
                       inplace: bool) -> Tuple[Optional[_Submission], Handle]:
        """Validate an allreduce and build its submission (None at world size 1: done)."""
        self._check_alive()
        _check_name_op(name, op, "gradient")
        if strategy is not None and strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES} or None, got {strategy!r}")
        if (isinstance(codec, str) and codec == "none") or (
                isinstance(codec, Codec) and codec.name == "none"):
            codec = None  # the identity codec is no codec: exact, any collective dtype
        try:
            if codec is None:
                dt = check_collective_dtype(array.dtype, f"tensor {name!r}")
                _check_op_dtype(op, dt, name)
            else:
                if op not in ("average", "sum"):
                    raise ValueError(
                        f"op={op!r} runs uncompressed only (codecs compress sums); pass "
                        f"codec=None for {name!r}, or use op='sum'/'average'")
                check_gradient_dtype(array.dtype, f"gradient {name!r}")
        except (TypeError, ValueError) as exc:
            # the other ranks may have submitted a valid tensor under this name: they fail
            # in the same round instead of stalling
            self._refuse(array, name, op, str(exc))
            raise
        inplace = bool(inplace) and _writable_contiguous(array)
        if codec is not None:
            self._announce()
        if self.size == 1:
            return None, self._local(array, name, codec, inplace)
        cobj, key, why = self._resolve_codec(name, array, codec)
        strategy = strategy or self.cfg.sync.strategy
        parts = None
        if cobj is not None and self._plan.active:
            compress, parts, strategy = self._plan.decide(name, array, cobj, strategy)
            if not compress and codec == POLICY:  # an explicit codec is always honoured
                cobj, key, parts, why = None, "none", None, "plan"
            elif not compress:
                parts = None
                if "plan-explicit" not in self._warned:
                    self._warned.add("plan-explicit")
                    if self.rank == 0:
                        logger.warning(
                            "SeCoPa plan (sync.plan=%r) leaves %r uncompressed, but the code "
                            "asks for codec %r explicitly, which is always honoured: every "
                            "gradient the plan leaves uncompressed is compressed anyway. To "
                            "let the plan decide, put the codec in the config "
                            "(compression.algorithm) and pass compression=None (the "
                            "optimizer's default) or codec='auto'", self.cfg.sync.plan, name,
                            codec if isinstance(codec, str) else getattr(cobj, "name", codec))
        self._account(array, codec, cobj, key, why)
        sub = _Submission(name=name, array=array, average=(op == "average"), op=op, codec=cobj,
                          codec_key=key, strategy=strategy,
                          contributes=bool(contributes), handle=Handle(name), kind="allreduce",
                          root=-1, seq=0, partitions=parts, inplace=inplace)
        return sub, sub.handle

    def _refuse(self, array: Any, name: str, op: str, error: str) -> None:
        """Tell the other ranks that this rank refused the allreduce ``name`` (``error``).

        The caller raises at once; the other ranks may have submitted a valid tensor under
        the name (another dtype), so a stand-in submission carrying the error travels in
        negotiation and fails their handles with
        :class:`~hipress.errors.CollectiveArgumentError` instead of leaving them waiting.
        """
        if self.size == 1:
            return
        with self._lock:
            if name in self._inflight:
                return  # the duplicate-name error is the caller's to see
        if np.dtype(array.dtype) not in DTYPE_CODES:
            # the dtype itself was refused: the stand-in carries only the error, so give it
            # one that negotiation can describe (its data never travels)
            array = np.empty(0, np.float32)
        sub = _Submission(name=name, array=array, average=False, op=op, codec=None,
                          codec_key="none", strategy=None, contributes=True,
                          handle=Handle(name), kind="allreduce", root=-1, seq=0,
                          partitions=None, inplace=False)
        sub.extra = {"error": error}
        self._enqueue(sub)

    def _local(self, array: Any, name: str, codec: Any, inplace: bool) -> Handle:
        """World size 1: nothing travels, so the result is the input, exactly.

        Compression exists to cut the bytes on the wire; with one rank there is no wire,
        so no codec runs, no residual changes and no thread is involved: the handle is
        complete on return (``array`` itself when ``inplace``, else a copy). The sum and
        the average over one rank are both the array.
        """
        self._resolve_codec(name, array, codec)  # validates the codec name/params
        if not self._warned_local and self.rank == 0:
            self._warned_local = True
            logger.info("world size 1: gradients are returned as they are (nothing travels, "
                        "so no codec runs and no residual changes)")
        st = self.stats_table.setdefault(name, {})
        st["calls"] = st.get("calls", 0) + 1
        st["numel"] = int(array.size)
        st["codec"] = "none"
        st["strategy"] = "local"
        handle = Handle(name)
        handle._finish(array if inplace else array_module(array).array(array, copy=True))
        return handle

    def broadcast(self, array: Any, root: int, name: str, check: bool = False) -> Handle:
        """Queue a broadcast of root's ``array`` (bytes on non-roots may be anything).

        ``check``: every rank's ``array`` is a tensor the result goes into, so ranks must
        agree on its shape and dtype; when they do not, every rank's handle fails with
        :class:`~hipress.errors.CollectiveArgumentError` (as Horovod refuses mismatched
        broadcasts). False for byte payloads whose size only the root knows (objects).
        """
        self._check_alive()
        if not 0 <= root < self.size:
            raise ValueError(f"root rank {root} is outside [0, {self.size})")
        if self.size == 1:
            handle = Handle(name)
            handle._finish(np.ascontiguousarray(to_host(array)).view(np.uint8).reshape(-1))
            return handle
        # bytes of any dtype travel (complex, big-endian): the wire code is only
        # descriptive here, 0 for a dtype a payload cannot name
        sub = _Submission(name=name, array=array, average=False, op="sum", codec=None,
                          codec_key="bcast",
                          strategy="bcast", contributes=True, handle=Handle(name),
                          kind="broadcast", root=root, seq=0, partitions=None, inplace=False,
                          dtype_ok=np.dtype(array.dtype) in DTYPE_CODES)
        if check:
            sub.extra = {"shape": [int(d) for d in array.shape], "dtype": str(array.dtype)}
        self._enqueue(sub)
        return sub.handle

    def collective(self, kind: str, array: Any, name: str, op: str = "sum",
                   splits: Optional[List[int]] = None) -> Handle:
        """Queue an allgather, alltoall or reducescatter (uncompressed, exact).

        Args:
            kind: "allgather", "alltoall" or "reducescatter".
            array: NumPy or CuPy array with at least one dimension, of a dtype in
                :data:`hipress.backend.COLLECTIVE_DTYPES`.
            name: identical on every rank, unique among outstanding operations.
            op: reducescatter's reduction (:data:`OPS`).
            splits: alltoall only: rows of ``array`` for each rank (None: equal parts).

        Returns:
            A handle whose result is ``(array, rows)`` for allgather and alltoall (rows
            received from each rank, in rank order) and the array for reducescatter.

        Arguments that are wrong on one rank (splits that do not add up, trailing
        dimensions that differ across ranks, ...) fail the handle on every rank with a
        :class:`~hipress.errors.CollectiveArgumentError` in the same round, before any
        data moves; an op/dtype pair that can never work raises here at once.
        """
        self._check_alive()
        if kind not in _DATA_KINDS:
            raise ValueError(f"kind must be one of {_DATA_KINDS}, got {kind!r}")
        _check_name_op(name, op, "collective")
        shape = [int(d) for d in getattr(array, "shape", ())]
        try:
            dt = check_collective_dtype(array.dtype, f"{kind} tensor {name!r}")
            if kind == "reducescatter":
                _check_op_dtype(op, dt, name)
            error = None
        except TypeError as exc:
            dt, error = None, str(exc)
        if error is None and not shape:
            error = (f"{kind} needs an array with at least one dimension (it works along "
                     "dimension 0); reshape a scalar to (1,)")
        extra: Any = None
        if kind == "alltoall" and error is None:
            extra = _check_splits(splits, shape[0], self.size)
            if isinstance(extra, str):
                extra, error = None, extra
        if self.size == 1:
            if error is not None:
                raise CollectiveArgumentError(f"{kind} {name!r} on rank 0: {error}")
            handle = Handle(name)
            out = array_module(array).array(array, copy=True)
            handle._finish(out if kind == "reducescatter" else (out, [shape[0]]))
            return handle
        if error is not None:
            extra = {"error": error}
        sub = _Submission(name=name, array=array, average=(op == "average"), op=op, codec=None,
                          codec_key="none", strategy=kind, contributes=True,
                          handle=Handle(name), kind=kind, root=-1, seq=0, partitions=None,
                          inplace=False, extra=extra, dtype_ok=dt is not None)
        self._enqueue(sub)
        return sub.handle

    def join(self) -> Handle:
        """Say this rank has no more data; see :func:`hipress.join`.

        Returns:
            A handle whose result is the rank that joined last (of ranks that joined in
            the same negotiation round, the highest), the same on every rank.

        Raises:
            ValueError: this rank's previous ``join`` has not completed.
        """
        self._check_alive()
        handle = Handle("__join__")
        if self.size == 1:
            handle._finish(0)
            return handle
        with self._lock:
            if self._join_handle is not None:
                raise ValueError("join() was called again before the previous join completed")
            self._join_handle = handle
        self._wake.set()
        self._poke.set()
        return handle

    def step(self) -> None:
        """Count a finished training step (warm-up steps run uncompressed).

        Also checks that compression asked for in this step did run (see
        :meth:`_check_compressed`), then tells the planner (``step_done``: SeCoPa's
        ``sync.plan: auto`` plans here once, collectively, from the steps it observed).
        """
        self._announce()
        if self.step_count >= self.cfg.compression.warmup_steps:
            self._check_compressed()
        if self.timeline.enabled:
            self._record_engine_cpu()
        self.step_count += 1
        self._plan.step_done(self)

    def _record_engine_cpu(self) -> None:
        """Record the engine's CPU time and task steps since the last step (timeline on).

        One ``engine-cpu`` event per training step, at its end, with ``cpu_s`` (CPU
        seconds of the engine thread and its compute pool's threads) and ``task_steps``
        (task-graph steps run, :attr:`Scheduler.task_steps`) since the previous one:
        SeCoPa's refit (``hipress profile --from-timeline``) takes the engine's cost per
        task step from them.
        """
        threads = [self._thread] + self._sched.compute_threads()
        cpu = 0.0
        for th in threads:
            if th.ident is None or not th.is_alive():
                continue
            try:
                cpu += time.clock_gettime(time.pthread_getcpuclockid(th.ident))
            except (OSError, AttributeError):  # a thread that just ended; not on Linux
                continue
        steps = self._sched.task_steps
        last_cpu, last_steps = self._cpu_mark
        self._cpu_mark = (cpu, steps)
        self.timeline.add("engine-cpu", self.timeline.now_us(), 0.0, step=self.step_count,
                          cpu_s=round(cpu - last_cpu, 6), task_steps=steps - last_steps)

    def note_compression(self, source: str, codec: Any) -> None:
        """Record compression set in code, for the one-line config log.

        Args:
            source: who set it (``"DistributedOptimizer"``, ``"make_ddp_hook"``, ...).
            codec: the ``codec`` argument that source submits gradients with; None and
                :data:`POLICY` are not recorded (the policy is in the config).
        """
        if codec is None or (isinstance(codec, str) and codec == POLICY):
            return
        if isinstance(codec, str):
            desc = codec
        else:
            params = codec.params()
            try:
                defaults = get_codec(codec.name).params()
            except Exception:  # noqa: BLE001 - a codec without defaults: show every param
                defaults = {}
            given = {k: v for k, v in params.items() if defaults.get(k, object()) != v}
            desc = codec.name + (
                "(" + ", ".join(f"{k}={v!r}" for k, v in given.items()) + ")" if given else "")
        self._code_compression[source] = desc

    def _announce(self) -> None:
        """Log the effective config in one line on rank 0, once per job.

        Called at the first gradient submission or step rather than in ``init``, so that
        compression set in code (an optimizer's or hook's ``compression``) is included.
        """
        if self._announced:
            return
        self._announced = True
        if self.rank == 0:
            tx = getattr(self.world.tx, "name", "mpi")
            logger.info("%s | transport %s", summarize_effective(
                self.cfg, self.size, self.world.local_size, self._code_compression),
                "torch.distributed (gloo)" if tx == "torch" else "MPI")

    def shutdown(self) -> bool:
        """Finish in-flight work, say goodbye to every rank, stop the thread.

        Waits until every rank has shut down (the usual skew at the end of a job), this
        rank turns out to have left while others still wait for its gradients (logged;
        see :meth:`_check_byes`), or the engine fails (a stall past
        ``sync.stall_shutdown_s``, a failure on another rank). Handles not completed get
        a :class:`~hipress.errors.SyncError`.

        Returns:
            True when the goodbye was clean: every rank shut down with nothing pending (or
            every rank failed in the same negotiation round with nothing in flight: a
            stall past ``stall_shutdown_s``, a peer's error), so the communicators
            may be freed and MPI finalized. False otherwise: the caller must not free or
            finalize (ranks still waiting would hang on it).
        """
        self._announce()
        self._shutdown.set()
        self._wake.set()
        self._poke.set()
        if self.size == 1:
            self._write_timeline()
        else:
            self._thread.join()
        self._sched.shutdown()
        self._restore_blas()
        self._restore_blas = limit_numpy_blas(0)
        with self._lock:
            left = list(self._inflight.values()) + list(self._queue)
            self._inflight.clear()
            self._queue.clear()
        for sub in left:
            sub.handle._finish(error=self._error or SyncError(
                f"HiPress shut down before {sub.name!r} was synchronized on every rank"))
        if self._left_early:
            return False
        return self._error is None or self._collective_error

    def stats(self) -> Dict[str, Dict[str, Any]]:
        """Return per-gradient statistics (see :func:`hipress.stats`); any thread, any time."""
        out = {}
        # a one-step copy (atomic under the GIL): the engine adds names while we read
        for name, st in dict(self.stats_table).items():
            d = dict(st)
            if d.get("payload_bytes"):
                d["compression_ratio"] = d.get("raw_bytes", 0) / d["payload_bytes"]
            out[name] = d
        return out

    def reset_state(self, prefix: str = "") -> int:
        """Drop the error-feedback state of gradients whose names start with ``prefix``.

        Returns:
            The number of state entries dropped (all of them for an empty prefix).
        """
        return sum(mem.reset_prefix(prefix) for mem in self._memories.values())

    def _fit_state(self, mem: Memory, name: str, numel: int, path: str, parts: int) -> None:
        """Make this rank's residuals of ``name`` fit the partitions it now runs in.

        Residuals are kept per partition (``name#p<i>`` on the PS path, ``name`` or
        ``name#p<i>`` on the gather path, ``name#p<i>c<j>`` per ring chunk), so when a
        gradient's path or partition count changes between steps (a SeCoPa plan made at
        run time, a codec rule, a checkpoint saved under another plan) the stored ones no
        longer fit. The engine thread calls this as each compressed job starts; it costs
        one dictionary lookup unless the layout changed (or, once per gradient after
        ``init`` or :meth:`load_state_dict`, to check the stored layout). On a change this
        rank's residual of the whole gradient (its partitions', in element order) is split
        over the new partitions (as ``np.array_split`` does); what cannot follow is
        dropped: the aggregator's residuals of merged partitions (``@agg``: partitions
        change owner), ring chunk residuals, and residuals that do not add up to the
        gradient. Rank 0 says so at INFO the first time, at DEBUG after.
        """
        lay = (path, parts)
        prev = self._layouts.get(name)
        if prev == lay:
            return
        self._layouts[name] = lay
        keys: Optional[List[str]] = (
            [f"{name}#p{i}" for i in range(parts)] if path == "ps" else
            ([name] if parts == 1 else [f"{name}#p{i}" for i in range(parts)])
            if path == "gather" else None)
        held: List[str] = []  # the stored residual keys of the gradient, in element order
        while f"{name}#p{len(held)}" in mem:
            held.append(f"{name}#p{len(held)}")
        if not held and name in mem:
            held = [name]
        if prev is None and _layout_fits(mem, name, held, keys, path, parts):
            return  # the first job since init/load, and what is stored fits
        states = [mem.get(k) for k in held] if isinstance(mem, ResidualMemory) else []
        full = None
        if states and all(getattr(x, "size", -1) >= 0 for x in states) and sum(
                int(x.size) for x in states) == int(numel):
            xp = array_module(states[0])
            full = xp.concatenate([x.reshape(-1) for x in states])
        dropped = (1 if name in mem else 0) + mem.reset_prefix(f"{name}#p")
        mem.reset(name)
        carried = 0
        if full is not None and keys is not None:
            bounds = T._bounds(int(numel), len(keys))
            for i, key in enumerate(keys):
                mem.put(key, full[bounds[i]:bounds[i + 1]].copy())
            carried = int(numel)
            dropped -= len(held)
        if self.rank == 0:
            level = logging.DEBUG if self._warned_regroup else logging.INFO
            self._warned_regroup = True
            logger.log(level, "HiPress: %r now runs on the %s path in %d partition(s) (was %s); "
                       "its error-feedback residual was %s, %d stored entr%s that cannot "
                       "follow (aggregator residuals, ring chunks) dropped%s", name, path,
                       parts, f"{prev[0]} in {prev[1]}" if prev else "stored for another",
                       f"re-split ({carried} elements)" if carried else "not carried",
                       dropped, "y" if dropped == 1 else "ies",
                       "" if level == logging.DEBUG else "; later re-splits are logged at "
                       "DEBUG")

    def state_dict(self) -> Dict[str, Any]:
        """Return error-feedback memories and codec state, keyed by names (picklable).

        Returns:
            ``{"step": int, "memories": {memory key: {state name: NumPy array}},
            "codecs": {codec key: codec state}}``; every array is a host copy (float32,
            or float64 for float64 gradients).

        May be called from any thread at any time, also while other threads submit new
        names and the engine encodes: every table is copied in one step before it is
        read, so new entries never break the iteration (they are in the result or not).
        The values of a gradient whose synchronization is in flight may be caught between
        two steps; for a consistent checkpoint call it when no handle is outstanding
        (after synchronizing the step's gradients, before submitting the next ones).
        """
        memories = dict(self._memories)  # one-step copies (atomic under the GIL)
        codecs = dict(self._codecs)
        return {
            "step": self.step_count,
            "memories": {k: m.state_dict() for k, m in memories.items() if k != "none"},
            "codecs": {k: c.state_dict() for k, c in codecs.items()},
        }

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output (codecs are rebuilt from their keys)."""
        self.step_count = int(state.get("step", 0))
        self._layouts.clear()  # the loaded residuals' layout is checked at their next job
        for key, mstate in state.get("memories", {}).items():
            kind, params = _split_key(key)
            self._memory(kind, params).load_state_dict(mstate)
        for key, cstate in state.get("codecs", {}).items():
            self._codec(key).load_state_dict(cstate)

    # ------------------------------------------------------------------ policy
    def _resolve_codec(self, name: str, array: Any,
                       codec: Any) -> Tuple[Optional[Codec], str, Optional[str]]:
        """Pick the codec of one gradient.

        - ``None``: no codec; the reduction is exact.
        - :data:`POLICY` (``"auto"``): the job's compression policy, as the optimizer
          wrappers, DDP hooks and trainers submit gradients: no codec during the first
          ``compression.warmup_steps`` steps or below ``compression.min_compress_bytes``
          (unless a SeCoPa plan decides), else the first matching ``compression.rules``
          entry, else ``compression.algorithm`` with ``compression.params``.
        - a codec name or :class:`~hipress.codecs.Codec` instance: that codec, whatever
          the gradient's size and the step (a name equal to ``compression.algorithm``
          takes ``compression.params``).

        Returns:
            ``(codec or None, codec key, why)``: ``why`` says why a gradient for which
            compression was asked goes uncompressed (``"warmup"``,
            ``"min_compress_bytes"``), else None.

        Raises:
            CodecError: unknown codec name or bad parameters.
        """
        comp = self.cfg.compression
        if codec is None:
            return None, "none", None
        if isinstance(codec, Codec):
            if codec.name == "none":
                return None, "none", None
            key = _codec_key(codec.name, codec.params())
            return self._codec(key, lambda: codec), key, None
        if codec == POLICY:
            algo, params = comp.algorithm, dict(comp.params)
            for rule in comp.rules:
                if fnmatch.fnmatchcase(name, rule.pattern):
                    algo, params = rule.algorithm, dict(rule.params)
                    break
            if algo == "none":
                # a rule switching the job's codec off still counts for the warning
                asked = comp.algorithm != "none"
                return None, "none", (f"rule:{rule.pattern}" if asked else None)
            if self.step_count < comp.warmup_steps:
                why: Optional[str] = "warmup"
            elif (not self._plan.active
                    and array.size * array.dtype.itemsize < comp.min_compress_bytes):
                why = "min_compress_bytes"
            else:
                why = None
            if why is not None:
                self._codec(_codec_key(algo, params),
                            lambda: build_codec(algo, params))  # validates the name once
                return None, "none", why
        else:
            algo = str(codec)
            params = dict(comp.params) if algo == comp.algorithm else {}
            if algo == "none":
                return None, "none", None
        key = _codec_key(algo, params)
        return self._codec(key, lambda: build_codec(algo, params)), key, None

    def _codec(self, key: str, make: Any = None) -> Codec:
        """Return the engine's codec under ``key``; on first use ``make()`` it and bind it.

        ``make`` defaults to building the codec from the key itself (as checkpoints
        name their codecs).

        One instance per key, shared by every gradient that uses it (it holds per-name
        state such as PowerSGD's Q matrices), bound to this rank so stochastic codecs draw
        their own streams.
        """
        codec = self._codecs.get(key)
        if codec is None:
            codec = make() if make is not None else build_codec(*_split_key(key))
            codec.bind(self.rank, self.size)
            with self._lock:
                codec = self._codecs.setdefault(key, codec)
        return codec

    def _account(self, array: Any, requested: Any, codec: Optional[Codec], key: str,
                 why: Optional[str]) -> None:
        """Count the bytes of one submission for the "nothing was compressed" warning."""
        if requested is None or why == "warmup" or (codec is None and why is None):
            return  # exact by request, warm-up by design, or the policy says "none"
        nbytes = int(array.size) * array.dtype.itemsize
        shape = tuple(int(d) for d in array.shape)
        if codec is not None:
            ck = (key, shape, str(array.dtype))
            ratio = self._ratios.get(ck)
            if ratio is None:
                ratio = self._ratios[ck] = codec.compression_ratio(shape, array.dtype)
            why = None if ratio > 1.0 else "codec"
        name = codec.name if codec is not None else (
            self.cfg.compression.algorithm if requested == POLICY else str(requested))
        with self._lock:
            acct = self._acct
            acct["asked"] = acct.get("asked", 0) + nbytes
            acct.setdefault("codecs", set()).add((name, requested == POLICY))
            if why is None:
                acct["compressed"] = acct.get("compressed", 0) + nbytes
            elif why.startswith("rule:"):
                acct["rules"] = acct.get("rules", 0) + nbytes
                acct.setdefault("patterns", set()).add(why[5:])
            else:
                acct[why] = acct.get(why, 0) + nbytes
                if why == "codec":
                    acct.setdefault("shrinkless", set()).add(name)

    def _check_compressed(self) -> None:
        """At the end of a step: warn once per job if compression was asked but hardly ran.

        Logged on rank 0 when less than a tenth of the bytes submitted with a codec (or
        under a policy naming one) was compressed, naming the setting responsible.
        """
        with self._lock:
            acct, self._acct = self._acct, {}
        asked = acct.get("asked", 0)
        if self._warned_uncompressed or not asked or acct.get("compressed", 0) * 10 >= asked:
            return
        self._warned_uncompressed = True
        if self.rank != 0:
            return
        comp = self.cfg.compression
        how = ", ".join(sorted(f"compression.algorithm={n!r}" if pol else f"compression={n!r}"
                               for n, pol in acct["codecs"]))
        causes = []
        if acct.get("min_compress_bytes"):
            causes.append(
                f"{_fmt_bytes(acct['min_compress_bytes'])} were gradients below "
                f"compression.min_compress_bytes={comp.min_compress_bytes} (lower it, e.g. to "
                "0, or pass compression='<codec>' to the DistributedOptimizer or hook, which "
                "compresses every tensor it is given)")
        if acct.get("plan"):
            causes.append(
                f"{_fmt_bytes(acct['plan'])} were left uncompressed by the SeCoPa plan "
                f"(sync.plan={self.cfg.sync.plan!r}) because its cost model predicts no gain "
                "(set sync.plan: none to follow the fixed policy)")
        if acct.get("rules"):
            causes.append(
                f"{_fmt_bytes(acct['rules'])} were gradients that compression.rules "
                f"{sorted(acct['patterns'])} send uncompressed (narrow those patterns)")
        if acct.get("codec"):
            names = ", ".join(sorted(acct["shrinkless"]))
            hint = (" (PowerSGD sends vectors and matrices below min_compression_rate as they "
                    "are)" if "powersgd" in acct["shrinkless"] else "")
            causes.append(
                f"{_fmt_bytes(acct['codec'])} were tensors that {names} does not make smaller: "
                "tensors of a few elements are outweighed by their payload header" + hint +
                "; expected for biases and tiny models")
        logger.warning(
            "compression was asked for (%s) but step %d compressed %s of %s of gradients "
            "(%.0f%%): %s. This warning is shown once per job",
            how, self.step_count, _fmt_bytes(acct.get("compressed", 0)), _fmt_bytes(asked),
            100.0 * acct.get("compressed", 0) / asked, "; ".join(causes))

    def _memory(self, kind: str, params: Optional[Dict[str, Any]] = None) -> Memory:
        """Return the memory of ``kind`` with ``params`` (one instance per distinct pair)."""
        key = _codec_key(kind, params or {})
        if key not in self._memories:
            self._memories[key] = get_memory(kind, **(params or {}))
        return self._memories[key]

    def _memory_for(self, codec: Codec) -> Memory:
        kind = self.cfg.compression.memory
        if kind == "auto":
            kind = codec.default_memory if codec.error_feedback else "none"
        if kind == "none":
            return self._memories["none"]
        params = dict(codec.memory_params()) if kind == codec.default_memory else {}
        if kind == "dgc":
            params["world_size"] = self.size
        return self._memory(kind, params)

    def _path(self, sub: _Submission) -> str:
        """Return the synchronization path of a ready submission."""
        codec = sub.codec
        if sub.kind == "broadcast":
            return "broadcast"
        if sub.kind in _DATA_KINDS:
            return sub.kind
        if codec is None:
            return "fused" if sub.op in ("average", "sum") else "reduce"
        forced = sub.strategy if sub.strategy in STRATEGIES else None
        if not codec.mergeable or codec.variable_size:
            path = "allreduce" if codec.summable and not codec.variable_size else "gather"
            if forced in ("ps", "ring") and codec.name not in self._warned and self.rank == 0:
                self._warned.add(codec.name)
                logger.warning(
                    "codec %r cannot run under CaSync-%s (its payloads are not mergeable: "
                    "decoding, summing and re-encoding them would lose most of the sum); "
                    "using the %s path", codec.name, forced.upper(), path)
            return path
        if forced in ("ps", "ring", "gather"):
            return forced
        if forced == "allreduce" or codec.summable:
            if not codec.summable:
                raise HiPressError(f"codec {codec.name!r} is not summable; use ps or ring")
            return "allreduce"
        return "ps"

    def _partitions(self, nbytes: int) -> int:
        sync = self.cfg.sync
        if sync.partitions:
            return int(sync.partitions)
        return max(1, math.ceil(nbytes / sync.partition_bytes))

    # ------------------------------------------------------------------ internals
    def _check_alive(self) -> None:
        if self._error is not None:
            # another rank's failure stays a PeerFailure: the exit hook then lets the rank
            # that caused it be reported first, whichever call saw it
            cls = PeerFailure if isinstance(self._error, PeerFailure) else SyncError
            raise cls(f"HiPress engine failed earlier: {self._error}") from self._error
        if self._shutdown.is_set():
            raise SyncError("HiPress is shut down; call hipress.init() first")

    def _enqueue(self, *subs: _Submission) -> None:
        """Queue submissions together: they travel in the same negotiation message."""
        with self._lock:
            for sub in subs:
                if sub.name in self._inflight:
                    raise ValueError(
                        f"gradient name {sub.name!r} is already in flight; names must be "
                        "unique among outstanding operations (synchronize the earlier "
                        "handle first)"
                    )
            for sub in subs:
                self._seq += 1
                sub.seq = self._seq
                sub.handle._engine = self
                self._inflight[sub.name] = sub
                self._queue.append(sub)
                self._queued_bytes += int(sub.array.nbytes)
        if self.timeline.enabled:  # when each gradient became ready (SeCoPa's arrivals)
            now = self.timeline.now_us()
            for sub in subs:
                if sub.kind == "allreduce" and not sub.filler:
                    self.timeline.add("submit", now, 0.0, gradient=sub.name,
                                      numel=int(sub.array.size), step=self.step_count,
                                      codec=sub.codec.name if sub.codec is not None else "none")
        self._wake.set()
        # While transfers are in flight the engine wakes every few ms and sees _wake at
        # its next cycle; waking it for each gradient of a backward pass only costs a
        # thread switch per gradient. From a long idle sleep it is woken at once.
        if self._sleeping_long:
            self._poke.set()

    def flush(self) -> None:
        """Start the next negotiation round now: a rank waits for (or polls) a result.

        Gradients submitted during the backward pass are negotiated once per
        ``sync.cycle_time_ms``; when the training loop waits for a result, nothing more
        will come soon, so the round starts without waiting for the cycle to end, and
        its message says ``flush``: small gradients held for fusion start in that round
        on every rank (:meth:`_release_fused`).
        """
        self._flush_once = True
        self._wake.set()
        self._poke.set()

    def _complete(self, sub: _Submission, result: Any = None,
                  error: Optional[BaseException] = None) -> None:
        with self._lock:
            self._inflight.pop(sub.name, None)
        if self.timeline.enabled:
            self.timeline.add("done", self.timeline.now_us(), 0.0, gradient=sub.name,
                              step=self.step_count)
        sub.handle._finish(result, error)

    def _run(self) -> None:
        set_os_thread_name()
        try:
            self._loop()
        except BaseException as exc:  # noqa: BLE001 - reported through every handle
            if not isinstance(exc, HiPressError):
                logger.exception("HiPress engine thread failed")
                exc = SyncError(f"HiPress engine failed: {exc!r}")
            self._error = exc
            self._sched.abort()
            with self._lock:
                left = list(self._inflight.values())
                self._inflight.clear()
                self._queue.clear()
                # a rank waiting in join() is told too (it used to wait forever)
                joining, self._join_handle = self._join_handle, None
            for sub in left:
                sub.handle._finish(error=exc)
            if joining is not None:
                joining._finish(error=exc)
        finally:
            self._write_timeline()

    def _loop(self) -> None:
        tx = self.world.tx
        cycle = self.cfg.sync.cycle_time_ms / 1000.0
        long_cycle = max(cycle, self.cfg.sync.max_cycle_time_ms / 1000.0)
        round_bytes = self.cfg.sync.partition_bytes
        phase, req, round_start, last_round = 0, None, 0.0, 0.0
        idle_rounds = idle_polls = 0
        last_progress = 0.0
        moved = False  # the last round started a task or carried a new name
        while True:
            progressed = False
            # the round's request rides in the primitives' Testsome (MPI transport)
            round_req = getattr(req, "request", None) if phase == 1 else None
            known = None
            if self._sched.busy and self._local_error is None:
                try:
                    progressed = self._sched.poll(round_req)
                    known = self._sched.extra_done
                    if self._held:  # tasks that finished may have freed their tags
                        self._start_held()
                except Exception as exc:  # noqa: BLE001 - told to every rank, then raised
                    self._local_error = exc
                    self._wake.set()
                    self._poke.set()
            now = time.monotonic()
            # A rank that waits for a result keeps rounds going while anything is still
            # to be agreed (names some ranks have not sent yet, its own queue, held
            # fusion): its one flush may have come a round before a peer's name. At once
            # after a round that moved something, else once per cycle (a stall, where
            # every rank waits, costs one round per cycle, not a busy loop).
            urgent = bool(self._waiting and (self._table or self._queue or self._fuse_pending))
            # Fewer than a partition's worth of bytes queued: the round waits up to the
            # long cycle, so the small gradients of a slow backward pass share rounds (a
            # round costs every rank an Iallgather and its polls); a partition's worth, a
            # flush or a waiting rank keep the one-cycle pace.
            cyc = cycle if self._queued_bytes >= round_bytes else long_cycle
            if phase == 0:
                wait = _round_interval(cyc, idle_rounds)
                if (now - last_round >= wait or self._flush_once
                        or (urgent and (moved or now - last_round >= cycle))
                        or (self._wake.is_set() and now - last_round >= cyc)):
                    self._wake.clear()
                    req = tx.iallgather_bytes(self._make_message())
                    phase, round_start = 1, now
            if phase == 1:
                # known is None unless poll() just tested this round's request (a round
                # posted above, another transport, no primitive pending): it tests itself
                gathered = req.test() if known is None else req.test(known)
            else:
                gathered = None
            if gathered is not None:
                msgs = [json.loads(m) for m in gathered]
                phase, last_round = 0, time.monotonic()
                self._round += 1
                t_round = self.timeline.now_us()
                try:
                    started = self._process_round(msgs)
                except HiPressError:
                    # raised on every rank in this same round, from the same table: the
                    # ranks stop together, so MPI can still be shut down cleanly when no
                    # transfer is left in flight. Not so when this rank alone gave up on
                    # the others' goodbye: MPI_Finalize would wait for them forever
                    self._collective_error = not self._sched.busy and not self._bye_stalled
                    raise
                new = sum(len(m["new"]) for m in msgs)
                if started or new:  # idle rounds are not recorded
                    self.timeline.add("negotiate", t_round, self.timeline.now_us() - t_round,
                                      round=self._round, started=started, new=new)
                if self._left_early or (all(m["bye"] for m in msgs) and not started):
                    return
                # rounds back off while no rank has new names, even when transfers are
                # in flight: polling MPI needs no round
                moved = bool(started or new)
                busy = moved or self._table
                idle_rounds = 0 if busy else idle_rounds + 1
                progressed = True
            waited = now - round_start if phase else 0.0
            state = self._round_watch.check(waited)
            if state == "fatal":
                raise StallError(
                    f"negotiation round {self._round + 1} did not complete in {waited:.0f} s "
                    f"(sync.stall_shutdown_s={self.cfg.sync.stall_shutdown_s:g}): a rank is "
                    "hung, stopped or dead; every rank stops")
            if state == "warn":
                logger.warning(
                    "HiPress negotiation round %d has not completed for %.0f s: a rank is hung, "
                    "stopped or dead (the ranks that answer cannot tell which). %s",
                    self._round + 1, waited, self._shutdown_hint())
            self.timeline.maybe_flush()  # a job that dies keeps its trace up to ~0.5 s ago
            if progressed:
                idle_polls = 0
                last_progress = time.monotonic()  # after the work, which can take ms
                continue
            # Nothing moved: sleep until a compute step finishes or work is submitted
            # (both set _poke), or for a short back-off while MPI messages are in flight
            # (0.5 ms doubling to 4 ms: MPI progresses only inside our calls, and a
            # kernel socket buffer holds several ms of a 1-10 Gbit/s link). No back-off
            # while a thread waits for a result: the step is blocked on the engine, and
            # each protocol step of a message (a rendezvous, a negotiation round's
            # stages, the peer's reply) would wait out a sleep on its critical path. A
            # 4-float allreduce of 2 ranks on one host took 3.9 ms with 0.5 ms sleeps
            # (each about 0.65 ms) and takes 0.4-0.6 ms with the spin.
            if self._sched.busy or phase:
                idle_polls += 1
                if self._waiting and now - last_progress < _SPIN_S:
                    os.sched_yield()  # runnable threads (another rank's compute) go first
                    continue
                if self._waiting:
                    wait = _POLL_MIN_S
                else:
                    wait = min(_POLL_MIN_S * (1 << min(idle_polls - 1, 4)), _POLL_MAX_S)
            else:
                wait = _round_interval(cyc, idle_rounds)
                if urgent:
                    wait = min(wait, cycle)
            self._sleeping_long = wait > min(cycle, _POLL_MAX_S)
            # a submission that saw _sleeping_long False set _wake first: do not sleep past it
            if self._sleeping_long and self._wake.is_set():
                wait = min(wait, cycle)
            if self._poke.wait(wait):
                self._poke.clear()
            self._sleeping_long = False

    def _make_message(self) -> bytes:
        new = []
        with self._lock:
            while self._queue:
                sub = self._queue.popleft()
                self._pending_local[sub.name] = sub
                # the shape last: codecs may depend on it (PowerSGD's (m, n) matrix), so
                # compressed gradients must agree on more than the element count
                dcode = dtype_code(sub.array.dtype) if sub.dtype_ok else 0
                new.append([sub.name, int(sub.array.size), dcode,
                            sub.codec_key, sub.op, sub.kind,
                            sub.root, sub.strategy or "", sub.partitions or 0,
                            _shape_meta(sub), _finite_flag(sub), sub.extra,
                            int(sub.filler)])
            self._queued_bytes = 0
            queue_empty = not self._queue
            joined = self._join_handle is not None
        bye = (self._shutdown.is_set() and queue_empty and not self._sched.busy
               and not self._held and not self._fuse_pending)
        flush = bool(self._waiting or self._flush_once or self._shutdown.is_set() or joined)
        self._flush_once = False
        msg: Dict[str, Any] = {"new": new, "bye": bye, "joined": joined, "flush": flush}
        if self._local_error is not None:
            msg["error"] = f"{type(self._local_error).__name__}: {self._local_error}"
        if self.rank == 0:
            msg["stall"] = self._stalled()
        return json.dumps(msg).encode()

    def _stalled(self) -> List[list]:
        """Rank 0: warn about names submitted by some ranks only; return them once fatal.

        A warning every ``sync.stall_warning_s`` while the oldest incomplete name waits
        longer than that; the names (with the ranks missing them) are returned, and so
        raised on every rank, once it waits longer than ``sync.stall_shutdown_s``.
        """
        now = time.monotonic()
        oldest = max((now - ent["t"] for ent in self._table.values()), default=0.0)
        state = self._name_watch.check(oldest)
        if state is None:
            return []
        # once one name stalls, report every incomplete one: they usually explain each other
        stalled = [[name, [r for r in range(self.size) if r not in ent["meta"]]]
                   for name, ent in self._table.items()]
        if state == "fatal":
            return stalled
        logger.warning("HiPress stall: for %.0f s %s. %s", oldest,
                       _describe_stall(stalled, self.size), self._shutdown_hint())
        return []

    def _shutdown_hint(self) -> str:
        """Say what ends a stall: the configured shutdown, or nothing."""
        sync = self.cfg.sync
        if sync.stall_shutdown_s > 0:
            return f"Every rank stops after sync.stall_shutdown_s={sync.stall_shutdown_s:g} s."
        return ("Waiting on (sync.stall_shutdown_s is 0: a rank may legitimately spend "
                "minutes on evaluation or a checkpoint); set it to end such jobs.")

    def _process_round(self, msgs: List[Dict[str, Any]]) -> int:
        """Merge every rank's new names into the table, start the ready ones, count them."""
        stall = msgs[0].get("stall") or []
        if stall:
            raise StallError(
                f"stalled for more than sync.stall_shutdown_s={self.cfg.sync.stall_shutdown_s:g}"
                f" s: {_describe_stall(stall, self.size)}. Every rank must synchronize the same "
                "gradient names; check for parameters that exist or are used on some ranks "
                "only, for rank-dependent names, or for a rank that hangs"
            )
        failed = [(r, m["error"]) for r, m in enumerate(msgs) if m.get("error")]
        if failed:
            if self._local_error is not None:
                raise self._local_error
            r, err = failed[0]
            raise PeerFailure(
                f"rank {r} failed while synchronizing ({err}); every rank stops. Fix the "
                f"cause on rank {r} (its own traceback names it)"
            )
        ready = []
        for r, m in enumerate(msgs):
            for i, entry in enumerate(m["new"]):
                name = entry[0]
                ent = self._table.setdefault(name, {"meta": {}, "t": time.monotonic(),
                                                    "order": None})
                ent["meta"][r] = entry[1:]
                if r == 0:
                    ent["order"] = (self._round, i)
        self._check_byes(msgs)
        joined = {r for r, m in enumerate(msgs) if m.get("joined")}
        for r in joined:
            self._join_round.setdefault(r, self._round)
        if joined:
            self._joined_fill(joined)
        for name, ent in list(self._table.items()):
            if len(ent["meta"]) == self.size:
                ready.append((ent["order"], name))
        ready.sort()
        started = []
        for _, name in ready:
            if name not in self._table:  # failed with its group earlier in this round
                continue
            ent = self._table.pop(name)
            metas = [ent["meta"][r] for r in range(self.size)]
            sub = self._pending_local.pop(name)
            if any(m[4] in _DATA_KINDS for m in metas):
                err = _collective_mismatch(name, metas)
            else:
                err = _submission_mismatch(name, metas)
            if err is not None:  # every rank fails this handle alike; the engine goes on
                self._complete(sub, error=CollectiveArgumentError(err))
                if _groups_differ(metas):
                    self._fail_groups(metas, err)
                continue
            sub.metas = metas
            sub.divisor = self.size - sum(m[11] for m in metas)
            nonfinite = [r for r in range(self.size) if not metas[r][9]]
            if nonfinite:
                self._uncompress_nonfinite(sub, nonfinite)
            started.append(sub)
        if started:
            self._start(started)
        self._release_fused(any(m.get("flush") for m in msgs))
        if len(joined) == self.size and not self._table:
            self._finish_join(joined)
        return len(started)

    def _fail_groups(self, metas: List[list], err: str) -> None:
        """Fail every name of the grouped_allreduce calls that ``metas`` belong to.

        Ranks grouped different tensors: the names some ranks grouped and others did not
        would otherwise wait forever. Each rank's whole group travelled in one message,
        so it is in the table now; a table entry goes when every rank that submitted it
        did so in the group (``gid``, its first name) that rank had for the failed name.
        Every rank sees the same table, so all drop the same names.
        """
        gids = {r: _extra(m, "gid") for r, m in enumerate(metas)}
        for name, ent in list(self._table.items()):
            mine = [(r, _extra(meta, "gid")) for r, meta in ent["meta"].items()]
            if mine and all(gid is not None and gid == gids.get(r) for r, gid in mine):
                self._table.pop(name)
                sub = self._pending_local.pop(name, None)
                if sub is not None:
                    self._complete(sub, error=CollectiveArgumentError(err))

    def _joined_fill(self, joined: set) -> None:
        """Stand in for ranks that called :meth:`join`: zeros for allreduces they miss.

        A name every rank has submitted except ranks that joined is allreduced with
        zeros from those ranks (``contributes=False``: residuals untouched), flagged as
        fillers in negotiation so that every rank divides an average by the ranks that
        contributed. Other operations (broadcast, allgather, alltoall, reducescatter, and
        min/max/product allreduces, where zeros would change the result) cannot run
        against joined ranks: their handles fail on every rank. Every rank sees the same
        table and flags, so all decide alike.
        """
        refused = []
        for name, ent in self._table.items():
            missing = set(range(self.size)) - set(ent["meta"])
            if not missing or not missing <= joined:
                continue
            meta = next(iter(ent["meta"].values()))
            if meta[4] == "allreduce" and meta[3] in ("average", "sum"):
                if self.rank in missing and name not in self._inflight:
                    self._enqueue(self._filler(name, meta))
            else:
                refused.append((name, sorted(missing), meta[4], meta[3]))
        for name, missing, kind, op in refused:
            self._table.pop(name)
            sub = self._pending_local.pop(name, None)
            if sub is not None:
                what = f"{kind} (op={op!r})" if kind == "allreduce" else kind
                self._complete(sub, error=CollectiveArgumentError(
                    f"{what} {name!r} cannot run: rank(s) {missing} have called join() and only "
                    "sum/average allreduces run against joined ranks (they add zeros). Run it "
                    "before join(), or on every rank"))

    def _filler(self, name: str, meta: list) -> _Submission:
        """Return this joined rank's zero submission matching another rank's ``meta``."""
        numel, dcode, key, op, _kind, _root, strategy, parts, shape = meta[:9]
        array = np.zeros(tuple(shape) if shape is not None else (numel,), CODE_DTYPES[dcode])
        return _Submission(name=name, array=array, average=(op == "average"), op=op,
                           codec=None if key == "none" else self._codec(key), codec_key=key,
                           strategy=strategy or None, contributes=False, handle=Handle(name),
                           kind="allreduce", root=-1, seq=0, partitions=parts or None,
                           inplace=False, filler=True)

    def _finish_join(self, joined: set) -> None:
        """Every rank has joined and nothing waits: complete the join, name the last rank."""
        last = max(joined, key=lambda r: (self._join_round[r], r))
        self._join_round.clear()
        with self._lock:
            handle, self._join_handle = self._join_handle, None
        if handle is not None:
            handle._finish(last)

    def _check_byes(self, msgs: List[Dict[str, Any]]) -> None:
        """Catch ranks that finished while others still wait for their gradients.

        A rank says goodbye (``bye``) once it is shut down with nothing left to send, so
        names it has not submitted by then will never be: ranks ran different numbers of
        steps, or one exited early (``sys.exit``, the end of its data). Every rank sees
        the same table in the same round, so the waiting ranks raise a
        :class:`~hipress.errors.SyncError` naming the rank and the gradients, and the
        rank that left logs the same and stops waiting (see :attr:`_left_early`).
        """
        byes = {r for r, m in enumerate(msgs) if m["bye"]}
        if not byes:
            return
        waiting = {}
        for name, ent in self._table.items():
            missing = byes - set(ent["meta"])
            if missing:
                waiting[name] = sorted(missing)
        if not waiting:
            if self.rank in byes and len(byes) < self.size:  # the usual skew at job end
                self._wait_for_byes(byes)
            return
        left = sorted({r for ranks in waiting.values() for r in ranks})
        names = sorted(waiting)
        shown = ", ".join(repr(n) for n in names[:8]) + (
            f" and {len(names) - 8} more" if len(names) > 8 else "")
        if self.rank in byes:
            waiters = sorted(set(range(self.size)) - byes)
            logger.error(
                "rank %d finished (hipress.shutdown() or exit) while rank(s) %s still wait for "
                "gradient(s) %s it never submitted. Unless this rank is exiting on an error "
                "(sys.exit), ranks ran different numbers of steps: give every rank the same "
                "number of batches (e.g. drop_last=True with a DistributedSampler)",
                self.rank, waiters, shown)
            self._left_early = True
            return
        raise PeerFailure(
            f"rank(s) {left} finished (hipress.shutdown() or exit) while gradient(s) {shown} "
            f"were waiting for them. If rank(s) {left} exited on an error (sys.exit), their "
            "own output and exit status tell why; otherwise ranks ran different numbers of "
            "steps: give every rank the same number of batches (e.g. drop_last=True with a "
            "DistributedSampler)")

    def _wait_for_byes(self, byes: set) -> None:
        """Wait for the others' goodbye after this rank's: warn, give up at the stall shutdown.

        The ranks still running may be hung, or busy with other work (evaluation).
        """
        now = time.monotonic()
        if self._bye_since is None:
            self._bye_since = now
        others = sorted(set(range(self.size)) - byes)
        state = self._bye_watch.check(now - self._bye_since)
        if state == "fatal":
            self._bye_stalled = True
            raise StallError(f"rank(s) {others} did not shut down within "
                             f"sync.stall_shutdown_s={self.cfg.sync.stall_shutdown_s:g} s")
        if state == "warn":
            logger.warning("rank %d called hipress.shutdown() %.0f s ago and waits for rank(s) "
                           "%s to do the same. %s", self.rank, now - self._bye_since, others,
                           self._shutdown_hint())

    def _uncompress_nonfinite(self, sub: _Submission, ranks: List[int]) -> None:
        """Send a gradient with inf/NaN on some rank uncompressed, this step only.

        Lossy codecs cannot encode inf/NaN, and error feedback would carry them into every
        later step. Summed exactly instead, the non-finite values reach every rank (so
        ``torch.amp.GradScaler`` and other overflow checks skip the step on all ranks
        alike), while the residual and the codec state of this gradient stay as they were
        and the next step compresses again. Every rank takes this decision in the same
        negotiation round, from the flags in the table.
        """
        st = self.stats_table.setdefault(sub.name, {})
        st["nonfinite_steps"] = st.get("nonfinite_steps", 0) + 1
        log = logger.info if "nonfinite" not in self._warned else logger.debug
        self._warned.add("nonfinite")
        if self.rank == 0:
            log("gradient %r has inf/NaN on rank(s) %s: sent uncompressed this step, its "
                "residual and codec state untouched (later ones are logged at DEBUG)",
                sub.name, ranks)
        sub.codec, sub.codec_key, sub.partitions = None, "none", None

    def _next_tag(self) -> int:
        """Return the base tag of the next task: its task id << _SUB_BITS.

        Ids are handed out round-robin in the agreed start order, so every rank gives a
        task the same tags. An id can come round again while the task that had it is still
        running (on a small MPI_TAG_UB, or with very many tasks in flight): never reuse it
        then, see :meth:`_launch`.
        """
        tid = self._task_id % (1 << self._tag_task_bits)
        self._task_id += 1
        return tid << _SUB_BITS

    def _launch(self, gen: Any, label: str, tag: int) -> None:
        """Start a task graph that uses the tags of ``tag``'s task id, once the id is free.

        A task whose id is still held by a running task waits in a FIFO queue, and tasks
        behind it wait too: every rank then starts tasks in the same order and no two
        running tasks ever share a tag, so messages never match the wrong task. This
        cannot deadlock: a task waits only for tasks started before it, on every rank.
        """
        self._held.append((tag >> _SUB_BITS, gen, label))
        try:
            self._start_held()
        except Exception as exc:  # noqa: BLE001 - told to every rank, then raised
            # a task's first step runs here, inside the negotiation round, on this rank's
            # data: an error in it is this rank's alone (raised out of the round, the
            # others would wait for its messages forever), so it goes to every rank as a
            # failure in poll() does
            if self._local_error is None:
                self._local_error = exc
            self._wake.set()
            self._poke.set()

    def _start_held(self) -> None:
        """Start waiting task graphs, in order, while their task ids are free."""
        while self._held and self._held[0][0] not in self._tids_busy:
            tid, gen, label = self._held.popleft()
            self._tids_busy.add(tid)
            self._sched.add(gen, label, on_done=functools.partial(self._tids_busy.discard, tid))
        if self._held and not self._warned_tags:
            self._warned_tags = True
            logger.warning(
                "all %d MPI tag ranges are in use (MPI_TAG_UB allows %d bits); further tasks "
                "wait for one to finish, which limits overlap. An MPI with a larger "
                "MPI_TAG_UB (Open MPI, MPICH: 2**31 - 1) removes the wait",
                1 << self._tag_task_bits, self.world.tag_bits)

    def _start(self, subs: List[_Submission]) -> None:
        """Plan ready submissions (in agreed order) and start their task graphs."""
        bulk: List[Tuple[T.Job, int]] = []
        for sub in subs:
            path = self._path(sub)
            job = self._job(sub, path)
            if path in ("ps", "ring", "gather", "allreduce") and job.flat.size == 0:
                job.part_done()  # nothing to encode or send (the size is agreed)
                continue
            if path == "fused" and self._direct(job):
                path = "direct"
            st = self.stats_table.setdefault(sub.name, {})
            st["calls"] = st.get("calls", 0) + 1
            st["numel"] = int(sub.array.size)
            st["codec"] = sub.codec.name if sub.codec is not None else "none"
            st["strategy"] = path
            if path == "broadcast":
                tag = self._next_tag()
                self._launch(T.broadcast_task(self.env, job, sub.root, tag,
                                              sub.metas[sub.root][8][0]), sub.name, tag)
            elif path in ("reduce", "allgather", "alltoall", "reducescatter"):
                tag = self._next_tag()
                if path == "reduce":
                    gen = T.reduce_task(self.env, job, sub.op, tag)
                elif path == "allgather":
                    gen = T.allgather_task(self.env, job, [m[8][0] for m in sub.metas], tag)
                elif path == "alltoall":
                    gen = T.alltoall_task(self.env, job, sub.metas[self.rank][10],
                                          [m[10][self.rank] for m in sub.metas], tag)
                else:
                    gen = T.reducescatter_task(self.env, job, sub.op, tag)
                self._launch(gen, sub.name, tag)
            elif path == "direct":
                n = job.flat.size
                parts = max(1, min(n, math.ceil(job.flat.nbytes / _DIRECT_PARTITION_BYTES)))
                bounds = T._bounds(n, parts)
                job.parts_left = parts
                for p in range(parts):
                    tag = self._next_tag()
                    self._launch(T.direct_task(self.env, job, bounds[p], bounds[p + 1], p, tag),
                                 f"{sub.name}#p{p}", tag)
            elif path == "fused":
                self._fuse_pending.setdefault(np.dtype(sub.array.dtype), []).append(job)
                self._fuse_pending_bytes += job.flat.nbytes
            elif path == "allreduce":
                tag = self._next_tag()
                self._launch(T.summable_task(self.env, job, tag), sub.name, tag)
            else:
                n = job.flat.size
                # a planner's partitions are CaSync-PS / Ring's (Decision); the gather path
                # keeps the engine's own: a SeCoPa plan prices gather as one unit, and cut
                # into one partition a 392 MiB DGC gradient lost all pipelining (VGG-19
                # stepped 1.39x slower under a plan identical to the fixed policy)
                planned = sub.partitions if path in ("ps", "ring") else None
                parts = min(planned or self._partitions(n * job.flat.dtype.itemsize), n)
                self._fit_state(job.memory, sub.name, n, path, parts)
                if path == "ps" and parts == 1 and job.flat.nbytes <= BULK_MAX_BYTES:
                    bulk.append((job, zlib.crc32(sub.name.encode()) % self.size))
                    continue
                bounds = T._bounds(n, parts)
                job.parts_left = parts
                for p in range(parts):
                    lo, hi = bounds[p], bounds[p + 1]
                    tag = self._next_tag()
                    if path == "ps":
                        # from the name, not a counter: survives checkpoints and restarts
                        agg = (zlib.crc32(sub.name.encode()) + p) % self.size
                        gen = T.ps_task(self.env, job, lo, hi, p, agg, tag)
                    elif path == "gather":
                        gen = T.gather_task(self.env, job, lo, hi, p, parts, tag)
                    else:
                        gen = T.ring_task(self.env, job, lo, hi, p, tag)
                    self._launch(gen, f"{sub.name}#p{p}", tag)
        self._start_bulk(bulk)

    def _start_bulk(self, items: List[Tuple[T.Job, int]]) -> None:
        """Start small single-partition PS gradients of one round in bulk tasks.

        ``items`` hold (job, aggregator) in agreed order, so every rank cuts the same
        groups of at most ``sync.partition_bytes`` and gives them the same tags. A group
        of one runs as a plain :func:`~hipress.engine.tasks.ps_task`.
        """
        groups: List[List[Tuple[T.Job, int]]] = []
        nbytes = 0
        for item in items:
            if not groups or nbytes + item[0].flat.nbytes > self.cfg.sync.partition_bytes:
                groups.append([])
                nbytes = 0
            groups[-1].append(item)
            nbytes += item[0].flat.nbytes
        for group in groups:
            tag = self._next_tag()
            if len(group) == 1:
                job, agg = group[0]
                self._launch(T.ps_task(self.env, job, 0, job.flat.size, 0, agg, tag),
                             f"{job.name}#p0", tag)
            else:
                self._launch(T.ps_bulk_task(self.env, group, tag), f"bulk[{len(group)}]", tag)

    def _release_fused(self, flush: bool) -> None:
        """Start the held small gradients as fused allreduces, if it is time.

        Small uncompressed gradients trickle in over the backward pass (biases, norms);
        started per round, they made tens of fused allreduces of a few KiB per step, each
        a chain of latency-bound messages and Python task steps on every rank. They wait
        instead until :data:`FUSION_HOLD_BYTES` are ready on every rank, or until some
        rank's message says ``flush`` (it waits for or polls a result, joins, or shuts
        down). Every rank decides from the same gathered messages, so all agree.
        """
        if not self._fuse_pending or not (
                flush or self._fuse_pending_bytes >= FUSION_HOLD_BYTES):
            return
        fused, self._fuse_pending = self._fuse_pending, collections.OrderedDict()
        self._fuse_pending_bytes = 0
        limit = self.cfg.sync.fusion_threshold_bytes
        for jobs in fused.values():
            buckets: List[List[T.Job]] = [[]]
            nbytes = 0
            for job in jobs:
                if buckets[-1] and nbytes + job.flat.nbytes > limit:
                    buckets.append([])
                    nbytes = 0
                buckets[-1].append(job)
                nbytes += job.flat.nbytes
            # buckets of one round run one after another: all at once they thrash memory.
            # One after another, they can share the chain's tags (MPI delivers messages of
            # one sender and tag in order), so a chain holds one task id however long.
            tag = self._next_tag()
            self._launch(T.fused_chain_task(self.env, buckets, [tag] * len(buckets)), "fused",
                         tag)

    def _direct(self, job: T.Job) -> bool:
        """Return True for an uncompressed gradient that skips the fusion buffer.

        Large float32/float64 host gradients are reduced straight from and into their own
        memory (:func:`hipress.engine.tasks.direct_task`): copying them into a fused
        buffer and back would cost two passes over memory for nothing.
        """
        return (isinstance(job.flat, np.ndarray) and job.flat.dtype in _DIRECT_DTYPES
                and job.flat.nbytes >= _DIRECT_MIN_BYTES)

    def _job(self, sub: _Submission, path: str) -> T.Job:
        arr = sub.array
        xp = array_module(arr)
        flat = xp.ascontiguousarray(arr).reshape(-1)
        if path in ("ps", "ring", "gather", "allreduce"):
            flat = flat.astype(compute_dtype(flat.dtype), copy=False)
        if sub.kind == "broadcast" or sub.kind in _DATA_KINDS:
            out = None  # the task sets it
        else:
            out = arr.reshape(-1) if sub.inplace else xp.empty(arr.size, dtype=arr.dtype)
        memory = self._memory_for(sub.codec) if sub.codec is not None else self._memories["none"]

        def done(job: T.Job, sub: _Submission = sub) -> None:
            if sub.kind == "broadcast" or sub.kind in _DATA_KINDS:
                res = job.out
            elif sub.inplace:
                res = sub.array
            else:
                res = job.out.reshape(sub.array.shape)
            self._complete(sub, res)

        return T.Job(sub.name, flat, out, tuple(arr.shape), sub.average, sub.codec, memory,
                     sub.contributes, on_done=done, divisor=sub.divisor)

    def _write_timeline(self) -> None:
        """Finish the trace file: the streamed events, or after a clean end the full trace.

        Every rank has appended its events as they happened (see :mod:`hipress.timeline`).
        After a clean goodbye rank 0 gathers all events and replaces the file with the
        JSON object form plus metadata; otherwise the streamed file stays as it is.
        """
        if not self.cfg.timeline:
            return
        try:
            self.timeline.close()
            clean = self._error is None and not self._left_early
            events = self.timeline.events()
            meta = {"world_size": self.size, "stats": self.stats()}
            if "{rank}" in str(self.cfg.timeline):
                if clean:
                    write_trace(str(self.timeline_path()), [[]] * self.rank + [events], meta)
                return
            gathered = (self.world.tx.gather_object(events, root=0)
                        if clean and self.size > 1 else None)
            if self.rank == 0 and clean:
                write_trace(self.timeline_path(), gathered or [events], meta)
                logger.info("HiPress timeline written to %s", self.timeline_path())
        except Exception:  # noqa: BLE001 - never mask the real outcome
            logger.exception("could not write the HiPress timeline to %s", self.cfg.timeline)

    def timeline_path(self) -> str:
        """Return this rank's timeline file (``{rank}`` in the configured path filled in)."""
        return str(self.cfg.timeline).format(rank=self.rank)


class _StallWatch:
    """Warn every ``warning_s`` seconds while something waits; fatal after ``limit_s``.

    The waited time is passed in by the caller (a round in flight, the oldest incomplete
    name, a goodbye); once it falls back to ``warning_s`` or below, warnings start over.
    """

    def __init__(self, warning_s: float, limit_s: float) -> None:
        self.warning_s, self.limit_s = warning_s, limit_s
        self._next = warning_s

    def check(self, waited: float) -> Optional[str]:
        """Return ``"fatal"`` past the limit, ``"warn"`` when a warning is due, else None."""
        if waited > self.limit_s:
            return "fatal"
        if waited <= self.warning_s:
            self._next = self.warning_s
            return None
        if waited > self._next:
            self._next = (waited // self.warning_s + 1) * self.warning_s
            return "warn"
        return None


def _layout_fits(mem: Memory, name: str, held: List[str], keys: Optional[List[str]],
                 path: str, parts: int) -> bool:
    """Whether ``name``'s stored residuals are kept for ``parts`` partitions on ``path``.

    ``held``: its stored ``name#p<i>`` keys from 0 up (or ``[name]``); ``keys``: those the
    path and partitions use (None on the ring path). The sizes follow from the element
    count, which the engine already checks.
    """
    prefix = f"{name}#p"
    others = []
    for k in mem.keys():
        if k.startswith(prefix) and k not in held:
            rest = k[len(prefix):]
            digits = len(rest) - len(rest.lstrip("0123456789"))
            others.append((int(rest[:digits]) if digits else -1, rest[digits:]))
    if not held and not others:
        return True  # nothing stored yet
    if path == "ring":
        return not held and all(0 <= i < parts and rest.startswith("c") for i, rest in others)
    return keys == held and all(0 <= i < parts and rest == "@agg" for i, rest in others)


def _describe_stall(stall: List[list], size: int, limit: int = 8) -> str:
    """Describe ``[[name, missing ranks], ...]`` for stall warnings and errors."""
    lines = [f"{name!r} not submitted by rank(s) {missing} (submitted by "
             f"{sorted(set(range(size)) - set(missing))})" for name, missing in stall[:limit]]
    if len(stall) > limit:
        lines.append(f"{len(stall) - limit} more gradient(s)")
    return "; ".join(lines)


def _finite_flag(sub: _Submission) -> int:
    """Return 0 if a compressed submission holds inf/NaN, else 1 (uncompressed: always 1).

    Only gradients headed for a codec are scanned (one sum, about 1 ms per 20 MiB):
    uncompressed sums carry inf/NaN to every rank by themselves.
    """
    if sub.codec is None or sub.kind != "allreduce" or not sub.contributes:
        return 1
    xp = array_module(sub.array)
    # one reduction, no temporary, accumulated in float32 at least (a float16 sum of a
    # large gradient would overflow): inf/NaN make the sum non-finite; finite values
    # whose sum overflows (|sum| > 3e38) only send this gradient uncompressed once
    return int(bool(xp.isfinite(sub.array.sum(dtype=compute_dtype(sub.array.dtype)))))


def _round_interval(cycle_s: float, idle_rounds: int) -> float:
    """Seconds between negotiation rounds after ``idle_rounds`` rounds without new names.

    ``cycle_s`` is the engine's current cycle (``sync.cycle_time_ms``, or
    ``sync.max_cycle_time_ms`` while less than a partition's worth of bytes is queued).
    One cycle while names arrive; then doubling per idle round up to
    :data:`_IDLE_ROUND_MAX_S`. Idle rounds cost every rank CPU (a forward pass alone
    would otherwise run a hundred of them per second); a rank with new names starts a
    round after one cycle anyway, and the others join it as soon as their own gradients
    arrive or their interval ends.
    """
    return min(cycle_s * (1 << min(idle_rounds, 16)), max(cycle_s, _IDLE_ROUND_MAX_S))


def _shape_meta(sub: _Submission) -> Optional[List[int]]:
    """Return the shape ranks must agree on (or exchange) for ``sub``, else None.

    Allreduces (a result has the shape of its input, so ranks must agree on it, as
    Horovod checks) and allgather, alltoall and reducescatter (they work along dimension
    0) carry it. A broadcast carries its byte count instead, ``[nbytes]``: only the
    root's is used, to size every rank's receives (objects have a size only the root
    knows).
    """
    if sub.kind == "broadcast":
        return [int(sub.array.size) * int(sub.array.dtype.itemsize)]
    return [int(d) for d in sub.array.shape]


def _check_name_op(name: Any, op: str, what: str) -> None:
    """Refuse a name that is not a non-empty string and an op not in :data:`OPS`.

    Raises:
        ValueError: naming the bad value.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"{what} name must be a non-empty string, got {name!r}")
    if op not in OPS:
        raise ValueError(f"op must be one of {OPS}, got {op!r}")


def _check_op_dtype(op: str, dtype: np.dtype, name: str) -> None:
    """Refuse an average of an integer or bool tensor (it would have to truncate).

    Raises:
        TypeError: ``op == "average"`` and ``dtype`` is not floating.
    """
    if op == "average" and dtype.kind in "iub":
        raise TypeError(
            f"op='average' of {dtype} tensor {name!r}: an integer average would truncate. "
            "Use op='sum' and divide by size() yourself, or cast the tensor to a float dtype")


def _check_splits(splits: Any, rows: int, size: int) -> Any:
    """Return alltoall's ``splits`` as a list of ints, or a message saying what is wrong.

    None splits ``rows`` into ``size`` equal parts (``rows`` must divide evenly).
    """
    if splits is None:
        if rows % size:
            return (f"the first dimension {rows} does not divide into {size} equal parts; "
                    "pass splits (rows for each rank)")
        return [rows // size] * size
    try:
        vals = [int(v) for v in splits]
        if any(v != float(w) for v, w in zip(vals, splits)):
            raise ValueError
    except (TypeError, ValueError):
        return f"splits must be integers (rows for each rank), got {splits!r}"
    if len(vals) != size:
        return f"splits has {len(vals)} entries for {size} ranks: {vals}; give one per rank"
    if any(v < 0 for v in vals):
        return f"splits must not be negative, got {vals}"
    if sum(vals) != rows:
        return (f"splits {vals} add up to {sum(vals)} but the first dimension is {rows}; "
                "they must add up to it")
    return vals


def _extra(meta: list, key: str) -> Any:
    """Return ``key`` of a negotiation entry's extra dict (None when absent or not a dict)."""
    return meta[10].get(key) if isinstance(meta[10], dict) else None


def _refusals(metas: List[list]) -> str:
    """Return the ranks' own argument errors (extra ``"error"``), joined; "" when none."""
    return "; ".join(f"rank {r}: {_extra(m, 'error')}" for r, m in enumerate(metas)
                     if _extra(m, "error"))


def _group_sizes(metas: List[list]) -> Dict[int, Optional[int]]:
    """Return each contributing rank's grouped_allreduce size (None: a single allreduce)."""
    return {r: _extra(m, "group") for r, m in enumerate(metas) if not m[11]}


def _groups_differ(metas: List[list]) -> bool:
    """Return True if the ranks submitted an allreduce in groups of different sizes."""
    return metas[0][4] == "allreduce" and len(set(_group_sizes(metas).values())) > 1


def _submission_mismatch(name: str, metas: List[list]) -> Optional[str]:
    """Return why an allreduce or broadcast cannot run, or None.

    A rank's refusal (:meth:`Engine._refuse`) first; then, for allreduce, that every rank
    submitted the same element count, dtype, compression, op, strategy, partitions and
    shape, in a group of the same size (``grouped_allreduce``; ranks that joined are not
    compared); for broadcast the kind and the root, and the shape and dtype of tensor
    broadcasts (``Engine.broadcast(check=True)``; for objects only the root knows the size).
    """
    first = metas[0]
    if not _extra(first, "error") and all(m == first for m in metas[1:]):
        return None  # the same entry on every rank (every step after the first)
    errors = _refusals(metas)
    if errors:
        return f"allreduce {name!r} was refused; {errors}"
    sl = slice(4, 6) if first[4] == "broadcast" else slice(0, 9)
    bad = [r for r in range(len(metas)) if metas[r][sl] != first[sl]]
    if _groups_differ(metas):
        return (f"ranks disagree about the group of allreduce {name!r} (tensors in the "
                f"grouped_allreduce call, None: a single allreduce): {_group_sizes(metas)}. "
                "Every rank must pass the same tensors, under the same names, to "
                "grouped_allreduce")
    if not bad and first[4] == "broadcast" and all(isinstance(m[10], dict) for m in metas):
        tensors = {r: m[10] for r, m in enumerate(metas)}
        if len({json.dumps(t, sort_keys=True) for t in tensors.values()}) > 1:
            return (f"ranks disagree about the tensor of broadcast {name!r}: {tensors}. "
                    "Every rank must pass a tensor of the root's shape and dtype")
    if not bad:
        return None
    desc = {}
    for r in [0] + bad:
        d = dict(zip(_META_KEYS[:9], metas[r]))
        d["dtype"] = str(CODE_DTYPES.get(d["dtype"], d["dtype"]))
        if d["kind"] == "broadcast":  # a broadcast carries its byte count, not a shape
            d["nbytes"] = d.pop("shape")[0]
        desc[r] = d
    return (f"ranks disagree about {first[4]} {name!r}: {desc}. Every rank must submit the "
            "same shape, dtype, op, compression and strategy for a name (and use the same "
            "config and SeCoPa plan)")


def _collective_mismatch(name: str, metas: List[list]) -> Optional[str]:
    """Return why an allgather/alltoall/reducescatter cannot run, or None.

    Checks every rank's local argument errors, then that the ranks agree on the
    operation, dtype and (allgather, alltoall) trailing dimensions or (reducescatter)
    shape and op.
    """
    kind = metas[0][4]
    errors = _refusals(metas)
    if errors:
        return f"{kind} {name!r} has invalid arguments; {errors}"

    def differ(key: str, value: Any) -> Optional[str]:
        vals = {r: value(m) for r, m in enumerate(metas)}
        if len({json.dumps(v) for v in vals.values()}) > 1:
            return (f"ranks disagree about the {key} of {kind} {name!r}: {vals}. Every rank "
                    f"must call the same collective with the same {key} under a name")
        return None

    dtype_name = (lambda m: str(CODE_DTYPES.get(m[1], "?")))  # noqa: E731
    if kind == "reducescatter":
        checks = [("operation", lambda m: m[4]), ("dtype", dtype_name),
                  ("shape", lambda m: m[8]), ("op", lambda m: m[3])]
    else:
        checks = [("operation", lambda m: m[4]), ("dtype", dtype_name),
                  ("trailing dimensions", lambda m: m[8][1:])]
    for key, value in checks:
        err = differ(key, value)
        if err is not None:
            return err
    return None


def _writable_contiguous(array: Any) -> bool:
    """Return True if results can be written into ``array`` itself (C-contiguous, writable)."""
    flags = getattr(array, "flags", None)
    return bool(flags is not None and flags.c_contiguous and getattr(flags, "writeable", True))


def _codec_key(name: str, params: Dict[str, Any]) -> str:
    return name + ("?" + json.dumps(params, sort_keys=True) if params else "")


def _split_key(key: str) -> Tuple[str, Dict[str, Any]]:
    name, _, params = key.partition("?")
    return name, (json.loads(params) if params else {})


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024.0
    return f"{n:.1f} GiB"


def build_codec(algo: str, params: Dict[str, Any]) -> Codec:
    """Build a codec from a registered name or a CompLL spec path (``*.hpc``)."""
    if algo.endswith(".hpc"):
        from hipress import compll

        cls = compll.load_spec(algo)
        return cls(**params)
    return get_codec(algo, **params)
