r"""An emulated cluster on one Linux machine: hosts in network namespaces with shaped links.

Compression pays off when links are slow relative to compute. Without a real cluster, this
module builds one on the local machine (root required)::

                root namespace: mpirun, bridge <prefix><tag>br = 10.213.7.254/24
                     |                 |                 |
        veth (tbf) <prefix><tag>v1  ...v2            ...vN        <- "switch port" egress
                     |                 |                 |
        netns <prefix><tag>h1     ...h2             ...hN
          eth0 10.213.7.1 (tbf)   eth0 10.213.7.2   eth0 10.213.7.N  <- host NIC egress

Each emulated host is a network namespace with one interface ``eth0`` plugged into a
bridge in the root namespace. Its egress is shaped with ``tbf`` at ``rate``; with
``shape_ingress`` (the default) the bridge-side end is shaped too, so each host has a
full-duplex link of ``rate`` in each direction, like a switch port: traffic converging
on one host (a parameter server's incast) queues at that host's port.

Launching onto it: :meth:`EmulatedCluster.env` holds Open MPI/PRRTE parameters as
environment variables (``PRTE_MCA_plm_ssh_agent`` names a generated script that plays
``ssh``: it runs the daemon inside the host's namespace under ``unshare --uts`` with a
hostname of its own, so Open MPI sees distinct nodes; ``*_tcp_if_include`` pin the
runtime's and the MPI traffic to the cluster's subnet). Any ``mpirun`` or ``hipressrun``
started with that environment and ``-H`` :attr:`EmulatedCluster.hosts_arg` launches onto
the emulated hosts as if they were remote machines; :meth:`EmulatedCluster.mpirun_args`
gives the same settings as command-line options. Hosts are raw IPv4 addresses: nothing
is written to ``/etc/hosts``.

What can and cannot be emulated (be careful with conclusions):

- Bandwidth: yes, with ``tbf`` (or ``htb``) per link. On a 2-core machine shaped rates
  from about 0.1 to 5 Gbit/s are meaningful; above that the kernel's packet processing on
  the shared cores is the limit, not the shaper.
- Propagation delay: only with ``netem``, which this machine's kernel lacks.
  ``latency_ms > 0`` therefore asks for ``netem`` and raises :class:`EmulationError` where
  it is missing. ``tbf``'s own ``latency`` parameter (here ``queue_ms``) is *not* a delay:
  it is the longest a packet may wait in the shaper's queue before being dropped, i.e.
  the queue size (rate × queue_ms bytes). It adds queueing delay only under load.
- Compute: every emulated host shares the same CPU cores (and memory bandwidth). Work
  that would run in parallel on N machines competes here, so CPU-bound phases (encode,
  decode, Python overhead) are up to N/cores times slower than on a real cluster.
- Loss, jitter, reordering, switch buffers shared across ports: not emulated.

Cleanup guarantees: every resource is named ``<prefix><pid36>-<k>...`` (``prefix``
``hpns`` by default, ``pid36`` the owning process id in base 36). Teardown runs on normal
exit, on exceptions, on KeyboardInterrupt, on SIGTERM/SIGHUP (turned into SystemExit in
the main thread while the cluster is up), and at interpreter exit; it first kills the
processes still inside the namespaces (daemons and ranks a failed job left behind), then
deletes links, namespaces, the bridge and the agent script. A process killed with
SIGKILL cannot clean up: :func:`cleanup` (run automatically before every new cluster)
removes the resources whose owner process no longer exists.

Usage::

    from hipress.testing.emucluster import EmulatedCluster

    with EmulatedCluster(4, rate="1gbit") as cluster:
        subprocess.run(["hipressrun", "-np", "4", "-H", cluster.hosts_arg(),
                        sys.executable, "train.py"], env=cluster.env(os.environ), check=True)

    # or from a shell:
    python -m hipress.testing.emucluster --hosts 4 --rate 1gbit -- \
        sh -c 'hipressrun -np 4 -H $HIPRESS_EMU_HOSTS python train.py'
    python -m hipress.testing.emucluster --cleanup      # remove leftovers of crashed runs
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import fcntl
import ipaddress
import itertools
import logging
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

from hipress.errors import HiPressError

__all__ = [
    "EmulatedCluster",
    "EmulationError",
    "cleanup",
    "leftovers",
    "main",
    "namespaces_unavailable",
    "parse_rate",
]

logger = logging.getLogger(__name__)

#: Interface names are limited to 15 characters by the kernel (IFNAMSIZ - 1).
_IFNAMSIZ = 15
#: Name of every host's interface inside its namespace (the same on every host, so that
#: e.g. ``GLOO_SOCKET_IFNAME=eth0`` works everywhere).
HOST_IFNAME = "eth0"
#: First subnet tried when none is given: 10.213.<k>.0/24 for k = 7, 8, ...
_AUTO_SUBNETS = [f"10.213.{k}.0/24" for k in range(7, 255)]
_COUNTER = itertools.count()
_RATE_UNITS = {"bit": 1.0, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12,
               "kibit": 2.0**10, "mibit": 2.0**20, "gibit": 2.0**30}
_SSH_OPTS_WITH_ARG = "bcDEeFIiJLlmOoPpQRSWw"


class EmulationError(HiPressError, RuntimeError):
    """The emulated cluster cannot be built here, or a command that builds it failed."""


# ----------------------------------------------------------------------------- helpers
def parse_rate(rate: Any) -> float:
    """Return a link rate in bits per second.

    Args:
        rate: a number of bits/s, or ``tc``'s bit units: ``"100mbit"``, ``"1gbit"``,
            ``"2.5gbit"``, ``"10gbit"`` (SI: 1gbit = 1e9 bit/s; ``gibit`` = 2^30).
            Byte units (``mbps`` means megabytes/s in ``tc``) are refused to avoid that
            classic 8x mistake.

    Raises:
        EmulationError: unknown unit or a rate that is not positive.
    """
    if isinstance(rate, (int, float)):
        value = float(rate)
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(rate))
        unit = m.group(2).lower() if m else ""
        if m is None or unit not in _RATE_UNITS:
            raise EmulationError(
                f"link rate {rate!r} not understood; give bits per second as a number or with "
                f"a tc bit unit ({', '.join(_RATE_UNITS)}), e.g. '1gbit' or '100mbit'")
        value = float(m.group(1)) * _RATE_UNITS[unit]
    if not value > 0:
        raise EmulationError(f"link rate must be positive, got {rate!r}")
    return value


def _tc_rate(bits_per_s: float) -> str:
    """Return ``bits_per_s`` in a form ``tc`` accepts exactly (``<int>bit``)."""
    return f"{int(round(bits_per_s))}bit"


def _b36(n: int) -> str:
    digits = "0123456789abcdefghijklmnopqrstuvwxyz"
    out = ""
    while True:
        n, r = divmod(n, 36)
        out = digits[r] + out
        if n == 0:
            return out


def _run(argv: Sequence[str], check: bool = True, timeout: float = 30.0,
         input_text: Optional[str] = None) -> subprocess.CompletedProcess:
    """Run one ``ip``/``tc`` command; raise :class:`EmulationError` with its stderr."""
    try:
        res = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout,
                             input=input_text, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise EmulationError(f"cannot run {shlex.join(argv)}: {exc}") from None
    if check and res.returncode != 0:
        raise EmulationError(f"{shlex.join(argv)} failed (exit {res.returncode}): "
                             f"{res.stderr.strip() or res.stdout.strip()}")
    return res


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _tool_missing() -> Optional[str]:
    for tool in ("ip", "tc", "unshare"):
        if shutil.which(tool) is None:
            pkg = "util-linux" if tool == "unshare" else "iproute2"
            return f"'{tool}' is not installed (apt-get install -y {pkg})"
    return None


_PROBE_RESULT: Optional[Tuple[Optional[str]]] = None


def namespaces_unavailable(prefix: str = "hpns") -> Optional[str]:
    """Return why an emulated cluster cannot be built here, or None when it can.

    Checks, once per process: root (effective uid 0); ``ip``, ``tc`` and ``unshare``
    installed; creating a network namespace, a bridge, a veth pair and a ``tbf`` qdisc
    (a probe named ``<prefix><pid36>-probe...``, removed at once); ``unshare --uts``
    inside the namespace. Tests use the answer as their skip reason.

    Args:
        prefix: name prefix of the probe's resources.
    """
    global _PROBE_RESULT
    if _PROBE_RESULT is not None:
        return _PROBE_RESULT[0]
    reason: Optional[str] = None
    if not sys.platform.startswith("linux"):
        reason = "network namespaces need Linux"
    elif os.geteuid() != 0:
        reason = "needs root (network namespaces, veth, bridge and tc are privileged)"
    else:
        reason = _tool_missing()
    if reason is None:
        tag = f"{prefix}{_b36(os.getpid())}-p"
        ns, br, veth = f"{tag}h0", f"{tag}br", f"{tag}v0"
        steps = [
            ["ip", "netns", "add", ns],
            ["ip", "link", "add", br, "type", "bridge"],
            ["ip", "link", "add", veth, "type", "veth", "peer", "name", f"{tag}p0"],
            ["ip", "link", "set", f"{tag}p0", "netns", ns],
            ["tc", "qdisc", "add", "dev", veth, "root", "tbf", "rate", "1gbit",
             "burst", "64kb", "latency", "10ms"],
            ["ip", "netns", "exec", ns, "unshare", "--uts", "true"],
        ]
        try:
            for argv in steps:
                res = _run(argv, check=False)
                if res.returncode != 0:
                    reason = (f"cannot build an emulated host here: {shlex.join(argv)} failed: "
                              f"{(res.stderr or res.stdout).strip()}")
                    break
        finally:
            _run(["ip", "link", "del", veth], check=False)
            _run(["ip", "link", "del", br], check=False)
            _run(["ip", "netns", "del", ns], check=False)
    _PROBE_RESULT = (reason,)
    return reason


def _list_namespaces() -> List[str]:
    res = _run(["ip", "netns", "list"], check=False)
    return [line.split()[0] for line in res.stdout.splitlines() if line.strip()]


def _list_links() -> List[str]:
    res = _run(["ip", "-o", "link", "show"], check=False)
    names = []
    for line in res.stdout.splitlines():
        parts = line.split(":", 2)
        if len(parts) >= 2:
            names.append(parts[1].strip().split("@", 1)[0])
    return names


def _owner_pid(name: str, prefix: str) -> Optional[int]:
    m = re.match(re.escape(prefix) + r"([0-9a-z]+)-", name)
    return int(m.group(1), 36) if m else None


def _kill_namespace_processes(ns: str, grace_s: float = 2.0) -> int:
    """SIGTERM then SIGKILL every process whose network namespace is ``ns``."""
    def pids() -> List[int]:
        res = _run(["ip", "netns", "pids", ns], check=False)
        return [int(p) for p in res.stdout.split() if p.isdigit() and int(p) != os.getpid()]

    victims = pids()
    if not victims:
        return 0
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and pids():
            time.sleep(0.05)
        if not pids():
            break
    return len(victims)


def leftovers(prefix: str = "hpns") -> Dict[str, List[str]]:
    """Return the namespaces, links and agent directories named with ``prefix``.

    Returns:
        ``{"namespaces": [...], "links": [...], "dirs": [...]}`` (empty lists when clean).
    """
    tmp = tempfile.gettempdir()
    return {
        "namespaces": [n for n in _list_namespaces() if n.startswith(prefix)],
        "links": [n for n in _list_links() if n.startswith(prefix)],
        "dirs": sorted(os.path.join(tmp, d) for d in os.listdir(tmp)
                       if d.startswith(prefix) and re.match(re.escape(prefix) + r"[0-9a-z]+-",
                                                             d)),
    }


def cleanup(prefix: str = "hpns", include_live: bool = False) -> List[str]:
    """Remove the resources of emulated clusters whose owner process has exited.

    A cluster whose owner was killed with SIGKILL (or crashed hard) leaves namespaces,
    links and its agent directory behind; this removes them by name: everything named
    ``<prefix><pid36>-...`` whose ``pid`` no longer exists (and, with ``include_live``,
    also those of live owners: only for a manual cleanup when no cluster is in use).
    Processes still inside such namespaces are killed first.

    Args:
        prefix: the name prefix used when the clusters were made.
        include_live: also remove clusters whose owner is still running.

    Returns:
        The names removed.
    """
    def stale(name: str) -> bool:
        pid = _owner_pid(name, prefix)
        return pid is not None and (include_live or not _pid_alive(pid))

    if _tool_missing() is not None:
        return []
    found = leftovers(prefix)
    removed: List[str] = []
    for ns in found["namespaces"]:
        if stale(ns):
            _kill_namespace_processes(ns)
            _run(["ip", "netns", "del", ns], check=False)
            removed.append(ns)
    for link in found["links"]:
        if stale(link) and _run(["ip", "link", "del", link], check=False).returncode == 0:
            removed.append(link)
    for d in found["dirs"]:
        if stale(os.path.basename(d)):
            shutil.rmtree(d, ignore_errors=True)
            removed.append(d)
    if removed:
        logger.info("removed leftovers of earlier emulated clusters: %s", " ".join(removed))
    return removed


@contextlib.contextmanager
def _global_lock(prefix: str) -> Iterator[None]:
    """Serialize cluster creation between processes (subnet choice, stale cleanup)."""
    path = os.path.join(tempfile.gettempdir(), f".{prefix}.lock")
    with open(path, "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _networks_in_use() -> List[ipaddress.IPv4Network]:
    nets = []
    res = _run(["ip", "-4", "-o", "addr", "show"], check=False)
    for m in re.finditer(r"\binet\s+(\S+)", res.stdout):
        nets.append(ipaddress.ip_interface(m.group(1)).network)
    res = _run(["ip", "-4", "route", "show", "table", "all"], check=False)
    for line in res.stdout.splitlines():
        word = line.split()[0] if line.split() else ""
        if word in ("default", "broadcast", "local", "unreachable", "blackhole", "prohibit"):
            continue
        with contextlib.suppress(ValueError):
            nets.append(ipaddress.ip_network(word, strict=False))
    return nets


# ----------------------------------------------------------------------------- the cluster
_AGENT = """#!/bin/sh
# plm_ssh_agent of emulated cluster {tag}: plays "ssh HOST COMMAND" by running COMMAND
# inside HOST's network namespace with a hostname of its own (generated; removed on teardown).
while [ $# -gt 0 ]; do
  case "$1" in
    -[{opts}]) shift 2 ;;
    -*) shift ;;
    *) break ;;
  esac
done
host="$1"; shift
case "$host" in
{cases}
  *) echo "emulated cluster {tag}: unknown host '$host'" >&2; exit 255 ;;
esac
exec ip netns exec "$ns" unshare --uts /bin/sh -c 'hostname "$0" && exec /bin/sh -c "$1"' \\
  "$hn" "$*"
"""


class EmulatedCluster:
    """N emulated hosts with shaped links, usable as ``mpirun``/``hipressrun`` hosts.

    A context manager: entering builds the cluster, leaving (also on error or interrupt)
    tears it down. See the module docstring for the topology and what is emulated.

    Steps of :meth:`start`:
      1. Check root and tools; under a file lock, remove stale clusters of dead owners
         (:func:`cleanup`) and pick a /24 that no address or route on this machine uses.
      2. Create a bridge ``<name>br`` with the subnet's last address (mpirun's daemons
         call back to it) in the root namespace.
      3. For host i = 1..N: a namespace ``<name>h<i>``, a veth pair whose root end
         ``<name>v<i>`` joins the bridge and whose other end becomes ``eth0`` with
         address ``<subnet>.i``, and ``lo`` up.
      4. Shape: ``tbf rate R burst B latency queue_ms`` on each host's ``eth0`` (egress),
         and on ``<name>v<i>`` (the host's ingress) with ``shape_ingress``; with
         ``latency_ms > 0`` a ``netem delay`` parent (needs netem).
      5. Write the ``plm_ssh_agent`` script mapping each address to its namespace and
         hostname ``<name>h<i>``.

    Args:
        n_hosts: number of hosts, 1..99.
        rate: link rate per direction (``"1gbit"``, ``"100mbit"``, bits/s as a number), or
            None for unshaped links.
        latency_ms: one-way propagation delay added per host egress, in ms. Only 0 (none)
            works without ``netem``; see the module docstring.
        subnet: an IPv4 /24 (or larger) private network, e.g. ``"10.213.7.0/24"``; None
            picks a free one from 10.213.7.0/24 upwards. It must not overlap any address
            or route of this machine.
        prefix: name prefix of every resource (namespaces, links, temp dir); ``cleanup``
            finds leftovers by it. Up to 4 characters (interface names are limited to 15).
        queue_ms: ``tbf``'s ``latency``: the most queueing delay a packet may see in a
            shaper before it is dropped (sets the queue size to rate × queue_ms). Not a
            propagation delay.
        burst_bytes: ``tbf`` bucket size; None = max(64 KiB, 1 ms at ``rate``).
        shape_ingress: also shape traffic towards each host (its switch port).
        qdisc: ``"tbf"`` or ``"htb"`` (one class at ``rate``; same effect, for kernels
            where tbf misbehaves).

    Attributes:
        hosts: the hosts' IPv4 addresses, in rank order of ``-H`` (empty until started).
        namespaces: the namespace of each host.
        hostnames: the hostname each host's processes see.
        bridge_ip: the root namespace's address on the cluster network.
        rate_bps: link rate in bits/s (None when unshaped).

    Raises:
        EmulationError: bad arguments, not root, missing tools, no free subnet, or a
            command that builds the cluster failed (already-built parts are removed).
    """

    def __init__(
        self,
        n_hosts: int,
        rate: Any = "1gbit",
        latency_ms: float = 0.0,
        subnet: Optional[str] = None,
        prefix: str = "hpns",
        queue_ms: float = 50.0,
        burst_bytes: Optional[int] = None,
        shape_ingress: bool = True,
        qdisc: str = "tbf",
    ) -> None:
        if not isinstance(n_hosts, int) or not 1 <= n_hosts <= 99:
            raise EmulationError(f"n_hosts must be an int in 1..99, got {n_hosts!r}")
        if not re.fullmatch(r"[a-z][a-z0-9]{0,3}", prefix):
            raise EmulationError(f"prefix {prefix!r} must be 1-4 lowercase letters/digits "
                                 "starting with a letter (interface names are limited to 15 "
                                 "characters)")
        if latency_ms < 0 or queue_ms <= 0:
            raise EmulationError(f"latency_ms must be >= 0 and queue_ms > 0, got "
                                 f"{latency_ms} and {queue_ms}")
        if qdisc not in ("tbf", "htb"):
            raise EmulationError(f"qdisc must be 'tbf' or 'htb', got {qdisc!r}")
        self.n_hosts = n_hosts
        self.rate_bps = None if rate is None else parse_rate(rate)
        self.latency_ms = float(latency_ms)
        self.queue_ms = float(queue_ms)
        self.shape_ingress = bool(shape_ingress)
        self.qdisc = qdisc
        self.prefix = prefix
        if burst_bytes is None and self.rate_bps is not None:
            burst_bytes = max(64 * 1024, int(self.rate_bps / 8 * 1e-3))
        self.burst_bytes = burst_bytes
        self._subnet_arg = subnet
        if subnet is not None:
            self._check_subnet(subnet)
        self.tag = f"{prefix}{_b36(os.getpid())}-{_b36(next(_COUNTER) % 36)}"
        self.bridge = f"{self.tag}br"
        self.namespaces = [f"{self.tag}h{i}" for i in range(1, n_hosts + 1)]
        self.hostnames = list(self.namespaces)
        self.host_veths = [f"{self.tag}v{i}" for i in range(1, n_hosts + 1)]
        self.subnet: Optional[ipaddress.IPv4Network] = None
        self.hosts: List[str] = []
        self.bridge_ip: Optional[str] = None
        self.workdir: Optional[str] = None
        self.agent: Optional[str] = None
        self._up = False
        self._stopping = False
        self._old_handlers: Dict[int, Any] = {}
        self._lock = threading.RLock()

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> EmulatedCluster:
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def __repr__(self) -> str:
        rate = "unshaped" if self.rate_bps is None else f"{self.rate_bps / 1e9:g} Gbit/s"
        return (f"EmulatedCluster({self.n_hosts} hosts, {rate}, subnet={self.subnet}, "
                f"tag={self.tag!r}, up={self._up})")

    @staticmethod
    def _check_subnet(subnet: str) -> ipaddress.IPv4Network:
        try:
            net = ipaddress.IPv4Network(subnet, strict=True)
        except ValueError as exc:
            raise EmulationError(f"subnet {subnet!r} is not an IPv4 network like "
                                 f"'10.213.7.0/24': {exc}") from None
        if not net.is_private or net.prefixlen > 24:
            raise EmulationError(f"subnet {subnet} must be a private network of /24 or larger "
                                 "(e.g. 10.213.7.0/24): the cluster must only use addresses "
                                 "it owns")
        return net

    def _pick_subnet(self) -> ipaddress.IPv4Network:
        used = _networks_in_use()
        candidates = [self._subnet_arg] if self._subnet_arg else _AUTO_SUBNETS
        for text in candidates:
            net = self._check_subnet(text)
            if not any(net.overlaps(u) for u in used if u.prefixlen > 0):
                return net
        if self._subnet_arg:
            raise EmulationError(f"subnet {self._subnet_arg} overlaps an address or route of "
                                 "this machine (another emulated cluster, or a real network); "
                                 "pick another or pass subnet=None to choose a free one")
        raise EmulationError("no free 10.213.x.0/24 subnet left for an emulated cluster")

    def start(self) -> EmulatedCluster:
        """Build the cluster (see the class docstring); return self.

        Raises:
            EmulationError: the cluster cannot be built; nothing is left behind.
        """
        with self._lock:
            if self._up:
                return self
            reason = namespaces_unavailable(self.prefix)
            if reason is not None:
                raise EmulationError(f"cannot build an emulated cluster: {reason}")
            if self.latency_ms > 0 and self._netem_missing():
                raise EmulationError(
                    f"latency_ms={self.latency_ms} needs the netem qdisc, which this kernel "
                    "does not have (sch_netem); propagation delay cannot be emulated here. "
                    "Use latency_ms=0 (tbf's queue bound is queue_ms, not a delay)")
            self._install_handlers()
            self._up = True  # from here on, stop() must run
            atexit.register(self.stop)
            try:
                with _global_lock(self.prefix):
                    cleanup(self.prefix)
                    self.subnet = self._pick_subnet()
                    addrs = list(self.subnet.hosts())
                    if len(addrs) < self.n_hosts + 1:
                        raise EmulationError(f"subnet {self.subnet} is too small for "
                                             f"{self.n_hosts} hosts and the bridge")
                    self.hosts = [str(a) for a in addrs[:self.n_hosts]]
                    self.bridge_ip = str(addrs[-1])
                    self._build()
            except BaseException:
                self.stop()
                raise
            logger.info("emulated cluster up: %s hosts %s", self, ",".join(self.hosts))
            return self

    def _netem_missing(self) -> bool:
        ns = f"{self.tag}n"
        try:
            _run(["ip", "netns", "add", ns])
            res = _run(["tc", "-n", ns, "qdisc", "add", "dev", "lo", "root", "netem",
                        "delay", "1ms"], check=False)
            return res.returncode != 0
        finally:
            _run(["ip", "netns", "del", ns], check=False)

    def _shape(self, where: List[str], dev: str) -> None:
        """Attach the shaper to ``dev`` (``where`` = [] or ["-n", ns])."""
        tc = ["tc", *where, "qdisc", "add", "dev", dev]
        parent = ["root"]
        if self.latency_ms > 0:
            _run([*tc, "root", "handle", "1:", "netem", "delay", f"{self.latency_ms}ms",
                  "limit", "100000"])
            parent = ["parent", "1:1"]
        if self.rate_bps is None:
            return
        rate = _tc_rate(self.rate_bps)
        if self.qdisc == "tbf":
            _run([*tc, *parent, "handle", "10:", "tbf", "rate", rate,
                  "burst", str(self.burst_bytes), "latency", f"{self.queue_ms}ms"])
        else:
            _run([*tc, *parent, "handle", "10:", "htb", "default", "1", "r2q", "1000"])
            _run(["tc", *where, "class", "add", "dev", dev, "parent", "10:", "classid", "10:1",
                  "htb", "rate", rate, "burst", str(self.burst_bytes),
                  "cburst", str(self.burst_bytes)])

    def _build(self) -> None:
        assert self.subnet is not None
        plen = self.subnet.prefixlen
        _run(["ip", "link", "add", self.bridge, "type", "bridge"])
        _run(["ip", "addr", "add", f"{self.bridge_ip}/{plen}", "dev", self.bridge])
        _run(["ip", "link", "set", self.bridge, "up"])
        for i, (ns, veth, ip) in enumerate(zip(self.namespaces, self.host_veths, self.hosts)):
            peer = f"{self.tag}p{i + 1}"  # renamed to eth0 inside the namespace
            _run(["ip", "netns", "add", ns])
            _run(["ip", "link", "add", veth, "type", "veth", "peer", "name", peer])
            _run(["ip", "link", "set", peer, "netns", ns])
            _run(["ip", "-n", ns, "link", "set", peer, "name", HOST_IFNAME])
            _run(["ip", "-n", ns, "addr", "add", f"{ip}/{plen}", "dev", HOST_IFNAME])
            _run(["ip", "-n", ns, "link", "set", HOST_IFNAME, "up"])
            _run(["ip", "-n", ns, "link", "set", "lo", "up"])
            _run(["ip", "link", "set", veth, "master", self.bridge])
            _run(["ip", "link", "set", veth, "up"])
            self._shape(["-n", ns], HOST_IFNAME)
            if self.shape_ingress:
                self._shape([], veth)
        self.workdir = tempfile.mkdtemp(prefix=f"{self.tag}-")
        self.agent = os.path.join(self.workdir, "agent.sh")
        cases = "\n".join(f"  {ip}|{hn}) ns={ns}; hn={hn} ;;"
                          for ip, ns, hn in zip(self.hosts, self.namespaces, self.hostnames))
        with open(self.agent, "w") as fh:
            fh.write(_AGENT.format(tag=self.tag, opts=_SSH_OPTS_WITH_ARG, cases=cases))
        os.chmod(self.agent, 0o755)

    def stop(self) -> None:
        """Tear the cluster down: idempotent, safe after a partial start.

        Steps: 1. kill processes left inside the namespaces; 2. delete the bridge-side
        veths (their peers go with them), the namespaces and the bridge; 3. remove the
        agent directory; 4. restore signal handlers. Failures are logged, not raised.
        SIGINT/SIGTERM/SIGHUP arriving meanwhile (main thread) are held until the end.

        Raises:
            KeyboardInterrupt: SIGINT arrived during teardown (raised once it is done).
            SystemExit: SIGTERM/SIGHUP arrived during teardown (status 128 + signal).
        """
        with self._lock:
            if not self._up or self._stopping:
                return
            self._stopping = True
            deferred: List[int] = []
            saved = self._defer_signals(deferred)
            try:
                for ns in self.namespaces:
                    try:
                        n = _kill_namespace_processes(ns)
                        if n:
                            logger.warning("killed %d process(es) left in %s", n, ns)
                    except Exception as exc:  # teardown must go on
                        logger.warning("could not clear %s: %s", ns, exc)
                existing_links = set(_list_links())
                for veth in self.host_veths:
                    if veth in existing_links:
                        _run(["ip", "link", "del", veth], check=False)
                existing_ns = set(_list_namespaces())
                for ns in self.namespaces:
                    if ns in existing_ns:
                        res = _run(["ip", "netns", "del", ns], check=False)
                        if res.returncode != 0:
                            logger.warning("could not delete namespace %s: %s", ns,
                                           res.stderr.strip())
                if self.bridge in existing_links:
                    _run(["ip", "link", "del", self.bridge], check=False)
                if self.workdir:
                    shutil.rmtree(self.workdir, ignore_errors=True)
                left = [n for kind in leftovers(self.prefix).values() for n in kind
                        if os.path.basename(n).startswith(self.tag)]
                if left:
                    logger.warning("emulated cluster %s left behind: %s", self.tag,
                                   " ".join(left))
            finally:
                for sig, prev in saved.items():
                    signal.signal(sig, prev)
                self._restore_handlers()
                with contextlib.suppress(Exception):
                    atexit.unregister(self.stop)
                self._up = False
                self._stopping = False
            if deferred:  # a signal arrived during teardown: act on it now
                if deferred[0] == signal.SIGINT:
                    raise KeyboardInterrupt
                raise SystemExit(128 + deferred[0])

    # ------------------------------------------------------------------ signals
    def _install_handlers(self) -> None:
        """Turn SIGTERM/SIGHUP into SystemExit so ``with``/``finally`` tear down."""
        if threading.current_thread() is not threading.main_thread():
            return

        def handler(signum: int, frame: Any) -> None:
            raise SystemExit(128 + signum)

        for sig in (signal.SIGTERM, signal.SIGHUP):
            prev = signal.getsignal(sig)
            if prev in (signal.SIG_DFL, None):
                self._old_handlers[sig] = prev
                signal.signal(sig, handler)

    @staticmethod
    def _defer_signals(deferred: List[int]) -> Dict[int, Any]:
        """Hold SIGINT/SIGTERM/SIGHUP during teardown (main thread only); return old handlers.

        A Ctrl-C in the middle of deleting namespaces would otherwise leave half of them;
        the signals are recorded in ``deferred`` and acted on when teardown is done.
        """
        if threading.current_thread() is not threading.main_thread():
            return {}

        def hold(signum: int, frame: Any) -> None:
            deferred.append(signum)

        saved = {}
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            prev = signal.getsignal(sig)
            if prev not in (signal.SIG_IGN, None):
                saved[sig] = prev
                signal.signal(sig, hold)
        return saved

    def _restore_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig, prev in self._old_handlers.items():
            with contextlib.suppress(Exception):
                signal.signal(sig, prev if prev is not None else signal.SIG_DFL)
        self._old_handlers.clear()

    # ------------------------------------------------------------------ launching
    def _need_up(self) -> None:
        if not self._up or self.subnet is None:
            raise EmulationError(f"{self!r} is not started; use it as a context manager")

    def hosts_arg(self, slots: int = 1) -> str:
        """Return the ``-H`` list: ``"10.213.7.1:1,10.213.7.2:1,..."``."""
        self._need_up()
        return ",".join(f"{h}:{slots}" for h in self.hosts)

    def mca_params(self) -> Dict[str, Tuple[str, str]]:
        """Return the Open MPI/PRRTE parameters: name -> (``--prtemca``|``--mca``, value).

        - ``plm_ssh_agent``: the generated agent (starts daemons in the namespaces);
        - ``plm_ssh_no_tree_spawn 1``: mpirun starts every daemon itself (no daemon
          runs the agent from inside a namespace);
        - ``oob_tcp_if_include`` / ``btl_tcp_if_include``: the cluster subnet, so the
          runtime's control channel and MPI traffic take the shaped links.
        """
        self._need_up()
        subnet = str(self.subnet)
        return {
            "plm_ssh_agent": ("--prtemca", str(self.agent)),
            "plm_ssh_no_tree_spawn": ("--prtemca", "1"),
            "oob_tcp_if_include": ("--prtemca", subnet),
            "btl_tcp_if_include": ("--mca", subnet),
        }

    def mpirun_args(self) -> List[str]:
        """Return the extra Open MPI 5 ``mpirun`` options that launch onto this cluster."""
        out: List[str] = []
        for name, (flag, value) in self.mca_params().items():
            out += [flag, name, value]
        return out

    def env(self, base: Optional[Mapping[str, str]] = None) -> Dict[str, str]:
        """Return an environment under which ``mpirun``/``hipressrun`` launch onto the cluster.

        The same parameters as :meth:`mpirun_args`, as ``PRTE_MCA_*``/``OMPI_MCA_*``
        variables (so launchers with no pass-through for MCA options work unchanged),
        plus ``OMPI_ALLOW_RUN_AS_ROOT*``, ``GLOO_SOCKET_IFNAME=eth0`` (torch.distributed
        inside the hosts), ``HIPRESS_EMU_HOSTS`` (the ``-H`` list),
        ``HIPRESS_EMU_MPIRUN_ARGS`` (:meth:`mpirun_args`, shell-quoted) and
        ``HIPRESS_EMU_RATE_BPS``.

        Args:
            base: environment to extend (None: only the cluster's variables).
        """
        out = dict(base or {})
        for name, (flag, value) in self.mca_params().items():
            out[("PRTE_MCA_" if flag == "--prtemca" else "OMPI_MCA_") + name] = value
        out.update({
            "OMPI_ALLOW_RUN_AS_ROOT": "1",
            "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
            "GLOO_SOCKET_IFNAME": HOST_IFNAME,
            "HIPRESS_EMU_HOSTS": self.hosts_arg(),
            "HIPRESS_EMU_MPIRUN_ARGS": shlex.join(self.mpirun_args()),
            "HIPRESS_EMU_RATE_BPS": "" if self.rate_bps is None else str(int(self.rate_bps)),
        })
        return out

    def host_argv(self, index: int, argv: Sequence[str]) -> List[str]:
        """Return argv that runs ``argv`` on host ``index`` (0-based) with its hostname."""
        self._need_up()
        return ["ip", "netns", "exec", self.namespaces[index], "unshare", "--uts",
                "/bin/sh", "-c", 'hostname "$0" && exec "$@"', self.hostnames[index],
                *argv]

    def popen(self, index: int, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen:
        """Start ``argv`` on host ``index`` (0-based); kwargs go to :class:`subprocess.Popen`.

        Processes still running at teardown are killed with the namespace.
        """
        return subprocess.Popen(self.host_argv(index, argv), **kwargs)

    def run(self, index: int, argv: Sequence[str], **kwargs: Any) -> subprocess.CompletedProcess:
        """Run ``argv`` on host ``index`` (0-based) to completion (:func:`subprocess.run`)."""
        return subprocess.run(self.host_argv(index, argv), **kwargs)


# ----------------------------------------------------------------------------- CLI
def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run a command with an emulated cluster up; return its exit status.

    ``python -m hipress.testing.emucluster --hosts 4 --rate 1gbit -- COMMAND...`` builds
    the cluster, runs COMMAND in the root namespace with :meth:`EmulatedCluster.env`
    added to the environment (``$HIPRESS_EMU_HOSTS`` is the ``-H`` list), and tears the
    cluster down when COMMAND ends, fails, or this process is interrupted.
    ``--cleanup`` removes leftovers of crashed runs instead.
    """
    p = argparse.ArgumentParser(
        prog="python -m hipress.testing.emucluster",
        description="Run COMMAND with an emulated cluster of shaped network namespaces up "
        "(root). COMMAND sees HIPRESS_EMU_HOSTS (the -H list), HIPRESS_EMU_MPIRUN_ARGS and "
        "PRTE_MCA_*/OMPI_MCA_* variables that make mpirun/hipressrun launch onto the hosts.",
        epilog="example: python -m hipress.testing.emucluster --hosts 4 --rate 1gbit -- "
        "sh -c 'hipressrun -np 4 -H $HIPRESS_EMU_HOSTS python train.py'")
    p.add_argument("--hosts", type=int, default=4, help="number of hosts (default 4)")
    p.add_argument("--rate", default="1gbit", help="link rate per direction, e.g. 1gbit, "
                   "100mbit; 'none' for unshaped (default 1gbit)")
    p.add_argument("--latency-ms", type=float, default=0.0,
                   help="propagation delay (needs netem; default 0)")
    p.add_argument("--queue-ms", type=float, default=50.0,
                   help="tbf queue bound in ms (not a delay; default 50)")
    p.add_argument("--subnet", default=None, help="private /24, default: first free "
                   "10.213.x.0/24 from 10.213.7.0/24")
    p.add_argument("--no-ingress", action="store_true", help="shape host egress only")
    p.add_argument("--qdisc", choices=("tbf", "htb"), default="tbf")
    p.add_argument("--prefix", default="hpns", help="resource name prefix (default hpns)")
    p.add_argument("--cleanup", action="store_true",
                   help="remove leftovers of clusters whose owner process is gone, and exit")
    p.add_argument("--cleanup-all", action="store_true",
                   help="remove every cluster with this prefix, also live ones, and exit")
    p.add_argument("command", nargs=argparse.REMAINDER, help="command to run (after --)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="emucluster: %(message)s")
    if args.cleanup or args.cleanup_all:
        removed = cleanup(args.prefix, include_live=args.cleanup_all)
        sys.stderr.write(f"emucluster: removed {len(removed)} leftover(s)\n")
        return 0
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        p.error("no command given (put it after --)")
    rate = None if args.rate.lower() == "none" else args.rate
    try:
        cluster = EmulatedCluster(args.hosts, rate=rate, latency_ms=args.latency_ms,
                                  subnet=args.subnet, prefix=args.prefix,
                                  queue_ms=args.queue_ms, shape_ingress=not args.no_ingress,
                                  qdisc=args.qdisc)
        with cluster:
            sys.stderr.write(f"emucluster: {cluster!r}\nemucluster: -H {cluster.hosts_arg()} "
                             f"{shlex.join(cluster.mpirun_args())}\n")
            sys.stderr.flush()
            proc = subprocess.Popen(command, env=cluster.env(os.environ))
            try:
                return proc.wait()
            finally:
                if proc.poll() is None:
                    proc.terminate()
                    try:
                        proc.wait(timeout=5)
                    except subprocess.TimeoutExpired:
                        proc.kill()
                        proc.wait()
    except EmulationError as exc:
        sys.stderr.write(f"emucluster: error: {exc}\n")
        return 2
    except KeyboardInterrupt:
        return 128 + signal.SIGINT


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
