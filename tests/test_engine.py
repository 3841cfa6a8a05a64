"""CaSync engine under real MPI: values, agreement by name, stalls, dead ranks, timeline.

Each test runs tests/workers/engine_cases.py under mpirun at several world sizes
(odd ones included: chunking and round-robin aggregators must handle them).
"""

from __future__ import annotations

import json
import time

import pytest
from mpi_util import REPO_ROOT, assert_ok, run_mpi

WORKER = REPO_ROOT / "tests" / "workers" / "engine_cases.py"

pytestmark = pytest.mark.mpi

CORE_CASES = [
    "identity_exact",
    "order_by_name",
    "fp16_no_overflow",
    "partitions_and_fusion",
    "duplicate_inflight_name",
    "powersgd_compresses_matrices",
    "low_precision_dtypes",
    "world1_passthrough",
    "inplace_matches_new_array",
    "negotiation_allgather_sizes",
    "allreduce_mismatch_fails_every_rank_and_engine_goes_on",
    "broadcast_mismatch_fails_every_rank",
    "broadcast_pipelined_sizes_and_roots",
]


def run_cases(np_, cases, timeout=240, env=None):
    proc = run_mpi(np_, WORKER, cases, timeout=timeout, env=env)
    assert_ok(proc)
    for c in cases:
        passed = sum(1 for line in proc.stdout.splitlines() if line.endswith(f"PASS {c}"))
        assert passed == np_, f"{c}: {passed}/{np_} ranks passed\n{proc.stdout[-3000:]}"
    return proc


@pytest.mark.parametrize("np_", [1, 2, 3, 4])
def test_core_values(np_):
    run_cases(np_, CORE_CASES)


@pytest.mark.parametrize("np_", [1, 2])
def test_engine_limits_numpy_blas_threads_while_it_runs(np_):
    run_cases(np_, ["blas_threads_limited"], env={"OPENBLAS_NUM_THREADS": "2"})


@pytest.mark.parametrize("np_", [1, 3])
def test_finished_tasks_release_their_arrays(np_):
    run_cases(np_, ["finished_tasks_release_their_arrays"])


@pytest.mark.parametrize("np_", [1, 3, 4])
def test_every_codec_and_strategy_bit_identical(np_):
    run_cases(np_, ["all_codecs_bit_identical"])


@pytest.mark.parametrize("np_", [2, 3])
def test_powersgd_error_feedback_in_place_matches_reference(np_):
    run_cases(np_, ["powersgd_feedback_matches_reference"])


@pytest.mark.parametrize("np_", [2, 3])
def test_error_feedback_tracks_running_sum(np_):
    run_cases(np_, ["error_feedback_tracks_sum"])


@pytest.mark.parametrize("np_", [2, 3])
def test_nonfinite_gradient_reaches_every_rank_and_keeps_state(np_):
    run_cases(np_, ["nonfinite_passes_through"])


@pytest.mark.parametrize("np_", [2, 3])
def test_direct_calls_exact_under_a_lossy_policy(np_):
    run_cases(np_, ["direct_calls_exact_under_policy"])


def test_secopa_plan_auto_is_followed():
    proc = run_cases(2, ["plan_auto_followed"])
    # the explicit codec the plan cannot turn off: said once, by rank 0, with the fix
    said = [line for line in proc.stderr.splitlines() if "always honoured" in line]
    assert len(said) == 1 and "'plan.tiny.explicit'" in said[0], proc.stderr[-2000:]
    assert "compression.algorithm" in said[0]


def test_secopa_plan_auto_observes_steps_then_plans_them_all(tmp_path):
    save = tmp_path / "auto-plan.json"
    t0 = time.monotonic()
    proc = run_cases(2, ["plan_auto_observes_then_plans"], env={"PLAN_SAVE": str(save)})
    took = time.monotonic() - t0
    said = [ln for ln in proc.stderr.splitlines() if "SeCoPa planned 3 gradients" in ln]
    assert len(said) == 1 and "observed steps 1-2" in said[0], proc.stderr[-3000:]
    assert "refitted to the observed steps" in said[0], said[0]
    from hipress.secopa.planner import Plan

    p = Plan.load(save)
    assert p.world_size == 2 and p.codec == "onebit" and len(p.gradients) == 3
    assert p.predicted_delay_ms and set(p.predicted_delay_ms) >= {"plan", "threshold"}, p
    assert took < 120, f"the job took {took:.0f} s"


@pytest.mark.parametrize("np_", [2, 3])
def test_secopa_plan_auto_carries_residuals_to_the_plans_partitions(np_):
    proc = run_cases(np_, ["plan_auto_regroups_residuals"])
    said = [ln for ln in proc.stderr.splitlines() if "error-feedback residual was" in ln]
    assert len(said) == 1, proc.stderr[-3000:]  # rank 0, once at INFO
    assert ("'obs.fc' now runs on the ps path in 3 partition(s) (was ps in 1)" in said[0]
            and "re-split (524288 elements)" in said[0]), said[0]


def test_secopa_plan_auto_drops_a_plan_slower_than_the_fixed_policy():
    proc = run_cases(2, ["plan_auto_drops_a_slower_plan"])
    said = [ln for ln in proc.stderr.splitlines() if "SeCoPa dropped its plan" in ln]
    assert len(said) == 1, proc.stderr[-3000:]  # rank 0, once
    assert "steps 3-4 under it took" in said[0] and "fixed policy from the next step" in said[0]
    timing = [ln for ln in proc.stderr.splitlines() if "SeCoPa follows its plan" in ln]
    assert len(timing) == 1 and "from step 2 and times steps 3-4" in timing[0], timing
    # the residual's keys back in one partition: asserted per step in the case


def test_secopa_plan_gather_entry_keeps_the_engines_partitions():
    run_cases(2, ["plan_gather_keeps_the_engines_partitions"])


def test_secopa_plan_auto_resumes_from_a_checkpoint_loaded_on_one_rank():
    run_cases(2, ["plan_auto_resume_on_rank0"])


def test_secopa_plan_auto_names_a_rank_that_joined_during_the_observation():
    t0 = time.monotonic()
    run_cases(2, ["plan_auto_join_early"])
    assert time.monotonic() - t0 < 90


@pytest.mark.parametrize("np_", [2, 3])
def test_cycle_paces_rounds_and_a_waiting_rank_starts_one_at_once(np_):
    run_cases(np_, ["cycle_paces_rounds_and_waiting_flushes"])


@pytest.mark.parametrize("np_", [2, 3])
def test_small_gradients_share_rounds_until_a_partition_is_queued(np_):
    run_cases(np_, ["small_gradients_share_rounds_until_a_partition_is_queued"])


@pytest.mark.parametrize("np_", [2, 3])
def test_ps_bulk_is_bit_identical_to_one_task_per_gradient(np_):
    run_cases(np_, ["ps_bulk_matches_one_task_per_gradient"])


def test_empty_compressed_gradients_complete_world2():
    run_cases(2, ["empty_compressed_gradients_complete"])


def test_gather_path_values_world2():
    run_cases(2, ["gather_topk"])


def test_terngrad_summable_world2():
    run_cases(2, ["terngrad_shared_scale"])


def test_stall_fails_every_rank_naming_gradient_and_ranks():
    t0 = time.monotonic()
    proc = run_cases(2, ["stall_names_missing_rank"], timeout=60, env={"STALL": "2"})
    assert time.monotonic() - t0 < 30
    stalls = [line for line in proc.stdout.splitlines() if "STALL" in line]
    assert len(stalls) == 2
    for line in stalls:
        assert "'grad/a' not submitted by rank(s) [1]" in line
        assert "'grad/a_1' not submitted by rank(s) [0]" in line


def run_failing_case(np_, case):
    """Run ``case`` (every rank catches the error it expects) under mpirun.

    Asserts that every rank passes, that the job ends in under 40 s (a stall would take
    60), and that it exits non-zero: transfers were in flight when the engines stopped,
    so MPI is not finalized, and the job is reported as failed although every rank
    caught its error.
    """
    t0 = time.monotonic()
    proc = run_mpi(np_, WORKER, [case], timeout=60, env={"STALL": "60"})
    assert time.monotonic() - t0 < 40
    passed = [line for line in proc.stdout.splitlines() if line.endswith(f"PASS {case}")]
    assert len(passed) == np_, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.returncode != 0


def test_failure_on_one_rank_fails_every_rank_quickly():
    run_failing_case(3, "failure_on_one_rank_fails_all")


@pytest.mark.parametrize("np_", [2, 3])
def test_powersgd_stage_error_drops_the_compensated_residual_on_every_rank(np_):
    run_failing_case(np_, "powersgd_stage_error_drops_residual")


def test_a_rank_waiting_in_join_and_a_peer_that_shut_down_both_end():
    """Rank 1 waits in join() while rank 0 shuts down instead: both end within the stall
    limit (5 s each) and the job exits non-zero (neither rank finalizes MPI). Before, rank
    0 hung in MPI_Finalize and rank 1 in join() until the launcher's timeout."""
    t0 = time.monotonic()
    proc = run_mpi(2, WORKER, ["shutdown_while_a_peer_waits_in_join"], timeout=60)
    assert time.monotonic() - t0 < 40
    case = "shutdown_while_a_peer_waits_in_join"
    passed = {line.split()[1] for line in proc.stdout.splitlines()
              if line.endswith(f"PASS {case}")}
    assert passed == {"0", "1"}, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.returncode != 0


@pytest.mark.parametrize("np_", [2, 3])
def test_root_error_at_a_broadcasts_start_fails_every_rank(np_):
    """A task whose first step raises on one rank (inside the negotiation round) is told
    to every rank: the root's PayloadError, PeerFailure naming rank 0 on the others."""
    run_failing_case(np_, "broadcast_root_error_fails_every_rank")


def test_dead_rank_does_not_hang_the_others():
    t0 = time.monotonic()
    proc = run_mpi(3, WORKER, ["dead_rank"], timeout=60)
    elapsed = time.monotonic() - t0
    assert proc.returncode != 0
    assert elapsed < 30, elapsed


def test_timeline_is_a_chrome_trace(tmp_path):
    path = tmp_path / "trace.json"
    run_cases(3, ["timeline_and_stats"], env={"HIPRESS_TIMELINE": str(path), "NP": "3"})
    data = json.loads(path.read_text())
    events = [e for e in data["traceEvents"] if e["ph"] == "X"]
    assert {e["pid"] for e in events} == {0, 1, 2}
    enc = [e for e in events if e["name"] == "encode"]
    assert enc and all(e["args"]["gradient"] == "tl.onebit" for e in enc)
    # what `hipress profile --from-timeline` reads: the codec, the elements, error feedback
    assert all(e["args"]["codec"] == "onebit" and e["args"]["numel"] >= 1
               and e["args"]["feedback"] is True for e in enc)
    dec = [e for e in events if e["name"] in ("decode", "decode+merge")]
    assert dec and all(e["args"]["codec"] == "onebit" and e["args"]["numel"] >= 1 for e in dec)
    # the work spans' own thread CPU (never more than their wall time, give or take the
    # two clocks' reads), and per step the engine's CPU and task steps: the refit's
    # engine cost per task step
    work = enc + dec + [e for e in events if e["name"] == "merge+encode"]
    assert all(0.0 <= e["args"]["cpu_us"] <= e["dur"] + 50.0 for e in work)
    cpu = [e for e in events if e["name"] == "engine-cpu"]
    assert sorted((e["pid"], e["args"]["step"]) for e in cpu) == [
        (r, s) for r in range(3) for s in (0, 1)]
    # the second step ran one PS allreduce: at least encode, send, wait, decode steps
    assert all(e["args"]["task_steps"] >= 4 and 0.0 < e["args"]["cpu_s"] < 5.0
               for e in cpu if e["args"]["step"] == 1)
    # what SeCoPa's pipeline model reads: every allreduce's submission, grouped ones too,
    # on every rank, once per step it was submitted in (broadcasts and join fillers are
    # not arrivals)
    subs = [e for e in events if e["name"] == "submit"]
    assert sorted((e["pid"], e["args"]["gradient"], e["args"]["numel"]) for e in subs) == sorted(
        (r, name, n) for r in range(3) for name, n in (("tl.onebit", 5000), ("tl.g0", 10),
                                                        ("tl.g1", 10), ("tl.onebit", 5000)))
    done = {(e["pid"], e["args"]["gradient"]) for e in events if e["name"] == "done"}
    assert {(e["pid"], e["args"]["gradient"]) for e in subs} <= done
    assert all(e["dur"] >= 0 and "ts" in e for e in events)
    assert data["otherData"]["world_size"] == 3


def test_peer_payload_of_wrong_size_is_refused_on_every_rank():
    # the failure leaves transfers in flight, so the job itself ends non-zero
    proc = run_mpi(2, WORKER, ["peer_payload_wrong_size"], timeout=90)
    refused = [line for line in proc.stdout.splitlines() if "REFUSED" in line]
    assert len(refused) == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert all("expects 64" in line for line in refused)


def test_same_numel_different_shape_fails_negotiation_on_every_rank():
    proc = run_cases(2, ["shape_mismatch_same_numel"], timeout=90)
    lines = [line for line in proc.stdout.splitlines() if "MISMATCH" in line]
    assert len(lines) == 2, proc.stdout[-3000:]
    assert all("'psgd.shape'" in line and "[200, 100]" in line for line in lines)


def test_small_tag_space_never_reuses_a_tag_in_flight():
    run_cases(2, ["many_in_flight_small_tag_space"], timeout=180, env={"TAG_BITS": "14"})


@pytest.mark.parametrize("np_", [2, 3])
def test_grouped_allreduce_of_different_sizes_fails_every_rank_and_leaves_nothing(np_):
    # STALL=5: a name some rank grouped and another did not, if left waiting, ends the job
    run_cases(np_, ["grouped_allreduce_count_mismatch_fails_every_rank"], timeout=120,
              env={"STALL": "5"})
