"""``hipressrun``: start a HiPress job on this machine or across hosts through MPI.

Usage::

    hipressrun -np 4 python train.py --epochs 5
    hipressrun -np 16 -H gpu1:8,gpu2:8 --network-interface eth0 python train.py
    hipressrun --config configs/digits-torch.yaml            # command and cluster from YAML
    hipressrun --config job.yaml -np 2 --timeline /tmp/t.json --dry-run

Precedence: defaults < the ``--config`` YAML (``job.command``/``job.args`` and
``cluster.*``) < the command line. A command given on the line replaces ``job.command``
and ``job.args``; ``-x`` variables are added to ``cluster.env`` (a name given in both
takes the command line's value); ``-H``/``--hostfile`` replace the YAML's host source.
Inside a Slurm allocation with no host source the allocation's nodes and tasks are used.

Workers receive ``HIPRESS_CONFIG`` (absolute path of ``--config``), ``HIPRESS_TIMELINE``
(absolute path of ``--timeline``) and the forwarded variables; the engine reads its own
settings from them (see :mod:`hipress.config`). They also receive torch.distributed's
``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` and
``MASTER_PORT``, so ``init_process_group("gloo")`` with the default ``env://`` works as
under ``torchrun``.

``--network-interface`` (or ``cluster.network_interface``) must name interfaces of the
launching host, checked before anything starts: ``mpirun`` runs here and uses them for
its own out-of-band channel even when every rank is remote. A comma-separated list is
checked item by item; a subnet in CIDR form (``10.0.0.0/24``, which Open MPI accepts for
hosts whose interface names differ) is passed on unchecked.

Exit status: 0 on success; 2 for usage and configuration errors (nothing launched); the
failed rank's status when the job fails; 128 + N when stopped by signal N.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import shlex
import socket
import sys
from typing import Dict, List, Mapping, Optional, Sequence

from hipress.config import HiPressConfig, load_config
from hipress.errors import ConfigError
from hipress.launch.hosts import (
    Host,
    is_local_host,
    parse_hostfile,
    parse_hosts,
    slurm_allocation,
)
from hipress.launch.runner import LaunchSpec, detect_mpi, env_assignments

__all__ = ["build_parser", "check_network_interface", "main", "parse_env_args", "resolve_spec"]

logger = logging.getLogger("hipress.launch")

_INT = re.compile(r"-?[0-9]+")
_CIDR = re.compile(r"[0-9]{1,3}(?:\.[0-9]{1,3}){3}/[0-9]{1,2}")


def _ascii_int(text: str) -> int:
    """Parse a count or port for argparse: ASCII digits only (``int`` also takes ``١٢``)."""
    if not _INT.fullmatch(text):
        raise argparse.ArgumentTypeError(f"expected a whole number (digits 0-9), got {text!r}")
    return int(text)


def build_parser() -> argparse.ArgumentParser:
    """Return the argument parser of ``hipressrun``."""
    p = argparse.ArgumentParser(
        prog="hipressrun",
        allow_abbrev=False,
        description="Launch a HiPress data-parallel job through MPI (Open MPI or MPICH).",
        epilog="Precedence: defaults < --config YAML < command line. Output lines are "
        "prefixed with [RANK]. Exit status 2 means a usage or configuration error.",
    )
    p.add_argument("-np", "-n", "--num-proc", dest="np", type=_ascii_int, metavar="N",
                   help="number of ranks (default: cluster.np of --config, or SLURM_NTASKS)")
    p.add_argument("-H", "--hosts", metavar="HOST:SLOTS,...",
                   help="comma-separated hosts with slots, e.g. localhost:2,10.0.0.3:1")
    p.add_argument("--hostfile", metavar="FILE", help="Open MPI hostfile (HOST slots=N lines)")
    p.add_argument("--network-interface", metavar="IF",
                   help="network interface(s) of MPI traffic, e.g. eth0; must exist on this "
                   "host (or give a subnet such as 10.0.0.0/24)")
    p.add_argument("--ssh-port", type=_ascii_int, metavar="P",
                   help="ssh port of the remote hosts")
    p.add_argument("-x", "--env", dest="env", action="append", default=[],
                   metavar="NAME[=VALUE]",
                   help="forward a variable to the workers (its current value if no =VALUE); "
                   "repeatable")
    p.add_argument("--config", metavar="job.yaml", help="HiPress YAML job config")
    p.add_argument("--timeline", metavar="PATH", help="write a Chrome-trace timeline to PATH")
    p.add_argument("--mpirun", metavar="PATH",
                   help="MPI launcher to use (default: the one beside this Python, else PATH)")
    p.add_argument("--dry-run", action="store_true", help="print the command and exit")
    p.add_argument("--check", action="store_true",
                   help="report available frameworks, MPI, CuPy and GPUs, and exit")
    p.add_argument("-v", "--verbose", action="store_true", help="log the command before running")
    p.add_argument("command", nargs=argparse.REMAINDER, help="the worker command")
    return p


def parse_env_args(items: Sequence[str], environ: Mapping[str, str]) -> Dict[str, str]:
    """Turn ``-x NAME[=VALUE]`` items into name -> value.

    ``NAME=VALUE`` keeps VALUE exactly (everything after the first ``=``); ``NAME`` alone
    takes the launcher's current value. Names that are not identifiers (``1A``, ``A-B``),
    and bare names not set in ``environ``, are skipped with a logged warning: a bad ``-x``
    never stops the launch.
    """
    out: Dict[str, str] = {}
    for item in items:
        name, eq, value = item.partition("=")
        if not name.isidentifier():
            logger.warning("skipping -x %r: %r is not a valid environment variable name",
                           item, name)
            continue
        if not eq:
            if name not in environ:
                logger.warning("skipping -x %s: it is not set in this environment", name)
                continue
            value = environ[name]
        out[name] = value
    return out


class _UsageError(Exception):
    """A usage or configuration problem: reported on stderr, exit status 2."""


def check_network_interface(value: str, available: Optional[Sequence[str]] = None) -> None:
    """Refuse network interfaces that do not exist on this (the launching) host.

    Args:
        value: ``--network-interface``: one name, or a comma-separated list; items in
            CIDR form (``10.0.0.0/24``) are not checked.
        available: the interface names of this host; None means
            :func:`socket.if_nameindex`.

    Raises:
        _UsageError: an empty item, or a name this host does not have (the message lists
            the ones it has).
    """
    if available is None:
        available = [name for _, name in socket.if_nameindex()]
    for item in value.split(","):
        if _CIDR.fullmatch(item):
            continue
        if not item or item not in available:
            raise _UsageError(
                f"network interface {item!r} does not exist on this host "
                f"({socket.gethostname()}); interfaces here: {', '.join(available) or 'none'}. "
                "mpirun uses it on this host too, so name one of these, or give a subnet such "
                "as 10.0.0.0/24 when the hosts' interface names differ"
            )


def resolve_spec(
    args: argparse.Namespace,
    cfg: Optional[HiPressConfig],
    environ: Mapping[str, str],
) -> LaunchSpec:
    """Merge the command line over the YAML config into a :class:`LaunchSpec`.

    Steps: 1. the command: the line's, else ``job.command + job.args``; 2. np: ``-np``,
    else ``cluster.np`` when the file sets it, else the Slurm task count; 3. hosts:
    ``-H``/``--hostfile``, else ``cluster.hosts``/``cluster.hostfile``, else the Slurm
    allocation, else localhost; 4. interface and ssh port: the line's, else the YAML's
    (the interface checked by :func:`check_network_interface`); 5. env: ``cluster.env``
    then ``-x`` then ``HIPRESS_CONFIG``/``HIPRESS_TIMELINE``; 6. torch.distributed's
    rendezvous: ``MASTER_ADDR`` and ``MASTER_PORT`` from the launcher's environment when
    set, else :func:`master_address` and :func:`free_port` (``RANK``, ``WORLD_SIZE``,
    ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE`` are set per rank by
    :data:`hipress.launch.runner.RANK_ENV_WRAPPER`).
    Relative paths (hostfile, config, timeline) are relative to the current directory,
    like the job's command, and are made absolute for the workers.

    Args:
        args: parsed command line.
        cfg: the ``--config`` file's config, or None.
        environ: the launcher's environment (for ``-x NAME`` and Slurm).

    Raises:
        _UsageError: conflicting or missing options, or a network interface this host
            does not have.
        ConfigError: malformed hosts, hostfile or Slurm variables.
    """
    cluster = cfg.cluster if cfg is not None else None
    # 1. command
    command = list(args.command or [])
    if command and command[0] == "--":
        command = command[1:]
    if not command and cfg is not None:
        command = list(cfg.job.command) + list(cfg.job.args)
    if not command:
        raise _UsageError("no command given: put it after the options (hipressrun -np 2 "
                           "python train.py) or set job.command in the --config file")
    # 3. hosts (before np: Slurm may give both)
    if args.hosts is not None and args.hostfile is not None:
        raise _UsageError("give either -H or --hostfile, not both")
    hosts, hostfile, slurm_np = None, None, None
    if args.hosts is not None:
        hosts = parse_hosts(args.hosts)
    elif args.hostfile is not None:
        hostfile = os.path.abspath(args.hostfile)
        hosts = parse_hostfile(hostfile)
    elif cluster is not None and cluster.hosts is not None:
        hosts = parse_hosts(cluster.hosts)
    elif cluster is not None and cluster.hostfile is not None:
        hostfile = os.path.abspath(cluster.hostfile)
        hosts = parse_hostfile(hostfile)
    else:
        alloc = slurm_allocation(environ)
        if alloc is not None:
            hosts, slurm_np = alloc
    # 2. np
    if args.np is not None:
        np_ = args.np
    elif cluster is not None and "np" in cluster.model_fields_set:
        np_ = cluster.np
    elif slurm_np is not None:
        np_ = slurm_np
    else:
        raise _UsageError("-np is required (or cluster.np in the --config file)")
    if np_ < 1:
        raise _UsageError(f"-np must be >= 1, got {np_}")
    # 4. network
    iface = args.network_interface or (cluster.network_interface if cluster else None)
    if iface is not None:
        check_network_interface(iface)
    ssh_port = args.ssh_port if args.ssh_port is not None else (
        cluster.ssh_port if cluster else None)
    if ssh_port is not None and not 1 <= ssh_port <= 65535:
        raise _UsageError(f"--ssh-port must be in 1..65535, got {ssh_port}")
    # 5. env
    env: Dict[str, str] = {}
    if cluster is not None:
        env.update(parse_env_args([f"{k}={v}" for k, v in cluster.env.items()], environ))
    env.update(parse_env_args(args.env, environ))
    if args.config:
        env["HIPRESS_CONFIG"] = os.path.abspath(args.config)
    if args.timeline:
        env["HIPRESS_TIMELINE"] = os.path.abspath(args.timeline)
    # 6. torch.distributed's env:// rendezvous, the same on every rank
    env.setdefault("MASTER_ADDR", environ.get("MASTER_ADDR") or master_address(hosts))
    env.setdefault("MASTER_PORT", environ.get("MASTER_PORT") or str(free_port()))
    return LaunchSpec(np=np_, command=command, hosts=hosts, hostfile=hostfile,
                      network_interface=iface, ssh_port=ssh_port, env=env)


def master_address(hosts: Optional[Sequence[Host]]) -> str:
    """Return the address of rank 0's host for torch.distributed (``MASTER_ADDR``).

    Ranks are mapped by slot, so rank 0 runs on the first host. A job on this machine only
    gets ``127.0.0.1``; when the first host is this machine but others are remote, its
    fully qualified name (which the remote hosts must resolve); else the first host's name.
    """
    if not hosts or all(is_local_host(h.name) for h in hosts):
        return "127.0.0.1"
    if is_local_host(hosts[0].name):
        return socket.getfqdn()
    return hosts[0].name


def free_port() -> int:
    """Return a TCP port that is free on this machine now (for ``MASTER_PORT``).

    Checked here only: when rank 0 runs on another host the port is very likely free
    there too; set ``MASTER_PORT`` in the environment to choose it yourself.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return int(sock.getsockname()[1])


def _setup_logging(verbose: bool) -> None:
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("hipressrun: %(levelname)s: %(message)s"))
        logger.addHandler(handler)
        logger.propagate = False
    logger.setLevel(logging.DEBUG if verbose else logging.INFO)


def main(argv: Optional[List[str]] = None, environ: Optional[Mapping[str, str]] = None) -> int:
    """Run ``hipressrun``; return its exit status (see the module docstring).

    Args:
        argv: the arguments (default ``sys.argv[1:]``).
        environ: the environment (default :data:`os.environ`).
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    environ = os.environ if environ is None else environ
    _setup_logging(args.verbose)
    if args.check:
        from hipress.launch.check import check_build

        return check_build(sys.stdout, args.mpirun)
    try:
        cfg = load_config(args.config, env={}) if args.config else None
        spec = resolve_spec(args, cfg, environ)
        runner = detect_mpi(args.mpirun)
        cmd = runner.get_cmd(spec, environ)
    except (_UsageError, ConfigError) as exc:
        sys.stderr.write(f"hipressrun: error: {exc}\n")
        return 2
    forwarded = runner.forwarded_env(spec, environ)
    # Only the values that differ from our environment need setting to reproduce the run.
    needed = {k: v for k, v in forwarded.items() if environ.get(k) != v}
    shown = shlex.join((["env", *env_assignments(needed)] if needed else []) + cmd)
    if args.dry_run:
        sys.stdout.write(shown + "\n")
        return 0
    logger.debug("running: %s", shown)
    from hipress.launch.relay import run_job

    return run_job(cmd, runner.get_env(spec, environ))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
