"""Tests of the emulated cluster (hipress.testing.emucluster).

The ``netns`` tests build real network namespaces, bridges and tc shapers and need root;
where that is impossible they are skipped with the reason (not root, a tool missing, or
namespaces refused by the kernel/container). Each one checks that its own cluster left
nothing behind, by its unique name tag (other clusters may be alive at the same time).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from hipress.testing.emucluster import (
    EmulatedCluster,
    EmulationError,
    cleanup,
    leftovers,
    namespaces_unavailable,
    parse_rate,
)

REPO = Path(__file__).resolve().parent.parent
REASON = namespaces_unavailable()


def needs_netns(fn):
    """Mark a test ``netns`` and skip it, with the reason, where namespaces are unavailable."""
    skip = pytest.mark.skipif(REASON is not None,
                              reason=f"emulated cluster unavailable: {REASON}")
    return pytest.mark.netns(skip(fn))


WORKER = textwrap.dedent("""
    import socket
    import numpy as np
    import hipress as hp

    hp.init({"logging": {"level": "WARNING"}})
    r, n = hp.rank(), hp.size()
    x = np.arange(1000, dtype=np.float32) * (r + 1)
    y = hp.allreduce(x, name="grad", op="sum")
    expect = np.arange(1000, dtype=np.float32) * (n * (n + 1) / 2)
    assert np.array_equal(y, expect), (r, y[:4], expect[:4])
    big = np.full(300_000, float(r), np.float32)          # > min_compress_bytes, partitioned
    z = hp.allreduce(big, name="big", op="average")
    assert np.allclose(z, (n - 1) / 2, atol=1e-6), (r, z[:4])
    print(f"RESULT rank={r} size={n} host={socket.gethostname()} ok", flush=True)
    hp.shutdown()
""")


def left_by(cluster_tag: str, prefix: str = "hpns") -> list:
    return [x for kind in leftovers(prefix).values() for x in kind
            if os.path.basename(x).startswith(cluster_tag)]


def hipressrun(args, env, timeout=120.0) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "hipress.launch", *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout,
                          cwd=str(REPO))


# ----------------------------------------------------------------------------- no root needed
def test_parse_rate_units():
    assert parse_rate("1gbit") == 1e9
    assert parse_rate("100mbit") == 1e8
    assert parse_rate("2.5gbit") == 2.5e9
    assert parse_rate("1gibit") == 2.0**30
    assert parse_rate(5e8) == 5e8
    for bad in ("1gbps", "10mbps", "fast", "-1gbit", 0):
        with pytest.raises(EmulationError):
            parse_rate(bad)


def test_bad_arguments_are_refused_before_touching_the_system():
    with pytest.raises(EmulationError, match="n_hosts"):
        EmulatedCluster(0)
    with pytest.raises(EmulationError, match="prefix"):
        EmulatedCluster(2, prefix="toolongprefix")
    with pytest.raises(EmulationError, match="private network"):
        EmulatedCluster(2, subnet="8.8.8.0/24")
    with pytest.raises(EmulationError, match="qdisc"):
        EmulatedCluster(2, qdisc="netem")


# ----------------------------------------------------------------------------- netns
@needs_netns
@pytest.mark.parametrize("qdisc", ["tbf", "htb"])
def test_cluster_layout_and_teardown(qdisc):
    with EmulatedCluster(3, rate="250mbit", qdisc=qdisc) as c:
        assert len(set(c.hosts)) == 3 and all(h.startswith(str(c.subnet)[:-5]) for h in c.hosts)
        assert c.hosts_arg() == ",".join(f"{h}:1" for h in c.hosts)
        names = [c.run(i, ["hostname"], capture_output=True, text=True, check=True).stdout.strip()
                 for i in range(3)]
        assert names == c.hostnames and len(set(names)) == 3
        addr = c.run(1, ["ip", "-4", "-o", "addr", "show", "eth0"], capture_output=True,
                     text=True, check=True).stdout
        assert f"inet {c.hosts[1]}/" in addr
        tc_host = c.run(0, ["tc", "qdisc", "show", "dev", "eth0"], capture_output=True,
                        text=True, check=True).stdout
        tc_port = subprocess.run(["tc", "class" if qdisc == "htb" else "qdisc", "show", "dev",
                                  c.host_veths[0]], capture_output=True, text=True).stdout
        assert qdisc in tc_host
        assert "250Mbit" in tc_port
        env = c.env()
        assert env["PRTE_MCA_plm_ssh_agent"] == c.agent and os.access(c.agent, os.X_OK)
        assert env["OMPI_MCA_btl_tcp_if_include"] == str(c.subnet)
        assert c.mpirun_args()[:3] == ["--prtemca", "plm_ssh_agent", c.agent]
        tag = c.tag
        assert left_by(tag)  # it exists while up
    assert left_by(tag) == []


@needs_netns
@pytest.mark.mpi
def test_hipressrun_three_emulated_hosts(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(WORKER)
    with EmulatedCluster(3, rate="1gbit") as c:
        proc = hipressrun(["-np", "3", "-H", c.hosts_arg(), sys.executable, str(script)],
                          env=c.env(os.environ))
        assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
        results = sorted(line.split("] ", 1)[-1] for line in proc.stdout.splitlines()
                         if "RESULT" in line)
        assert len(results) == 3, proc.stdout
        hosts = {r.split("host=")[1].split()[0] for r in results}
        ranks = {int(r.split("rank=")[1].split()[0]) for r in results}
        assert ranks == {0, 1, 2} and all("size=3" in r for r in results)
        assert hosts == set(c.hostnames)  # each rank on its own emulated host
        tag = c.tag
    assert left_by(tag) == []


RECV = textwrap.dedent("""
    import socket, sys, time
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((sys.argv[1], 5201)); s.listen(1)
    print("READY", flush=True)
    conn, _ = s.accept(); n = 0; t0 = None
    while True:
        b = conn.recv(1 << 20)
        if not b:
            break
        if t0 is None:
            t0 = time.perf_counter()
        n += len(b)
    print(n, time.perf_counter() - t0, flush=True)
""")
SEND = textwrap.dedent("""
    import socket, sys
    s = socket.create_connection((sys.argv[1], 5201)); s.sendall(bytes(16 << 20)); s.close()
""")


@needs_netns
def test_shaped_rate_16mib_at_100mbit():
    # 16 MiB at 100 Mbit/s: 1.34 s of payload, 1.40 s with TCP/IP/Ethernet headers
    # (1514 bytes on the wire per 1448 of payload). Unshaped veth would take ~20 ms.
    with EmulatedCluster(2, rate="100mbit") as c:
        recv = c.popen(1, [sys.executable, "-c", RECV, c.hosts[1]], stdout=subprocess.PIPE,
                       text=True)
        assert recv.stdout.readline().strip() == "READY"
        c.run(0, [sys.executable, "-c", SEND, c.hosts[1]], check=True, timeout=30)
        nbytes, seconds = recv.stdout.readline().split()
        recv.wait(timeout=10)
    assert int(nbytes) == 16 << 20
    assert 1.30 <= float(seconds) <= 1.9, seconds


@needs_netns
@pytest.mark.mpi
def test_teardown_after_failed_job_and_exception(tmp_path):
    script = tmp_path / "fail.py"
    script.write_text("import sys, time\nfrom mpi4py import MPI\n"
                      "time.sleep(0.5)\nsys.exit(3 if MPI.COMM_WORLD.rank == 1 else 0)\n")
    lingering = None
    with pytest.raises(RuntimeError, match="job failed"):
        with EmulatedCluster(2, rate="1gbit") as c:
            tag = c.tag
            # a process left running inside a host (like an orphaned daemon)
            lingering = c.popen(0, ["sleep", "300"])
            proc = hipressrun(["-np", "2", "-H", c.hosts_arg(), sys.executable, str(script)],
                              env=c.env(os.environ))
            assert proc.returncode == 3, proc.stdout + proc.stderr
            raise RuntimeError("job failed")
    assert left_by(tag) == []
    assert lingering.wait(timeout=5) != 0  # killed by the teardown


CRASH = textwrap.dedent("""
    import os, signal, sys, time
    from hipress.testing.emucluster import EmulatedCluster
    c = EmulatedCluster(2, rate="1gbit").start()
    print(c.tag, flush=True)
    if sys.argv[1] == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)
""")


@needs_netns
def test_sigterm_tears_down_and_cleanup_removes_sigkilled_leftovers():
    # SIGTERM: the owner's handler turns it into SystemExit and tears down.
    p = subprocess.Popen([sys.executable, "-c", CRASH, "term"], stdout=subprocess.PIPE,
                         text=True, cwd=str(REPO))
    tag = p.stdout.readline().strip()
    assert tag and left_by(tag)
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=20) == 128 + signal.SIGTERM
    assert left_by(tag) == []
    # SIGKILL: nothing can run in the owner; cleanup() finds its leftovers by name.
    p = subprocess.Popen([sys.executable, "-c", CRASH, "kill"], stdout=subprocess.PIPE,
                         text=True, cwd=str(REPO))
    tag = p.stdout.readline().strip()
    assert p.wait(timeout=20) == -signal.SIGKILL
    assert len(left_by(tag)) >= 4  # 2 namespaces, 2 veths, bridge, agent dir
    removed = cleanup()
    assert set(left_by(tag)) == set() and any(tag in r for r in removed)


@needs_netns
def test_latency_needs_netem():
    tag = None
    try:
        with EmulatedCluster(2, rate="1gbit", latency_ms=5.0) as c:
            tag = c.tag
            out = c.run(0, ["tc", "qdisc", "show", "dev", "eth0"], capture_output=True,
                        text=True).stdout
            assert "netem" in out and "delay 5ms" in out
    except EmulationError as exc:  # this machine's kernel has no netem
        assert "netem" in str(exc) and "cannot be emulated" in str(exc)
    assert tag is None or left_by(tag) == []
    assert [x for x in leftovers()["namespaces"] if x.endswith("n")] == []  # netem probe


@needs_netns
def test_cli_runs_command_with_cluster_env():
    code = ("import os; print(os.environ['HIPRESS_EMU_HOSTS']); "
            "print(os.environ['PRTE_MCA_plm_ssh_agent'])")
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "hipress.testing.emucluster", "--hosts", "2",
                           "--rate", "500mbit", "--", sys.executable, "-c", code],
                          capture_output=True, text=True, timeout=60, cwd=str(REPO))
    assert proc.returncode == 0, proc.stderr
    hosts, agent = proc.stdout.split()
    assert len(hosts.split(",")) == 2 and all(h.endswith(":1") for h in hosts.split(","))
    assert not os.path.exists(agent)  # removed on teardown
    assert time.monotonic() - t0 < 30
    proc = subprocess.run([sys.executable, "-m", "hipress.testing.emucluster", "--hosts", "2",
                           "--", sys.executable, "-c", "import sys; sys.exit(7)"],
                          capture_output=True, text=True, timeout=60, cwd=str(REPO))
    assert proc.returncode == 7
