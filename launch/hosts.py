r"""Host lists for ``hipressrun``: ``-H`` specs, hostfiles and Slurm allocations.

Everything here is pure parsing: nothing connects to a host. Three sources give a list of
:class:`Host` (name and slot count):

- ``-H``/``cluster.hosts``: ``"localhost:2,10.0.0.3:1"`` or a list of ``"host:slots"``
  (a host without ``:slots`` has one slot);
- ``--hostfile``/``cluster.hostfile``: Open MPI's format, one ``HOST slots=N`` per line,
  blank lines and ``#`` comments allowed;
- a Slurm allocation: ``SLURM_JOB_NODELIST`` (``node[01-03],gpu5``) and
  ``SLURM_TASKS_PER_NODE`` (``2(x3),1``).

Host names are checked so that nothing reaches ``mpirun`` that it could read as an
option (a leading ``-``) or that a remote shell could interpret. Names, addresses and
counts are matched whole (a trailing newline is refused) and in ASCII: digits are
``[0-9]``, not ``\d`` or :meth:`str.isdigit`, which accept ``²`` or Arabic-Indic digits.
"""

from __future__ import annotations

import dataclasses
import os
import re
import socket
from typing import Iterable, List, Mapping, Optional, Sequence, Tuple, Union

from hipress.errors import ConfigError

__all__ = [
    "Host",
    "HostError",
    "expand_nodelist",
    "expand_tasks_per_node",
    "format_hosts",
    "is_local_host",
    "parse_hostfile",
    "parse_hosts",
    "slurm_allocation",
    "total_slots",
]

# Letters, digits, '_', '.', '-'; must start and end with a letter, digit or '_'. All
# patterns are used with fullmatch (``$`` would accept a trailing newline).
_HOSTNAME = re.compile(r"[A-Za-z0-9_](?:[A-Za-z0-9_.-]*[A-Za-z0-9_])?")
_IPV4 = re.compile(r"[0-9]{1,3}(?:\.[0-9]{1,3}){3}")
_COUNT = re.compile(r"[0-9]+")
_TASKS = re.compile(r"([0-9]+)(?:\(x([0-9]+)\))?")
_LOCAL_NAMES = ("localhost", "localhost.localdomain", "127.0.0.1", "::1")


class HostError(ConfigError):
    """A host list, hostfile or Slurm allocation is malformed; the message says how."""


@dataclasses.dataclass(frozen=True)
class Host:
    """One host of the job.

    Attributes:
        name: hostname or IPv4 address.
        slots: number of ranks it may run (>= 1).
    """

    name: str
    slots: int

    def __str__(self) -> str:
        return f"{self.name}:{self.slots}"


def _check_name(name: str, where: str) -> str:
    if not name:
        raise HostError(f"{where}: empty host name")
    if _IPV4.fullmatch(name):
        if any(int(octet) > 255 for octet in name.split(".")):
            raise HostError(f"{where}: {name!r} is not a valid IPv4 address")
        return name
    if not _HOSTNAME.fullmatch(name):
        raise HostError(
            f"{where}: invalid host name {name!r}; use a hostname (letters, digits, '-', '.', "
            "'_', not starting with '-') or an IPv4 address"
        )
    return name


def _check_slots(text: str, where: str) -> int:
    if not _COUNT.fullmatch(text):
        raise HostError(f"{where}: slots must be a whole number >= 1 (digits 0-9), got {text!r}")
    slots = int(text)
    if slots < 1:
        raise HostError(f"{where}: a host needs at least 1 slot, got {slots}")
    return slots


def _check_unique(hosts: Sequence[Host], where: str) -> List[Host]:
    seen = set()
    for h in hosts:
        if h.name in seen:
            raise HostError(f"{where}: host {h.name!r} is listed twice; give it once with "
                            "its total slots")
        seen.add(h.name)
    return list(hosts)


def parse_hosts(spec: Union[str, Iterable[str]]) -> List[Host]:
    """Parse a ``-H`` host list.

    Args:
        spec: ``"h1:2,h2:2"`` (comma-separated) or a list of ``"host:slots"`` strings;
            ``"host"`` alone means one slot.

    Returns:
        The hosts, in the order given.

    Raises:
        HostError: empty list, spaces between hosts, a bad name, 0 or non-numeric slots,
            or a host listed twice.
    """
    if isinstance(spec, str):
        text = spec.strip()
        if any(c.isspace() for c in text):
            fixed = ",".join(text.replace(",", " ").split())
            raise HostError(
                f"hosts {spec!r}: separate hosts with commas, not spaces (e.g. {fixed!r})"
            )
        entries = text.split(",") if text else []
    else:
        entries = []
        for item in spec:
            if not isinstance(item, str):
                raise HostError(f"hosts: each entry must be a 'host:slots' string, got {item!r}")
            entries.extend(item.strip().split(","))
    if not entries:
        raise HostError("hosts: the host list is empty")
    hosts = []
    for entry in entries:
        where = f"hosts entry {entry!r}"
        if any(c.isspace() for c in entry):
            raise HostError(f"{where}: separate hosts with commas, not spaces")
        if not entry:
            raise HostError(f"hosts {spec!r}: empty entry (two commas in a row or a trailing "
                            "comma)")
        name, sep, slots = entry.partition(":")
        if ":" in slots:
            raise HostError(f"{where}: expected 'host' or 'host:slots' (IPv6 is not supported)")
        hosts.append(Host(_check_name(name, where), _check_slots(slots, where) if sep else 1))
    return _check_unique(hosts, "hosts")


def parse_hostfile(path: str) -> List[Host]:
    """Parse an Open MPI style hostfile.

    Each line is ``HOST``, ``HOST slots=N`` or ``HOST slots=N max_slots=M``; ``#`` starts
    a comment; blank lines are skipped.

    Args:
        path: the hostfile.

    Returns:
        The hosts in file order.

    Raises:
        HostError: the file cannot be read, is not UTF-8 text, has no host, or a line is
            malformed (the message gives ``path:line``).
    """
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except OSError as exc:
        raise HostError(f"cannot read hostfile {path!r}: {exc.strerror or exc}") from None
    try:
        lines = data.decode("utf-8").splitlines()
    except UnicodeDecodeError as exc:
        lineno = data.count(b"\n", 0, exc.start) + 1
        raise HostError(
            f"{path}:{lineno}: hostfile is not UTF-8 text (byte 0x{data[exc.start]:02x}); "
            "write it as plain text, one 'HOST slots=N' per line"
        ) from None
    hosts = []
    for lineno, raw in enumerate(lines, start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"{path}:{lineno}"
        words = line.split()
        name = _check_name(words[0], f"{where}: malformed hostfile line {raw.strip()!r}")
        slots = 1
        for word in words[1:]:
            key, eq, value = word.partition("=")
            if not eq or key not in ("slots", "max_slots"):
                raise HostError(
                    f"{where}: malformed hostfile line {raw.strip()!r}: expected "
                    "'HOST slots=N' (optionally 'max_slots=M')"
                )
            count = _check_slots(value, f"{where}: {key}")
            if key == "slots":
                slots = count
        hosts.append(Host(name, slots))
    if not hosts:
        raise HostError(f"hostfile {path!r} lists no host")
    return _check_unique(hosts, f"hostfile {path!r}")


def total_slots(hosts: Sequence[Host]) -> int:
    """Return the sum of the hosts' slots."""
    return sum(h.slots for h in hosts)


def format_hosts(hosts: Sequence[Host]) -> str:
    """Return ``"h1:2,h2:2"`` (the ``-H`` syntax of Open MPI and ``-hosts`` of MPICH)."""
    return ",".join(str(h) for h in hosts)


def is_local_host(name: str, hostname: Optional[str] = None) -> bool:
    """Return True when ``name`` is this machine (loopback or its own hostname).

    Args:
        name: a host name or address.
        hostname: this machine's name; None means :func:`socket.gethostname`.
    """
    if name in _LOCAL_NAMES or name.startswith("127."):
        return True
    me = socket.gethostname() if hostname is None else hostname
    return name in (me, me.split(".")[0])


# ----------------------------------------------------------------------------- Slurm
def _split_top_level(text: str) -> List[str]:
    """Split on commas that are not inside brackets."""
    out, depth, start = [], 0, 0
    for i, c in enumerate(text):
        if c == "[":
            depth += 1
        elif c == "]":
            depth -= 1
        elif c == "," and depth == 0:
            out.append(text[start:i])
            start = i + 1
    out.append(text[start:])
    return out


def _expand_item(item: str, whole: str) -> List[str]:
    m = re.fullmatch(r"([^\[\]]*)\[([^\[\]]+)\](.*)", item, re.DOTALL)
    if m is None:
        if "[" in item or "]" in item or not item:
            raise HostError(f"malformed Slurm node list {whole!r} near {item!r}")
        return [item]
    prefix, ranges, rest = m.groups()
    tails = _expand_item(rest, whole) if rest else [""]
    out = []
    for part in ranges.split(","):
        lo, dash, hi = part.partition("-")
        if not _COUNT.fullmatch(lo) or (dash and not _COUNT.fullmatch(hi)):
            raise HostError(f"malformed Slurm node range {part!r} in {whole!r}")
        if dash:
            if int(hi) < int(lo):
                raise HostError(f"empty Slurm node range {part!r} in {whole!r}")
            numbers = [str(i).zfill(len(lo)) for i in range(int(lo), int(hi) + 1)]
        else:
            numbers = [lo]
        out.extend(prefix + n + t for n in numbers for t in tails)
    return out


def expand_nodelist(nodelist: str) -> List[str]:
    """Expand a Slurm node list: ``"node[01-03],gpu5"`` -> node01, node02, node03, gpu5.

    Supports comma lists inside brackets (``n[1,3,5-6]``), zero padding, and several
    bracket groups in one name (``r[1-2]n[1-2]``, expanded left to right).

    Raises:
        HostError: unbalanced brackets or a bad range.
    """
    text = nodelist.strip()
    if not text:
        raise HostError("empty Slurm node list")
    if text.count("[") != text.count("]"):
        raise HostError(f"malformed Slurm node list {nodelist!r}: unbalanced brackets")
    return [n for item in _split_top_level(text) for n in _expand_item(item, nodelist)]


def expand_tasks_per_node(spec: str) -> List[int]:
    """Expand ``SLURM_TASKS_PER_NODE``: ``"2(x3),1"`` -> [2, 2, 2, 1].

    Raises:
        HostError: an item is not ``N`` or ``N(xM)``.
    """
    out: List[int] = []
    for item in spec.strip().split(","):
        m = _TASKS.fullmatch(item.strip())
        if m is None:
            raise HostError(f"malformed Slurm tasks-per-node {spec!r} near {item!r}")
        out.extend([int(m.group(1))] * int(m.group(2) or 1))
    return out


def slurm_allocation(env: Optional[Mapping[str, str]] = None) -> Optional[Tuple[List[Host], int]]:
    """Return the hosts and task count of the Slurm allocation we run in, if any.

    Steps: 1. no ``SLURM_JOB_NODELIST`` (or ``SLURM_NODELIST``) -> None; 2. expand the
    node list; 3. slots per node from ``SLURM_TASKS_PER_NODE`` (else
    ``SLURM_JOB_CPUS_PER_NODE``, else 1 each); 4. the task count is ``SLURM_NTASKS``, else
    the sum of the slots.

    Args:
        env: the environment; None means :data:`os.environ`.

    Returns:
        ``(hosts, ntasks)`` or None outside an allocation.

    Raises:
        HostError: the variables are malformed or disagree on the number of nodes.
    """
    env = os.environ if env is None else env
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not nodelist:
        return None
    names = expand_nodelist(nodelist)
    tasks_var = next(
        (v for v in ("SLURM_TASKS_PER_NODE", "SLURM_JOB_CPUS_PER_NODE") if env.get(v)), None
    )
    slots = expand_tasks_per_node(env[tasks_var]) if tasks_var else [1] * len(names)
    if len(slots) != len(names):
        raise HostError(
            f"Slurm allocation: {tasks_var}={env[tasks_var]!r} gives {len(slots)} nodes but "
            f"SLURM_JOB_NODELIST={nodelist!r} names {len(names)}"
        )
    hosts = [Host(_check_name(n, "Slurm node list"), s) for n, s in zip(names, slots) if s > 0]
    ntasks_text = env.get("SLURM_NTASKS") or env.get("SLURM_NPROCS")
    if ntasks_text:
        if not _COUNT.fullmatch(ntasks_text) or int(ntasks_text) < 1:
            raise HostError(f"Slurm allocation: SLURM_NTASKS={ntasks_text!r} is not a count")
        ntasks = int(ntasks_text)
    else:
        ntasks = total_slots(hosts)
    return hosts, ntasks
