"""Benchmarks run in rounds (--repeats): medians, ranges and ratios within a round.

bench/train_e2e.py and bench/secopa_pipeline.py, their pure functions only.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _load(name):
    sys.path.insert(0, str(ROOT / "bench"))
    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def e2e():
    return _load("train_e2e")


def _row(label, repeat, ips, rc=0, load=1.0):
    row = {"framework": "torch", "model": "vgg19", "rate": "1gbit", "label": label,
           "system": "hipress" if label.startswith("hipress") else "ddp", "codec": "x",
           "strategy": "ps", "repeat": repeat, "load": [load, 1.0, 1.0], "rc": rc}
    if ips is not None:
        row.update(images_per_s=ips, step_s=32.0 / ips, engine_cpu_s=0.1 * repeat)
    else:
        row["log_tail"] = [f"failed in round {repeat}"]
    return row


def test_rounds_alternate_the_job_order(e2e):
    jobs = [{"label": "ddp-noop"}, {"label": "ddp-powersgd1"}, {"label": "hipress-ps-onebit"}]
    labels = [[job["label"] for _, job in e2e.round_order(jobs, r)] for r in (1, 2, 3)]
    assert labels[0] == labels[2] == ["ddp-noop", "ddp-powersgd1", "hipress-ps-onebit"]
    assert labels[1] == ["hipress-ps-onebit", "ddp-powersgd1", "ddp-noop"]
    # the index is the job's planned place (its rendezvous port), whatever the round
    assert [k for k, _ in e2e.round_order(jobs, 2)] == [2, 1, 0]


def test_rounds_give_medians_ranges_and_within_round_ratios(e2e):
    # the machine drifts: round 2 is fast for every system, round 3 slow
    runs = [_row("ddp-noop", 1, 10.0), _row("ddp-powersgd1", 1, 6.0),
            _row("hipress-ps-onebit", 1, 9.0),
            _row("ddp-noop", 2, 12.0, load=3.5), _row("ddp-powersgd1", 2, 8.0),
            _row("hipress-ps-onebit", 2, 10.0),
            _row("ddp-noop", 3, 9.0), _row("ddp-powersgd1", 3, 5.0),
            _row("hipress-ps-onebit", 3, 8.0)]
    e2e.annotate(runs)
    assert runs[2]["vs"]["ddp-powersgd1"] == pytest.approx(1.5)  # 9 / 6, its own round
    rows = e2e.combine(runs)
    assert [r["label"] for r in rows] == ["ddp-noop", "ddp-powersgd1", "hipress-ps-onebit"]
    hp = rows[2]
    assert hp["repeats"] == 3
    assert hp["images_per_s"] == 9.0
    assert hp["images_per_s_range"] == [8.0, 10.0]
    # per-round ratios 1.5, 1.25, 1.6: median 1.5 (the next test tells it from the ratio
    # of the medians)
    assert hp["vs"]["ddp-powersgd1"] == pytest.approx(1.5)
    assert hp["vs_range"]["ddp-powersgd1"] == pytest.approx([1.25, 1.6])
    assert hp["x_floor"] == pytest.approx(8.0 / 9.0)  # per round 0.9, 0.833, 0.889
    assert hp["engine_cpu_s"] == pytest.approx(0.2)
    assert rows[0]["load"][0] == 3.5  # the highest load at a job's start
    text = e2e.table(rows)
    assert "9.00 (8.00-10.00)" in text
    assert "1.50x (1.25-1.60)" in text
    per_round = e2e.rounds_table(runs)
    assert "| vgg19 | 1gbit | hipress-ps-onebit | 9.00 | 10.00 | 8.00 |" in per_round


def test_median_of_ratios_differs_from_ratio_of_medians(e2e):
    runs = [_row("ddp-noop", 1, 10.0), _row("ddp-powersgd1", 1, 4.0),
            _row("hipress-ps-onebit", 1, 8.0),
            _row("ddp-noop", 2, 10.0), _row("ddp-powersgd1", 2, 6.0),
            _row("hipress-ps-onebit", 2, 6.0),
            _row("ddp-noop", 3, 10.0), _row("ddp-powersgd1", 3, 5.0),
            _row("hipress-ps-onebit", 3, 9.0)]
    e2e.annotate(runs)
    hp = e2e.combine(runs)[2]
    # per round: 2.0, 1.0, 1.8 -> median 1.8; medians 8 / 5 would say 1.6
    assert hp["vs"]["ddp-powersgd1"] == pytest.approx(1.8)
    assert hp["images_per_s"] / e2e.combine(runs)[1]["images_per_s"] == pytest.approx(1.6)


def test_failed_rounds_are_left_out_and_reported(e2e):
    runs = [_row("ddp-noop", 1, 10.0), _row("hipress-ps-onebit", 1, None, rc=1),
            _row("ddp-noop", 2, 10.0), _row("hipress-ps-onebit", 2, 9.0),
            _row("ddp-noop", 3, 10.0), _row("hipress-ps-onebit", 3, 7.0)]
    e2e.annotate(runs)
    rows = e2e.combine(runs)
    hp = rows[1]
    assert hp["repeats"] == 2 and hp["rc"] == 1
    assert hp["images_per_s"] == 8.0 and hp["images_per_s_range"] == [7.0, 9.0]
    assert "failed in round 1" not in e2e.failures(rows)  # it has figures from rounds 2-3
    dead = [_row("ddp-noop", 1, 10.0), _row("hipress-ps-onebit", 1, None, rc=137),
            _row("ddp-noop", 2, 10.0), _row("hipress-ps-onebit", 2, None, rc=1)]
    e2e.annotate(dead)
    gone = e2e.combine(dead)[1]
    assert gone["repeats"] == 0 and gone.get("images_per_s") is None and gone["rc"] == 137
    assert "failed in round 1" in e2e.failures(e2e.combine(dead))


def test_cpu_bound_step_spreads_every_rank_cpu_over_the_machine(e2e):
    # VGG-19's DDP floor: 4 ranks x 1.44 CPU s per step on 2 cores cannot step in under 2.88 s
    assert e2e.cpu_bound_step(4, 1.44, cpus=2) == pytest.approx(2.88)
    assert e2e.cpu_bound_step(1, 0.5, cpus=4) == pytest.approx(0.125)


def test_secopa_pipeline_compares_the_plan_within_each_round():
    pipe = _load("secopa_pipeline")
    jobs = {  # stop 36's VGG-19 onebit steps; the plan's round 2 job failed here
        "threshold": [{"round": 0, "rc": 0, "step_s": 3.696},
                      {"round": 1, "rc": 0, "step_s": 4.079},
                      {"round": 2, "rc": 0, "step_s": 3.768}],
        "compress_everything": [{"round": 0, "rc": 0, "step_s": 3.593},
                                {"round": 1, "rc": 0, "step_s": 3.573},
                                {"round": 2, "rc": 0, "step_s": 4.452}],
        "plan": [{"round": 0, "rc": 0, "step_s": 3.798},
                 {"round": 1, "rc": 0, "step_s": 4.155},
                 {"round": 2, "rc": 1, "step_s": 3.839}]}
    got = pipe.plan_vs_best_fixed_per_round(jobs)
    assert got == pytest.approx([3.798 / 3.593, 4.155 / 3.573])
    jobs["plan"][2]["rc"] = 0  # round 2's best fixed policy is threshold
    assert pipe.plan_vs_best_fixed_per_round(jobs)[2] == pytest.approx(3.839 / 3.768)
    assert pipe.plan_vs_best_fixed_per_round({"plan": jobs["plan"]}) == []
    # the run-time plan (sync.plan: auto) is not a fixed policy either, and has its own
    jobs["auto"] = [{"round": 0, "rc": 0, "step_s": 3.5}, {"round": 2, "rc": 0, "step_s": 3.9}]
    assert pipe.plan_vs_best_fixed_per_round(jobs, "auto") == pytest.approx(
        [3.5 / 3.593, 3.9 / 3.768])
    assert pipe.plan_vs_best_fixed_per_round(jobs)[0] == pytest.approx(3.798 / 3.593)


def test_secopa_pipeline_times_only_the_steps_after_the_warmup(tmp_path):
    pipe = _load("secopa_pipeline")
    # an auto job: 6 warm-up steps (the first and the observed ones are slow), 3 timed
    for r, timed in enumerate([[3.9, 3.6, 3.8], [3.7, 4.0, 3.5]]):
        steps = [9.1, 4.7, 4.6, 8.2, 4.5, 4.4] + timed
        (tmp_path / f"auto.rank{r}.json").write_text(json.dumps(
            {"warmup_used": 6, "steps": [{"step_s": s} for s in steps]}))
    assert pipe.worker_step_s(tmp_path / "auto", 2) == pytest.approx(3.8)  # the slower rank
    assert pipe.worker_step_s(tmp_path / "auto", 3) is None  # rank 2 left no file
