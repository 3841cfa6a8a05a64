"""HiPress under torchrun: the torch.distributed (gloo) transport, end to end.

The same workers as the MPI tests run under ``torchrun`` (``python -m
torch.distributed.run``) at 2 and 3 processes; no MPI launcher variables reach them, so
``transport: auto`` picks torch.distributed. Covered: the engine's value cases (identity
exact against ``dist.all_reduce``, every codec under every strategy bit-identical, the
gather path, error feedback, non-finite gradients), Horovod's collectives and the torch
adapter's behaviour suite, a stall and failures ending the job with a time bound, and
the DDP hook training the digits model.
"""

from __future__ import annotations

import json
import re
import time

import pytest
from mpi_util import REPO_ROOT, run_torchrun

from hipress.comm import choose_transport
from hipress.errors import ConfigError

ENGINE = REPO_ROOT / "tests" / "workers" / "engine_cases.py"
TORCH = REPO_ROOT / "tests" / "workers" / "torch_adapter.py"
FAILURES = REPO_ROOT / "tests" / "workers" / "failures.py"


# ------------------------------------------------------------------ transport choice
@pytest.mark.parametrize("env,want", [
    ({"OMPI_COMM_WORLD_SIZE": "2", "RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h",
      "MASTER_PORT": "1"}, "mpi"),  # hipressrun exports torch's variables too: MPI wins
    ({"PMI_SIZE": "4"}, "mpi"),
    ({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"},
     "torch"),
    ({}, "mpi"),
    ({"WORLD_SIZE": "1"}, "mpi"),
    # torchrun inside a Slurm job (sbatch or srun) inherits SLURM_PROCID: torchrun wins
    ({"SLURM_PROCID": "0", "TORCHELASTIC_RUN_ID": "j1", "RANK": "3", "WORLD_SIZE": "8",
      "MASTER_ADDR": "node1", "MASTER_PORT": "29500"}, "torch"),
    ({"SLURM_PROCID": "0", "PMI_SIZE": "2", "TORCHELASTIC_RUN_ID": "j1", "RANK": "1",
      "WORLD_SIZE": "2", "MASTER_ADDR": "node1", "MASTER_PORT": "29500"}, "torch"),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "4"}, "mpi"),  # srun python train.py
])
def test_auto_transport_follows_the_launcher(env, want):
    assert choose_transport("auto", env) == want


def test_world_size_without_a_launcher_is_refused_naming_the_variables():
    with pytest.raises(ConfigError) as info:
        choose_transport("auto", {"WORLD_SIZE": "4", "RANK": "0"})
    msg = str(info.value)
    assert "WORLD_SIZE=4" in msg and "MASTER_ADDR, MASTER_PORT are not set" in msg, msg
    assert "hipressrun" in msg and "torchrun" in msg, msg


def test_explicit_and_unknown_transports():
    assert choose_transport("torch", {"OMPI_COMM_WORLD_SIZE": "2"}) == "torch"
    assert choose_transport("mpi", {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h",
                                    "MASTER_PORT": "1"}) == "mpi"
    with pytest.raises(ConfigError, match="transport must be one of"):
        choose_transport("nccl", {})


# ------------------------------------------------------------------ jobs under torchrun

def _passed(out: str, case: str, pattern: str) -> int:
    """Count lines matching ``pattern`` (torchrun's ``[default<r>]:`` prefix allowed)."""
    full = r"^(?:\[default\d+\]:)?" + pattern.format(case=re.escape(case)) + "$"
    return len(re.findall(full, out, flags=re.M))


def _run(nproc, script, args, timeout=300, env=None):
    proc = run_torchrun(nproc, script, args, timeout=timeout, env=env)
    return proc, proc.stdout + proc.stderr


ENGINE_CASES = ["identity_exact", "order_by_name", "fp16_no_overflow", "partitions_and_fusion",
                "duplicate_inflight_name", "powersgd_compresses_matrices", "low_precision_dtypes",
                "inplace_matches_new_array", "all_codecs_bit_identical",
                "error_feedback_tracks_sum", "nonfinite_passes_through",
                "direct_calls_exact_under_policy", "broadcast_pipelined_sizes_and_roots"]
_engine_jobs: dict = {}


def _engine_job(nproc):
    if nproc not in _engine_jobs:
        cases = ENGINE_CASES + (["gather_topk", "terngrad_shared_scale"] if nproc == 2 else [])
        _engine_jobs[nproc] = (_run(nproc, ENGINE, cases), cases)
    return _engine_jobs[nproc]


@pytest.mark.mpi
@pytest.mark.parametrize("nproc", [2, 3])
def test_engine_cases_under_torchrun(nproc):
    (proc, out), cases = _engine_job(nproc)
    assert proc.returncode == 0, out[-4000:]
    assert "transport torch.distributed (gloo)" in out, out[-2000:]
    for c in cases:
        assert _passed(out, c, r"rank \d+ PASS {case}") == nproc, (c, out[-3000:])


@pytest.mark.mpi
def test_timeline_gathers_every_rank_under_torchrun(tmp_path):
    path = tmp_path / "trace.json"
    proc, out = _run(3, ENGINE, ["timeline_and_stats"],
                     env={"HIPRESS_TIMELINE": str(path), "NP": "3"})
    assert proc.returncode == 0, out[-3000:]
    data = json.loads(path.read_text())
    events = [e for e in data["traceEvents"] if e["ph"] == "X"]
    assert {e["pid"] for e in events} == {0, 1, 2}
    assert data["otherData"]["world_size"] == 3


SUITE = ["identity_exact", "accumulation", "checkpoint", "identical_every_codec",
         "allgather_rows", "alltoall_splits", "reducescatter_ops", "grouped_allreduce_order",
         "ops_and_int_dtypes", "join_uneven", "nonfinite_passthrough"]
TORCH_CASES = ["backward_passes", "ddp_hook", "ddp_powersgd_per_parameter"]


@pytest.mark.mpi
@pytest.mark.parametrize("nproc", [2, 3])
def test_torch_adapter_suite_under_torchrun(nproc):
    cases = [f"{c}@torch" for c in SUITE] + (TORCH_CASES if nproc == 2 else [])
    proc, out = _run(nproc, TORCH, [",".join(cases)])
    for c in cases:
        assert _passed(out, c, r"PASS {case} rank \d+") == nproc, (c, out[-4000:])
    assert proc.returncode == 0, out[-3000:]


@pytest.mark.mpi
def test_ddp_hook_trains_digits_under_torchrun():
    """torchrun + DDP + make_ddp_hook: the digits model reaches the hipressrun band (>= 90%)."""
    proc, out = _run(2, REPO_ROOT / "examples" / "torch" / "train_digits.py",
                     ["--ddp", "--compression", "powersgd", "--epochs", "3", "--no-progress"])
    assert proc.returncode == 0, out[-3000:]
    epochs = re.findall(r"^(?:\[default0\]:)?epoch (\d)/3 loss ([\d.]+) test_acc ([\d.]+)%$",
                        proc.stdout, re.M)
    assert [e[0] for e in epochs] == ["1", "2", "3"], out[-3000:]
    assert float(epochs[-1][1]) < float(epochs[0][1])
    assert float(epochs[-1][2]) >= 90.0, epochs  # measured 92.9% (3 epochs, 2 ranks)
    assert "fc1.weight=powersgd" in proc.stdout, proc.stdout[-1000:]


@pytest.mark.mpi
@pytest.mark.parametrize("nproc,compression", [(2, "none"), (3, "none"), (2, "onebit")])
def test_ddp_script_needs_no_hipress_call_but_the_hook(nproc, compression):
    """init_process_group + DDP + register_comm_hook(make_ddp_hook(...)): HiPress starts
    itself over DDP's process group; every rank ends bit-identical (exact for none)."""
    proc, out = _run(nproc, REPO_ROOT / "tests" / "workers" / "ddp_only.py", [compression])
    assert proc.returncode == 0, out[-3000:]
    assert _passed(out, "", r"DDPONLY PASS rank \d+ transport torch") == nproc, out[-3000:]


@pytest.mark.mpi
def test_stall_names_the_gradients_under_torchrun():
    t0 = time.monotonic()
    proc, out = _run(2, ENGINE, ["stall_names_missing_rank"], timeout=90, env={"STALL": "2"})
    assert time.monotonic() - t0 < 45
    stalls = [line for line in proc.stdout.splitlines() if "STALL" in line]
    assert len(stalls) == 2, out[-3000:]
    for line in stalls:
        assert "'grad/a' not submitted by rank(s) [1]" in line
        assert "'grad/a_1' not submitted by rank(s) [0]" in line


@pytest.mark.mpi
@pytest.mark.parametrize("mode,code,quote", [
    ("raise_before", 1, "RuntimeError: boom on rank 1 (raise_before)"),
    ("raise_waiting", 1, "RuntimeError: boom on rank 1 (raise_waiting)"),
    ("exit3", 3, None),
    ("kill", -9, None),
])
def test_failing_rank_ends_the_torchrun_job_fast(mode, code, quote):
    """torchrun reports the failing rank (root cause) within seconds of the failure."""
    proc, out = _run(2, FAILURES, [mode, "torch"], timeout=120)
    assert proc.returncode != 0, out[-3000:]
    stamp = re.search(r"FAILAT ([\d.]+)", proc.stdout)
    assert stamp, out[-3000:]
    root = out[out.find("Root Cause"):]
    assert re.search(r"rank\s*:\s*1 \(local_rank: 1\)", root), root[:1500]
    assert re.search(rf"exitcode\s*:\s*{code}\b", root), root[:1500]
    if quote:
        assert quote in out, out[-3000:]
    # run_torchrun returns as soon as torchrun exits
    elapsed = time.time() - float(stamp.group(1))
    assert elapsed < 10.0, elapsed
