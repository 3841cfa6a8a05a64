"""The ``hipressrun`` launcher (imported as ``hipress.launch``).

A pure command builder plus a thin exec, after DeepSpeed's launcher: :mod:`.hosts` parses
host lists, hostfiles and Slurm allocations; :mod:`.runner` turns a :class:`LaunchSpec`
into the argv of Open MPI's ``mpirun`` or MPICH's ``mpiexec``; :mod:`.relay` runs it,
prefixes output with ranks and names the rank that failed; :mod:`.cli` is the command line
(``hipressrun``, also ``python -m hipress.launch``); :mod:`.check` is ``--check``.
"""

from hipress.launch.hosts import Host, HostError, parse_hostfile, parse_hosts
from hipress.launch.runner import LaunchSpec, MPICHRunner, MPIError, OpenMPIRunner, detect_mpi

__all__ = [
    "Host",
    "HostError",
    "LaunchSpec",
    "MPICHRunner",
    "MPIError",
    "OpenMPIRunner",
    "detect_mpi",
    "parse_hostfile",
    "parse_hosts",
]
