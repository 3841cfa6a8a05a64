"""The framework-neutral public API, Horovod-style: ``import hipress as hp``.

>>> import hipress as hp
>>> hp.init()                                   # config from HIPRESS_CONFIG, or defaults
>>> g = hp.allreduce(np.ones(4, np.float32), name="loss")       # exact average over ranks
>>> h = hp.allreduce_async(grad, name="conv1.weight", codec="onebit")   # compressed
>>> h = hp.allreduce_async(grad, name="fc.weight", codec="auto")    # the config's policy
>>> g = hp.synchronize(h)

Arrays are NumPy (CPU) or CuPy (GPU). CuPy arrays are staged through host memory for
transport (the MPI from PyPI is not CUDA-aware); encode and decode run on the GPU.
"""

from __future__ import annotations

import atexit
import gc
import logging
import os
import pickle
import sys
import threading
import time
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from hipress import comm
from hipress.engine import Engine, Handle
from hipress.errors import HiPressError

logger = logging.getLogger("hipress")

_ENGINE: Optional[Engine] = None
_LOCK = threading.Lock()
_COUNTERS: Dict[str, int] = {}
_PENDING_NOTES: List[Tuple[str, Any]] = []


def init(config: Any = None, **overrides: Any) -> None:
    """Start HiPress on this process (collective: every rank must call it).

    Args:
        config: a :class:`hipress.config.HiPressConfig`, a dict in the YAML schema, a path
            to a YAML job file, or None for ``HIPRESS_CONFIG`` / the defaults. The
            ``HIPRESS_*`` environment variables (``hipressrun --timeline`` sets
            ``HIPRESS_TIMELINE``) apply over any of them.
        **overrides: dotted keys that override the config, e.g.
            ``init(**{"compression.algorithm": "onebit"})``.

    Calling ``init`` again while initialized does nothing.

    Raises:
        ConfigError: the configuration is invalid (the message names the key).
    """
    global _ENGINE
    from hipress.config import HiPressConfig, load_config

    with _LOCK:
        if _ENGINE is not None:
            return
        if isinstance(config, (HiPressConfig, dict)):
            data = config.model_dump() if isinstance(config, HiPressConfig) else dict(config)
            cfg = load_config(base=data, overrides=overrides or None)
        else:
            cfg = load_config(path=config, overrides=overrides or None)
        _setup_logging(cfg.logging.level)
        _tune_malloc()
        world = comm.world(cfg.transport)
        _install_excepthook()
        _ENGINE = Engine(cfg, world, _planner(cfg, world))
        for source, codec in _PENDING_NOTES:
            _ENGINE.note_compression(source, codec)
        if world.rank == 0:
            from hipress.config import dump_effective

            # the one-line INFO summary follows at the first gradient (see Engine._announce)
            logger.debug("%s", dump_effective(cfg))
        atexit.register(_shutdown_at_exit)


def _shutdown_at_exit() -> None:
    """:func:`shutdown` at interpreter exit; after an unclean one, skip the final GC pass.

    A rank that leaves while its peers still wait for its gradients (it is exiting on an
    error, e.g. ``sys.exit(3)``) must be gone before they give up waiting, so that the
    launcher reports it, not them, as the first failure (torchrun's "Root Cause"). With
    PyTorch imported, the interpreter's final garbage collection alone takes about 0.8 s
    on an idle core (measured here), longer under load; ``gc.freeze()`` leaves the
    objects alive at exit out of it (0.2 s). Nothing is lost: the process is ending and
    the operating system reclaims its memory.
    """
    shutdown()
    if _UNCLEAN:
        gc.freeze()


def _planner(cfg: Any, world: Any) -> Any:
    """Return SeCoPa's plan follower when ``sync.plan`` asks for a plan, else None.

    None gives the engine its fixed policy; SeCoPa (which profiles by driving the engine's
    task graphs) is imported only when a plan is asked for.
    """
    if str(cfg.sync.plan).strip().lower() == "none":
        return None
    from hipress.engine.engine import build_codec
    from hipress.secopa.runtime import PlanFollower

    return PlanFollower(cfg, world, build_codec)


def _tune_malloc() -> None:
    """Keep large freed buffers in the heap instead of returning them to the kernel.

    Codec and merge buffers of a few MiB are allocated and freed every step; glibc's
    default serves them with fresh ``mmap`` pages, so every step pays a page fault per
    4 KiB (measured here: the EF-onebit PS pipeline runs 1.2 -> 1.9 GB/s with this). The
    same effect as ``MALLOC_MMAP_THRESHOLD_``/``MALLOC_TRIM_THRESHOLD_``; skipped on
    non-glibc systems and when ``HIPRESS_MALLOC_TUNING=0``.
    """
    if os.environ.get("HIPRESS_MALLOC_TUNING", "1") == "0" or not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        m_trim_threshold, m_top_pad, m_mmap_threshold = -1, -2, -3
        libc.mallopt(m_mmap_threshold, 32 << 20)
        libc.mallopt(m_trim_threshold, 512 << 20)
        libc.mallopt(m_top_pad, 64 << 20)
    except (OSError, AttributeError):
        logger.debug("malloc tuning skipped: no glibc mallopt")


def _setup_logging(level: str) -> None:
    log = logging.getLogger("hipress")
    log.setLevel(level.upper() if isinstance(level, str) else level)
    if not log.handlers and not logging.getLogger().handlers:
        h = logging.StreamHandler()
        h.setFormatter(logging.Formatter("[hipress %(levelname)s] %(message)s"))
        log.addHandler(h)


def shutdown() -> None:
    """Finish outstanding work on every rank and stop HiPress (collective, idempotent).

    Called at interpreter exit too. It waits for every rank to shut down; a rank whose
    peers still wait for its gradients (ranks ran different numbers of steps) logs an
    error naming them and returns without finalizing MPI, so the launcher ends the job.
    After an uncaught exception the process ends at once instead (see
    :func:`_install_excepthook`).
    """
    global _ENGINE, _UNCLEAN
    with _LOCK:
        eng, _ENGINE = _ENGINE, None
    if eng is None:
        return
    if _FAILURE and eng.size > 1:
        _abort(eng)
    if eng.shutdown():
        comm.release()
    else:
        _UNCLEAN = True
        comm.mark_unclean()  # communicators may be in use by peers: neither free nor finalize


_FAILURE: List[BaseException] = []
_HOOKED = False
_UNCLEAN = False  # this process's shutdown left while peers still waited for it


def _install_excepthook() -> None:
    """Record an uncaught exception so that exit ends this rank at once (collective-free).

    Python runs ``atexit`` handlers after printing the traceback; a goodbye to ranks that
    are blocked waiting for this one could never finish, and freeing the communicators
    under the engine thread crashes. So :func:`shutdown` then calls :func:`_abort`: the
    process exits with Python's status for the exception, without ``MPI_Finalize``, and
    ``mpirun`` (or ``hipressrun``) terminates the other ranks within about a second and
    reports this rank.
    """
    global _HOOKED
    if _HOOKED:
        return
    _HOOKED = True
    previous = sys.excepthook

    def hook(tp: Any, value: BaseException, tb: Any) -> None:
        _FAILURE.append(value)
        previous(tp, value, tb)

    sys.excepthook = hook


def _abort(eng: Engine) -> None:
    """End this rank now after an uncaught exception (see :func:`_install_excepthook`)."""
    exc = _FAILURE[0]
    code = 130 if isinstance(exc, KeyboardInterrupt) else 1
    from hipress.errors import PeerFailure

    if isinstance(exc, PeerFailure) or isinstance(exc.__cause__, PeerFailure):
        # a consequence of another rank's failure: give that rank a moment to be reported
        # first (mpirun names the first rank to exit), then go
        time.sleep(2.0)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    eng.timeline.flush()
    os._exit(code)


def is_initialized() -> bool:
    """Return True between :func:`init` and :func:`shutdown`."""
    return _ENGINE is not None


def _engine() -> Engine:
    if _ENGINE is None:
        raise HiPressError("HiPress is not initialized: call hipress.init() first")
    return _ENGINE


def rank() -> int:
    """Return this process's rank in [0, size())."""
    return _engine().rank


def size() -> int:
    """Return the number of processes (world size)."""
    return _engine().size


def local_rank() -> int:
    """Return this process's rank among the processes on its host (for GPU selection)."""
    return _engine().world.local_rank


def local_size() -> int:
    """Return the number of processes on this host."""
    return _engine().world.local_size


def allreduce_async(array: Any, name: str, op: str = "average", codec: Any = None,
                    strategy: Optional[str] = None, contributes: bool = True,
                    inplace: bool = False) -> Handle:
    """Start reducing ``array`` over all ranks under ``name``; return a :class:`Handle`.

    Args:
        array: NumPy or CuPy array of float16, bfloat16, float32 or float64, any shape.
            It must not be modified until the handle completes.
        name: stable name of the gradient, identical on every rank (ranks agree by name,
            not by submission order); unique among outstanding operations.
        op: "average", "sum", "min", "max" or "product" (:data:`Average` ...). Min, max
            and product run uncompressed (``codec=None``).
        codec: None (default): no codec, the result is exact (the uncompressed average
            or sum), as for metrics, losses and counts. ``"auto"``: the job's compression
            policy (``compression.algorithm``, per-layer ``rules``, ``min_compress_bytes``,
            ``warmup_steps``), which is what the optimizer wrappers, DDP hooks and trainers
            submit. A codec name (:func:`hipress.codecs.codec_names`) or instance: that
            codec for this array, whatever its size and the step (the name of
            ``compression.algorithm`` takes ``compression.params``). A gradient holding
            inf/NaN on any rank is summed uncompressed that step, so every rank receives
            it non-finite and its residual stays as it was.
        strategy: None (chosen from the codec's capabilities and ``sync.strategy``),
            "ps", "ring", "allreduce" (compressed allreduce of a summable codec) or
            "gather".
        contributes: False when this rank has no gradient for ``name`` (an unused
            parameter): pass zeros; the rank still takes part, and its error-feedback
            residual for ``name`` is left untouched.
        inplace: write the result into ``array`` itself (when it is C-contiguous and
            writable; otherwise a new array is returned as usual), saving an allocation
            and a copy per step. The adapters use it for gradients they own.

    Returns:
        A handle; :func:`synchronize` returns an array of ``array``'s shape and dtype,
        bit-identical on every rank: a new one, or ``array`` itself with ``inplace``.
        At world size 1 nothing travels: the result is ``array`` exactly (no codec runs,
        no residual changes) and the handle is already complete.

    Dtypes: with ``codec=None`` any of :data:`hipress.backend.COLLECTIVE_DTYPES`
    (float16, bfloat16, float32, float64, int8 ... uint64, bool); integer sums wrap as
    integer arithmetic does, and a bool sum/max is a logical or, min/product a logical
    and. An ``"average"`` of an integer or bool array is refused (it would truncate): use
    ``"sum"`` and divide, or cast to a float. With a codec, floats only.

    Raises:
        ValueError: bad op/strategy, a codec with min/max/product, or ``name`` already in
            flight.
        TypeError: a dtype the op or codec cannot take (see above).
        SyncError: the engine failed earlier.
    """
    return _engine().submit(array, name, op=op, codec=codec, strategy=strategy,
                            contributes=contributes, inplace=inplace)


def allreduce(array: Any, name: str, op: str = "average", codec: Any = None,
              strategy: Optional[str] = None, contributes: bool = True,
              inplace: bool = False) -> Any:
    """Reduce ``array`` over all ranks and return the result (blocking).

    See :func:`allreduce_async` for the arguments.
    """
    return synchronize(allreduce_async(array, name, op, codec, strategy, contributes, inplace))


def grouped_allreduce_async(arrays: List[Any], names: List[str], op: str = "average",
                            codec: Any = None, inplace: bool = False) -> List[Handle]:
    """Start allreduces of several arrays negotiated together; return one handle each.

    The arrays travel in one negotiation message, so they become ready in the same round
    on every rank and small ones share fusion buffers. Arguments as in
    :func:`allreduce_async`, one name per array.

    Raises:
        ValueError: ``arrays`` and ``names`` differ in length, a name repeats or is in
            flight, or a bad op.
    """
    return _engine().submit_group(list(arrays), list(names), op=op, codec=codec,
                                  inplace=inplace)


def grouped_allreduce(arrays: List[Any], names: List[str], op: str = "average",
                      codec: Any = None, inplace: bool = False) -> List[Any]:
    """Allreduce several arrays in one negotiation; return the results in input order."""
    return [synchronize(h) for h in grouped_allreduce_async(arrays, names, op, codec, inplace)]


class MappedHandle:
    """A handle whose result is another handle's, passed through a function once.

    Returned by the collectives whose raw result needs reshaping or moving to the GPU;
    :func:`synchronize` and :func:`poll` accept it like a :class:`Handle`.
    """

    def __init__(self, inner: Any, fn: Any) -> None:
        self.name = getattr(inner, "name", "")
        self._inner, self._fn = inner, fn
        self._done = False
        self._value: Any = None

    def done(self) -> bool:
        """Return True once the result (or an error) is available."""
        return self._inner.done()

    def wait(self, timeout: Optional[float] = None) -> Any:
        """Block until done; return the mapped result (see :meth:`Handle.wait`)."""
        if not self._done:
            self._value = self._fn(self._inner.wait(timeout))
            self._done = True
        return self._value


def _like(result: Any, array: Any) -> Any:
    """Return a host ``result`` on ``array``'s device (CuPy inputs get CuPy results)."""
    if isinstance(array, np.ndarray):
        return result
    from hipress.backend import array_module

    return array_module(array).asarray(result)


def allgather_async(array: Any, name: str) -> MappedHandle:
    """Start gathering every rank's ``array`` along dimension 0; see :func:`allgather`."""
    return MappedHandle(_engine().collective("allgather", array, name),
                        lambda res: _like(res[0], array))


def allgather(array: Any, name: str) -> Any:
    """Return every rank's ``array`` concatenated along dimension 0, in rank order.

    Args:
        array: NumPy or CuPy array with ``ndim >= 1`` of any collective dtype; the first
            dimension may differ across ranks, the others must not.
        name: identical on every rank, unique among outstanding operations.

    Returns:
        An array of shape ``(sum of every rank's shape[0], *array.shape[1:])``, identical
        on every rank.

    Raises:
        CollectiveArgumentError: on every rank, before data moves, when the trailing
            dimensions or dtypes differ across ranks (the message lists them).
    """
    return synchronize(allgather_async(array, name))


def allgather_rows(array: Any, name: str) -> Tuple[Any, List[int]]:
    """Return :func:`allgather`'s result and the first dimension of every rank's array.

    For adapters that need each rank's share (the backward pass of a differentiable
    allgather); the result is on the host.
    """
    out, rows = _engine().collective("allgather", array, name).wait()
    return out, list(rows)


def allgather_object(obj: Any, name: str = "") -> List[Any]:
    """Return the list of every rank's picklable ``obj``, in rank order (control data)."""
    if not name:
        name = _auto_name("allgather_object")
    raw, rows = allgather_rows(np.frombuffer(pickle.dumps(obj), dtype=np.uint8), name)
    offs = np.concatenate([[0], np.cumsum(rows)]).astype(int)
    return [pickle.loads(raw[offs[r]:offs[r + 1]].tobytes()) for r in range(len(rows))]


def alltoall_async(array: Any, name: str, splits: Optional[List[int]] = None) -> MappedHandle:
    """Start an alltoall; see :func:`alltoall`."""
    return MappedHandle(_engine().collective("alltoall", array, name, splits=splits),
                        lambda res: (_like(res[0], array), list(res[1])))


def alltoall(array: Any, name: str, splits: Optional[List[int]] = None) -> Tuple[Any, List[int]]:
    """Send ``splits[j]`` rows of ``array`` to each rank j; return what every rank sent here.

    Args:
        array: NumPy or CuPy array with ``ndim >= 1`` of any collective dtype; trailing
            dimensions equal on every rank.
        name: identical on every rank, unique among outstanding operations.
        splits: rows for each rank in rank order (``size()`` non-negative integers adding
            up to ``array.shape[0]``); None splits dimension 0 equally (it must divide by
            ``size()``).

    Returns:
        ``(received, received_splits)``: the rows from every rank concatenated in source
        rank order, and how many rows came from each rank.

    Raises:
        CollectiveArgumentError: on every rank, before data moves, when any rank's splits
            are invalid or trailing dimensions/dtypes differ (the message names the rank).
    """
    return synchronize(alltoall_async(array, name, splits))


def reducescatter_async(array: Any, name: str, op: str = "average") -> MappedHandle:
    """Start a reduce-scatter; see :func:`reducescatter`."""
    return MappedHandle(_engine().collective("reducescatter", array, name, op=op),
                        lambda res: _like(res, array))


def reducescatter(array: Any, name: str, op: str = "average") -> Any:
    """Reduce ``array`` over ranks and return this rank's block of rows.

    Dimension 0 is split as evenly as possible, the first ``shape[0] % size()`` ranks
    getting one row more (as Horovod); rank r gets the reduction of rows
    ``[start_r, end_r)`` of every rank's ``array``. Exact (uncompressed); ops and dtypes
    as for :func:`allreduce_async` with ``codec=None``.

    Raises:
        TypeError: an average of an integer or bool array.
        CollectiveArgumentError: on every rank when shapes, dtypes or ops differ.
    """
    return synchronize(reducescatter_async(array, name, op))


def broadcast_async(array: Any, root: int, name: str) -> MappedHandle:
    """Start a broadcast of ``root``'s ``array``; :func:`synchronize` returns it (new array).

    Raises:
        ValueError: ``root`` is not a rank.
        CollectiveArgumentError: on every rank (from :func:`synchronize`) when the ranks'
            arrays differ in shape or dtype.
    """
    xp_arr = np.ascontiguousarray(array) if isinstance(array, np.ndarray) else array

    def typed(raw: Any) -> Any:
        out = np.frombuffer(raw.tobytes(), dtype=array.dtype).reshape(array.shape)
        return _like(out, array) if not isinstance(array, np.ndarray) else out.copy()

    return MappedHandle(_engine().broadcast(xp_arr, root, name, check=True), typed)


def join() -> int:
    """Say this rank has run out of data; return the rank that joined last.

    Until every rank has joined, a joined rank takes part in the other ranks' sum and
    average allreduces with zeros (leaving its residuals untouched) and is not counted in
    averages: an average divides by the ranks that contributed. Other collectives
    cannot run against joined ranks and fail on every rank with a
    :class:`~hipress.errors.CollectiveArgumentError`. Blocks until every rank has
    joined; then every rank returns the same rank (of ranks joining in the same
    negotiation round, the highest). Usable again afterwards (e.g. once per epoch).
    """
    return synchronize(_engine().join())


def cross_rank() -> int:
    """Return this rank's index among the ranks with the same :func:`local_rank`.

    That is its host's index when every host runs the same number of ranks (Horovod's
    ``cross_rank``).
    """
    return _engine().world.cross_rank


def cross_size() -> int:
    """Return the number of ranks with this :func:`local_rank` (hosts, when homogeneous)."""
    return _engine().world.cross_size


def is_homogeneous() -> bool:
    """Return True when every host runs the same number of ranks."""
    return _engine().world.homogeneous


def synchronize(handle: Handle) -> Any:
    """Wait for an asynchronous operation and return its result.

    Raises:
        SyncError: the operation failed on this rank or another (stall, dead rank); the
            message names the gradient and ranks.
        CollectiveArgumentError: the ranks' submissions disagree (shape, dtype, op,
            compression) or a rank refused its arguments; raised on every rank.
        TypeError: ``handle`` is not a handle from an ``*_async`` call.
    """
    return _handle(handle, "synchronize").wait()


def poll(handle: Handle) -> bool:
    """Return True if ``handle`` has completed (never blocks).

    Raises:
        TypeError: ``handle`` is not a handle from an ``*_async`` call.
    """
    return _handle(handle, "poll").done()


def _handle(handle: Any, what: str) -> Any:
    """Return ``handle`` if it is one (wait/done), else raise a TypeError naming it."""
    if not (hasattr(handle, "wait") and hasattr(handle, "done")):
        raise not_a_handle(handle, what)
    return handle


def not_a_handle(handle: Any, what: str) -> TypeError:
    """Return the error for a ``handle`` argument that is not a handle (an adapter's too)."""
    return TypeError(
        f"{what}() expects the handle an *_async call returned, got "
        f"{type(handle).__name__} {handle!r} (HiPress handles are objects, not Horovod's "
        "integer ids: keep the returned handle and pass it)")


def broadcast(array: Any, root: int, name: str) -> Any:
    """Return ``root``'s ``array`` on every rank (a new array of the same shape and dtype).

    Raises:
        ValueError: ``root`` is not a rank.
    """
    return synchronize(broadcast_async(array, root, name))


def broadcast_object(obj: Any, root: int = 0, name: str = "") -> Any:
    """Return ``root``'s picklable ``obj`` on every rank (control data only, never gradients)."""
    eng = _engine()
    if not name:
        name = _auto_name("broadcast_object")
    data = pickle.dumps(obj) if eng.rank == root else b""
    raw = eng.broadcast(np.frombuffer(data, dtype=np.uint8), root, name).wait()
    return obj if eng.rank == root else pickle.loads(raw.tobytes())


def barrier() -> None:
    """Block until every rank has called :func:`barrier`."""
    broadcast_object(None, 0, _auto_name("barrier"))


def _auto_name(prefix: str) -> str:
    n = _COUNTERS.get(prefix, 0)
    _COUNTERS[prefix] = n + 1
    return f"__{prefix}.{n}"


def step() -> None:
    """Mark the end of a training step (counts warm-up steps; adapters call it)."""
    _engine().step()


def state_dict() -> Dict[str, Any]:
    """Return residuals and codec state keyed by gradient name (NumPy arrays; picklable).

    May be called from any thread at any time, also while other threads submit new
    gradients; values of gradients still in flight may be caught between two steps, so
    checkpoint after synchronizing a step's handles. See
    :meth:`hipress.engine.Engine.state_dict` for the layout.
    """
    return _engine().state_dict()


def load_state_dict(state: Dict[str, Any]) -> None:
    """Restore :func:`state_dict` output on this rank."""
    _engine().load_state_dict(state)


def reset_state(prefix: str = "") -> int:
    """Forget the error-feedback residuals of gradients whose names start with ``prefix``.

    For benchmarks and for models that drop layers; returns how many entries were dropped.
    """
    return _engine().reset_state(prefix)


def stats() -> Dict[str, Dict[str, Any]]:
    """Return per-gradient statistics on this rank.

    Keys per gradient: numel, codec, strategy (path taken: ps, ring, gather, allreduce
    (compressed allreduce), fused (small uncompressed gradients in a fused buffer), direct
    (uncompressed, reduced in place from the gradient's memory), broadcast, or local at
    world size 1), calls, bytes_sent (bytes this rank put on the wire), payload_bytes,
    raw_bytes, compression_ratio; bulk_calls (calls whose PS synchronization ran in bulk
    with other small gradients of the same round, present once one did).
    """
    return _engine().stats()


def note_compression(source: str, codec: Any) -> None:
    """Record compression set in code for the startup config line (adapters call it).

    Args:
        source: the API that set it, e.g. ``"DistributedOptimizer"``.
        codec: the engine ``codec`` argument that source uses (None/``"auto"``: the
            config's policy, nothing recorded).
    """
    if _ENGINE is not None:
        _ENGINE.note_compression(source, codec)
    else:  # e.g. a hook made before init(): recorded when the engine starts
        _PENDING_NOTES.append((source, codec))


def env_rank() -> int:
    """Return the rank the launcher assigned, before :func:`init` (0 if not launched)."""
    for key in ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "SLURM_PROCID"):
        if key in os.environ:
            return int(os.environ[key])
    return 0
