"""SeCoPa: planner optimality against brute force, edge cases, file validation, profiling
under real MPI, the CLI, and the run-time PlanFollower."""

from __future__ import annotations

import itertools
import json
import math
import types

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mpi_util import assert_ok, run_mpi

from hipress import cli
from hipress.codecs import Codec, get_codec
from hipress.config import config_from_dict
from hipress.secopa import (
    CostModel,
    Plan,
    PlanError,
    PlanFollower,
    Profile,
    ProfileError,
    SeCoPaError,
    decide,
    engine_paths,
    fit_line,
    load_gradients,
    partition_candidates,
    plan,
    run_profile,
)
from hipress.secopa.planner import may_compress
from hipress.secopa.profile import codec_key

GiB = 1e-9  # seconds per byte at 1 GB/s


def line(a, b, floor=0.0):
    return {"a": a, "b": b, "floor": floor}


def make_profile(world_size=4, ar_fixed=200e-6, link_gbs=1.0, codecs=None, step=50e-6):
    """A synthetic profile: 1 GB/s links, codecs at a few GB/s, fixed costs of ~10-100 us."""
    b = GiB / link_gbs
    comm = {
        "ring_step": line(30e-6, b, 20e-6),
        "ps_gather": line(30e-6, (world_size - 1) * b, 20e-6),
        "ps_bcast": line(30e-6, (world_size - 1) * b, 20e-6),
        "allgather": line(50e-6, (world_size - 1) * b * 1.2, 30e-6),
        "allreduce": line(ar_fixed, 2 * (world_size - 1) / world_size * b, ar_fixed),
    }
    if world_size == 1:
        comm = {k: line(0.0, 0.0) for k in comm}
    cod = codecs or {
        "onebit": dict(encode=line(20e-6, 0.1e-9, 15e-6), decode=line(20e-6, 0.05e-9, 15e-6),
                       merge=line(20e-6, 0.08e-9, 15e-6)),
        "terngrad": dict(encode=line(30e-6, 0.4e-9), decode=line(20e-6, 0.2e-9),
                         merge=line(25e-6, 0.3e-9), stages=line(40e-6, 0.5e-9), n_stages=2),
        "fp16": dict(encode=line(8e-6, 0.6e-9), decode=line(10e-6, 0.4e-9),
                     merge=line(10e-6, 0.5e-9), stages=line(3e-6, 1.1e-9), n_stages=1),
        "topk": dict(encode=line(30e-6, 0.3e-9), decode=line(20e-6, 0.03e-9),
                     merge=line(20e-6, 0.05e-9)),
        "randomk": dict(encode=line(60e-6, 0.15e-9), decode=line(50e-6, 0.1e-9),
                        merge=line(50e-6, 0.15e-9), stages=line(60e-6, 0.2e-9), n_stages=1),
        "powersgd": dict(encode=line(60e-6, 0.3e-9), decode=line(50e-6, 0.3e-9),
                         merge=line(50e-6, 0.3e-9), stages=line(80e-6, 0.5e-9), n_stages=2),
    }
    codecs_json = {}
    for name, fits in cod.items():
        entry = {"name": name, "params": {}}
        entry.update(fits)
        codecs_json[name] = entry
    data = {"version": 1, "world_size": world_size, "hosts": ["h"] * world_size,
            "step_overhead_s": step, "ef": line(4e-6, 0.1e-9), "write": line(3e-6, 0.15e-9),
            "comm": comm,
            "codecs": codecs_json}
    return Profile.from_json(json.dumps(data))


PROFILE4 = make_profile(4)
CODECS = {n: get_codec(n) for n in ("onebit", "terngrad", "fp16", "topk", "randomk")}


# ----------------------------------------------------------------------------- fitting
def test_fit_line_recovers_a_line_and_its_floor():
    pts = [(x, 1e-5 + 2e-10 * x) for x in (1e3, 1e4, 1e5, 1e6, 1e7)]
    f = fit_line(pts)
    assert f.a == pytest.approx(1e-5, rel=1e-6) and f.b == pytest.approx(2e-10, rel=1e-6)
    assert f.rel_rms < 1e-9 and f.r2 == pytest.approx(1.0)
    # flat small sizes become the floor; the line fits the rest
    pts = [(64, 5e-5), (256, 5e-5), (1024, 5e-5), (1e6, 1e-4), (4e6, 4e-4), (16e6, 1.6e-3)]
    f = fit_line(pts)
    assert f.floor == pytest.approx(5e-5)
    assert f(64) == pytest.approx(5e-5) and f(16e6) == pytest.approx(1.6e-3, rel=0.05)
    # beyond the largest size the line is extrapolated
    assert f(1.6e8) == pytest.approx(f.a + f.b * 1.6e8)
    assert f.b2 is None  # a line is enough here
    with pytest.raises(ValueError):
        fit_line([(10, 0.0)])


def test_fit_line_adds_a_steeper_line_past_a_cache_cliff():
    # 0.1 ns/B in cache up to 4 MiB, 0.5 ns/B from memory beyond: convex
    xs = [4.0**k for k in range(5, 14)]
    pts = [(x, 2e-5 + 1e-10 * x if x <= 4 * 2**20 else 2e-5 + 1e-10 * 4 * 2**20
            + 5e-10 * (x - 4 * 2**20)) for x in xs]
    f = fit_line(pts)
    assert f.b2 is not None and f.b2 > 4 * f.b
    assert f.rel_rms < 0.02
    assert f(1e9) == pytest.approx(pts[-1][1] + 5e-10 * (1e9 - pts[-1][0]), rel=0.02)
    assert f.scaled(2.0).b2 == pytest.approx(2 * f.b2)


def test_scaled_fit_keeps_the_intercept_and_scales_both_lines_growth():
    from hipress.secopa.profile import Fit

    # the ``ef`` fit of a VGG-19 DGC job's profile: a cache cliff, its second line's
    # intercept far below zero; a refit from training scaled it by 1.85
    f = Fit(a=4.854e-6, b=1.2038e-10, a2=-2.0729e-3, b2=5.976e-10, floor=4.898e-6)
    g = f.scaled(1.85)
    for x in (4096.0, 1 << 20, 4 << 20, 16 << 20, 256 << 20):
        assert g(x) == pytest.approx(max(f.floor, f.a + 1.85 * (f(x) - f.a)), rel=1e-9)
    # at 4 MiB (the second line): 1.85 x 0.51 ms, not the 2.56 ms that scaling b2 alone gave
    assert f(4 << 20) == pytest.approx(0.5098e-3, rel=1e-3)
    assert g(4 << 20) == pytest.approx(0.9389e-3, rel=1e-3)
    assert g.a == f.a and g.floor == f.floor and g.b2 == pytest.approx(1.85 * f.b2)
    # a factor of 1 changes nothing; a fit without a second line scales its slope only
    assert f.scaled(1.0)(16 << 20) == pytest.approx(f(16 << 20), rel=1e-12)
    h = Fit(a=1e-5, b=2e-10)
    assert h.scaled(3.0)(1e6) == pytest.approx(1e-5 + 6e-10 * 1e6)


# ----------------------------------------------------------------------------- brute force
def brute_force_min(model, codec, numel, strategy, feedback, max_partitions):
    """Every option, enumerated here independently of the planner."""
    costs = [model.uncompressed(numel).total_s]
    ratio_ok = codec.name != "none" and numel >= 1 and (
        4 * numel / codec.payload_nbytes((numel,)) > 1)
    if ratio_ok:
        for path in engine_paths(codec, strategy):
            ks = partition_candidates(numel, max_partitions) if path in ("ps", "ring") else [1]
            for k in ks:
                costs.append(model.compressed(codec, numel, path, k, feedback).total_s)
    return min(costs)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    log_numel=st.floats(0, 8.7),
    n=st.sampled_from([1, 2, 3, 4, 8, 16]),
    strategy=st.sampled_from(["ps", "ring", "auto"]),
    codec=st.sampled_from(sorted(CODECS)),
    memory=st.sampled_from(["auto", "none", "residual"]),
    max_partitions=st.sampled_from([1, 4, 40, 300]),
)
def test_decide_is_the_brute_force_minimum(log_numel, n, strategy, codec, memory,
                                           max_partitions):
    numel = max(1, int(10**log_numel))
    c = CODECS[codec]
    model = CostModel(PROFILE4, n)
    e = decide(model, numel, (numel,), c, strategy, n, name="g", memory=memory,
               max_partitions=max_partitions)
    fb = memory == "residual" or (memory == "auto" and c.error_feedback)
    best = brute_force_min(model, c, numel, strategy, fb, max_partitions)
    assert e.predicted_ms == pytest.approx(best * 1e3, rel=1e-12, abs=1e-15)
    # the entry really is that option
    if e.compress:
        again = model.compressed(c, numel, e.strategy, e.partitions, fb).total_s
        assert again * 1e3 == pytest.approx(e.predicted_ms, rel=1e-12)
        assert e.strategy in engine_paths(c, strategy)
        assert 1 <= e.partitions <= min(max_partitions, numel)
    else:
        assert e.strategy == "fused" and e.partitions == 1


@pytest.mark.parametrize("n,strategy,ar_fixed", [(4, "ps", 200e-6), (3, "ring", 200e-6),
                                                  (8, "auto", 5e-3), (4, "ps", 0.05)])
def test_plan_total_is_the_minimum_over_every_combination(n, strategy, ar_fixed):
    # small gradient set, every combination of per-gradient options, shared fixed cost
    prof = make_profile(n, ar_fixed=ar_fixed)
    grads = [("a", (3000,)), ("b", (40, 1000)), ("c", (2_000_000,)), ("d", (64,))]
    codec = CODECS["onebit"]
    model = CostModel(prof, n)
    per = []
    for _, shape in grads:
        numel = math.prod(shape)
        opts = [(False, model.uncompressed(numel).total_s)]
        if may_compress(codec, numel):
            for path in engine_paths(codec, strategy):
                for k in range(1, 6):
                    opts.append((True, model.compressed(codec, numel, path, k, True).total_s))
        per.append(opts)
    fixed = model.fused_fixed()
    best = min(sum(c for _, c in combo) + (fixed if any(not z for z, _ in combo) else 0.0)
               for combo in itertools.product(*per))
    p = plan(prof, grads, codec, strategy, n, max_partitions=5)
    assert p.predicted_ms["plan"] == pytest.approx(best * 1e3, rel=1e-12)
    assert p.predicted_ms["plan"] <= p.predicted_ms["compress_everything"] + 1e-9
    assert p.predicted_ms["plan"] <= p.predicted_ms["compress_nothing"] + 1e-9
    assert p.predicted_ms["plan"] <= p.predicted_ms["threshold"] + 1e-9 or any(
        math.prod(s) * 4 > 4 * 1024 * 1024 * 5 for _, s in grads)


def test_large_fixed_cost_makes_the_plan_compress_everything():
    # a huge per-iteration allreduce cost: leaving anything uncompressed costs it
    prof = make_profile(4, ar_fixed=1.0)
    grads = [("w", (1_000_000,)), ("bias", (1000,))]
    p = plan(prof, grads, CODECS["onebit"], "ps", 4)
    assert all(g.compress for g in p.gradients)
    one = decide(prof, 1000, (1000,), CODECS["onebit"], "ps", 4)
    assert not one.compress  # alone, the shared fixed cost is taken as already paid


# ----------------------------------------------------------------------------- edge cases
def test_world_size_one_never_compresses_and_costs_nothing():
    prof = make_profile(1)
    for name, codec in CODECS.items():
        p = plan(prof, load_gradients("resnet50"), codec, "ps", 1)
        assert not any(g.compress for g in p.gradients), name
        assert p.predicted_ms["plan"] == 0.0 and p.predicted_ms["compress_nothing"] == 0.0
        assert p.predicted_ms["compress_everything"] > 0  # compute without any gain
    # and a multi-rank profile planned for N = 1 agrees
    assert not decide(PROFILE4, 10**8, None, CODECS["onebit"], "ring", 1).compress


def test_one_element_gradient_is_never_compressed():
    for n in (2, 4, 16):
        for name, codec in CODECS.items():
            e = decide(PROFILE4, 1, (1,), codec, "auto", n, name="scalar")
            assert not e.compress and e.partitions == 1 and e.strategy == "fused", name


def test_gradient_larger_than_any_profiled_size_extrapolates_linearly():
    # every curve measured up to 16 MiB only
    d = json.loads(PROFILE4.to_json())
    for fits in [d["comm"], d["codecs"]["onebit"]]:
        for f in fits.values():
            if isinstance(f, dict):
                f["x_max"] = 16 * 2**20
    prof = Profile.from_json(json.dumps(d))
    model = CostModel(prof, 4)
    c = CODECS["onebit"]
    huge = 5 * 10**9  # 20 GB of float32
    enc = prof.codecs["onebit"].encode
    assert enc(4 * huge) == pytest.approx(enc.a + enc.b * 4 * huge)
    t1 = model.compressed(c, huge, "ring", 64, True).total_s
    t2 = model.compressed(c, 2 * huge, "ring", 64, True).total_s
    assert math.isfinite(t1) and 1.9 < t2 / t1 < 2.1  # linear in size, no blow-up
    e = decide(model, huge, None, c, "ps", 4)
    assert e.compress and e.partitions > 1
    assert model.uncompressed(huge).total_s > e.predicted_ms / 1e3


class InflateCodec(Codec):
    """Payload twice the input: compression ratio 0.5 (not registered)."""

    name = "inflate"

    def _encode(self, flat, shape, name):
        return [np.repeat(flat, 2)]

    def _decode(self, sections, shape, dtype):
        return sections[0][::2].astype(dtype)

    def _layout(self, shape, dtype):
        return [(dtype, 2 * math.prod(shape))]


def test_codec_with_ratio_below_one_is_never_compressed():
    fits = {"inflate": dict(encode=line(0.0, 0.0), decode=line(0.0, 0.0), merge=line(0.0, 0.0))}
    # compute is free and the network slow: only the ratio can keep it uncompressed
    prof = make_profile(8, codecs=fits, link_gbs=0.01, step=0.0)
    codec = InflateCodec()
    assert codec.compression_ratio((10**6,)) < 1
    p = plan(prof, load_gradients("vgg19"), codec, "ring", 8)
    assert not any(g.compress for g in p.gradients)
    assert p.predicted_ms["plan"] == pytest.approx(p.predicted_ms["compress_nothing"])
    none = get_codec("none")
    assert not decide(make_profile(4), 10**7, None, none, "ps", 4).compress


def test_low_rank_codec_is_planned_on_the_gradient_shape():
    # the compressed allreduce hands PowerSGD the matrix: ratio > 1 only for 2-D shapes
    codec = get_codec("powersgd", rank=1)
    mat = decide(PROFILE4, 4096 * 1024, (4096, 1024), codec, "ps", 4)
    flat = decide(PROFILE4, 4096 * 1024, (4096 * 1024,), codec, "ps", 4)
    assert mat.compress and mat.strategy == "allreduce" and mat.partitions == 1
    assert not flat.compress
    p = plan(PROFILE4, [("fc", (4096, 1024)), ("bias", (4096,))], codec, "auto", 4)
    assert p.entry("fc").compress and not p.entry("bias").compress


def test_partition_candidates_and_engine_paths():
    assert partition_candidates(1) == [1]
    ks = partition_candidates(10**9, 1024)
    assert ks[:32] == list(range(1, 33)) and ks[-1] == 1024
    assert all(b / a < 1.15 for a, b in zip(ks[31:], ks[32:]))
    assert partition_candidates(50, 1024)[-1] == 50
    assert engine_paths(CODECS["topk"], "ps") == ("gather",)
    assert engine_paths(CODECS["randomk"], "ring") == ("allreduce",)
    assert engine_paths(CODECS["terngrad"], "auto") == ("ps", "ring", "allreduce")
    assert engine_paths(CODECS["onebit"], "auto") == ("ps", "ring")


def test_gather_is_priced_in_the_engines_partitions_pipelined():
    from hipress.engine.planning import Decision
    from hipress.secopa.pipeline import simulate

    topk, n = CODECS["topk"], 10_000_000  # 40 MB: 10 partitions of 4 MB <= 4 MiB
    model = CostModel(PROFILE4, 4)
    one = model.compressed(topk, n // 10, "gather", 1, True)  # one engine partition
    assert one.partitions == 1
    c = model.compressed(topk, n, "gather", 1, True)  # a plan's K does not apply
    assert c.path == "gather" and c.partitions == 10
    assert c == model.compressed(topk, n, "gather", 37, True)
    assert c.compute_s == pytest.approx(10 * one.compute_s)
    assert c.network_s == pytest.approx(10 * one.network_s)
    assert c.total_s == pytest.approx(max(10 * one.compute_s + one.network_s,
                                          10 * one.network_s + one.compute_s))
    # an engine that never partitions (huge partition_bytes): one serial unit that pays
    # each step's fixed cost once instead of 10 times
    whole = CostModel(PROFILE4, 4, partition_bytes=1 << 40).compressed(topk, n, "gather")
    assert whole.partitions == 1
    assert whole.total_s == pytest.approx(whole.compute_s + whole.network_s)
    assert whole.compute_s < c.compute_s
    # the simulation runs the 10 partitions as 10 jobs that overlap compute and transfers
    sim = simulate(model, [("g", n, 0.0)], {"g": Decision(True, 1, "gather")}, topk, True)
    assert max(c.compute_s, c.network_s) - 1e-12 <= sim.end_s < c.compute_s + c.network_s
    # a plan records gather with 1 partition (the engine's own apply), as PlanEntry requires
    p = plan(PROFILE4, [("g", n)], topk, "ps", 4)
    assert [(e.strategy, e.partitions) for e in p.gradients] == [("gather", 1)]


def test_pipelining_formula_at_one_partition_is_the_serial_sum():
    model = CostModel(PROFILE4, 4)
    c = model.compressed(CODECS["onebit"], 10**6, "ps", 1, False)
    assert c.total_s == pytest.approx(c.compute_s + c.network_s)
    r = model.compressed(CODECS["onebit"], 10**6, "ring", 1, False)
    assert r.total_s == pytest.approx(r.compute_s + r.network_s)
    # partitions help a big gradient, up to a point
    ts = [model.compressed(CODECS["onebit"], 10**8, "ps", k, False).total_s
          for k in (1, 4, 16, 10**5)]
    assert ts[1] < ts[0] and ts[2] < ts[0] and ts[3] > ts[2]


def test_comm_scaling_to_other_world_sizes():
    c8 = PROFILE4.comm_at(8)
    assert c8.ps_gather.b == pytest.approx(PROFILE4.comm.ps_gather.b * 7 / 3)
    assert c8.ring_step.b == pytest.approx(PROFILE4.comm.ring_step.b)
    assert c8.allreduce.b == pytest.approx(PROFILE4.comm.allreduce.b * (14 / 8) / (6 / 4))
    assert PROFILE4.comm_at(1).allreduce(1e9) == 0.0
    with pytest.raises(ProfileError, match="one rank"):
        make_profile(1).comm_at(4)


# ----------------------------------------------------------------------------- files
def _profile_dict():
    return json.loads(PROFILE4.to_json())


def _profile_error(tmp_path, data, text=None):
    p = tmp_path / "profile.json"
    p.write_text(text if text is not None else json.dumps(data))
    with pytest.raises(ProfileError) as info:
        Profile.load(p)
    return str(info.value)


def test_invalid_profile_files_name_the_field(tmp_path):
    d = _profile_dict()
    del d["comm"]["ring_step"]
    assert "comm.ring_step: Field required" in _profile_error(tmp_path, d)
    d = _profile_dict()
    d["codecs"]["onebit"]["encode"]["b"] = -1.0
    assert "codecs.onebit.encode.b" in _profile_error(tmp_path, d)
    d = _profile_dict()
    d["world_size"] = 0
    assert "world_size" in _profile_error(tmp_path, d)
    d = _profile_dict()
    d["comm"]["allgather"]["bogus"] = 1
    assert "comm.allgather.bogus" in _profile_error(tmp_path, d)
    d = _profile_dict()
    d["version"] = 7
    assert "version: 7 is not supported" in _profile_error(tmp_path, d)
    assert "not JSON" in _profile_error(tmp_path, None, text="{nope")
    assert "expect a JSON object" in _profile_error(tmp_path, None, text="[1, 2]")
    with pytest.raises(ProfileError, match="cannot read"):
        Profile.load(tmp_path / "missing.json")
    # a codec the profile lacks: the error names it and lists what there is
    with pytest.raises(ProfileError, match=r"'qsgd.*onebit"):
        decide(PROFILE4, 10**6, None, get_codec("qsgd"), "ps", 4)


def _plan_error(tmp_path, data):
    p = tmp_path / "plan.json"
    p.write_text(json.dumps(data))
    with pytest.raises(PlanError) as info:
        Plan.load(p)
    return str(info.value)


def test_invalid_plan_files_name_the_field(tmp_path):
    good = plan(PROFILE4, load_gradients("resnet50"), CODECS["onebit"], "ps", 4)
    path = tmp_path / "plan.json"
    good.save(path)
    back = Plan.load(path)
    assert back == good and back.entry("fc.weight") == good.entry("fc.weight")
    assert back.entry("no.such") is None
    d = json.loads(good.to_json())
    d["gradients"][3]["partitions"] = 0
    assert "gradients.3.partitions" in _plan_error(tmp_path, d)
    d = json.loads(good.to_json())
    d["gradients"][2]["name"] = d["gradients"][1]["name"]
    assert "gradients.2.name" in _plan_error(tmp_path, d)
    d = json.loads(good.to_json())
    d["gradients"][0]["strategy"] = "tree"
    assert "gradients.0.strategy" in _plan_error(tmp_path, d)
    d = json.loads(good.to_json())
    d["gradients"][0].update(compress=False, strategy="ps")
    assert "gradients.0" in _plan_error(tmp_path, d) and "fused" in _plan_error(tmp_path, d)
    d = json.loads(good.to_json())
    del d["gradients"][0]["numel"]
    assert "gradients.0.numel: Field required" in _plan_error(tmp_path, d)
    d = json.loads(good.to_json())
    d["strategy"] = "tree"
    assert "strategy" in _plan_error(tmp_path, d)
    # the first line stands alone (a launcher's one-line summary shows only it)
    d["gradients"][0]["partitions"] = 0
    first = _plan_error(tmp_path, d).splitlines()[0]
    assert "strategy" in first and "(and 1 more):" in first, first


# ----------------------------------------------------------------------------- MPI
PROFILE_JOB = r"""
import sys
from mpi4py import MPI
from hipress import cli
from hipress.secopa import run_profile
out = sys.argv[1]
comm = MPI.COMM_WORLD.Dup()
prof = run_profile(comm, ["fp16", "bf16"], sizes=[256, 1024, 4096],
                   comm_sizes=[64, 1 << 20], time_budget_s=0.6)
with open(f"{out}/rank{comm.rank}.json", "w") as f:
    f.write(prof.to_json())
rc = cli.main(["profile", "--codecs", "fp16", "--sizes", "256", "4096", "--comm-sizes", "64",
               "4096", "--time-budget", "0.3", "-o", f"{out}/cli.json"])
print(f"rank {comm.rank} elapsed {prof.elapsed_s:.2f} warmup {prof.warmup_s:.2f} rc {rc}")
"""


@pytest.mark.mpi
def test_profile_under_mpi_is_identical_on_every_rank(tmp_path):
    proc = run_mpi(2, PROFILE_JOB, [str(tmp_path)], timeout=120)
    assert_ok(proc)
    texts = [(tmp_path / f"rank{r}.json").read_text() for r in range(2)]
    assert texts[0] == texts[1]
    prof = Profile.load(tmp_path / "rank0.json")
    assert prof.world_size == 2 and len(prof.hosts) == 2
    assert set(prof.codecs) == {"fp16", "bf16"}
    for _, f in prof.comm:
        assert f(1024) > 0 and len(f.points) >= 2
    # the machine's busy CPU while 1 MiB allreduces ran, per byte: two ranks polling and
    # copying on this machine's cores (about 4 ns/byte on the emulated cluster)
    assert 0 < prof.wire_cpu_s_per_byte < 1e-6
    fp16 = prof.codecs["fp16"]
    assert fp16.n_stages == 1 and fp16.stages is not None
    assert all(len(getattr(fp16, p).points) >= 2 for p in ("encode", "decode", "merge"))
    cli_prof = Profile.load(tmp_path / "cli.json")
    assert set(cli_prof.codecs) == {"fp16"} and cli_prof.world_size == 2
    assert "SeCoPa profile: 2 rank(s)" in proc.stdout and "comm ring_step" in proc.stdout


def test_profile_time_budget_is_enforced():
    from mpi4py import MPI

    comm = MPI.COMM_SELF.Dup()
    try:
        # default sizes go up to 4 Mi elements: all of them would take far longer than 1 s
        prof = run_profile(comm, ["fp16", "bf16", "minmax8"], time_budget_s=1.0)
    finally:
        comm.Free()
    assert prof.elapsed_s - prof.warmup_s < 1.0 + 1.0
    assert prof.world_size == 1 and all(f(1e6) == 0.0 for _, f in prof.comm)
    xmax = [getattr(c, p).x_max for c in prof.codecs.values() for p in ("encode", "merge")]
    assert min(xmax) < 4 * 4**11  # some series were cut short by the budget
    assert all(len(c.encode.points) >= 2 for c in prof.codecs.values())


def test_profile_flags_load_and_keeps_a_low_percentile_with_its_spread(monkeypatch, caplog):
    from mpi4py import MPI

    from hipress.secopa import profile as prof_mod

    lo, spread = prof_mod._low_and_spread([1.0, 1.0, 1.0, 1.0, 2.0, 3.0, 9.0, 1.0, 1.0, 1.0])
    assert lo == 1.0 and spread == pytest.approx((np.percentile(
        [1.0] * 7 + [2.0, 3.0, 9.0], 80) - 1.0) / 1.0)
    # a host with 4 cores, 2 s of wall time: 8 core-seconds; the profile's rank used 1
    assert prof_mod.others_share([(0.0, 10.0, 5.0, 4)], [(2.0, 15.0, 6.0, 4)]) == 0.5
    assert prof_mod.others_share([(0.0, 10.0, 5.0, 4)], [(2.0, 11.0, 6.0, 4)]) == 0.0
    assert prof_mod.others_share([(0.0, -1.0, 5.0, 4)], [(2.0, -1.0, 6.0, 4)]) == 0.0
    # two ranks of the profile on one host: both ranks' own CPU is theirs, not others'
    assert prof_mod.others_share([(0.0, 10.0, 5.0, 4), (0.0, 10.0, 1.0, 4)],
                                 [(2.0, 14.0, 6.0, 4), (2.0, 14.0, 2.0, 4)]) == 0.25
    busy = iter([(0.0, 100.0, 0.0, 2), (10.0, 118.0, 1.0, 2)])  # 17 of 20 core-seconds
    monkeypatch.setattr(prof_mod, "cpu_sample", lambda: next(busy))
    comm = MPI.COMM_SELF.Dup()
    try:
        with caplog.at_level("WARNING", logger="hipress.secopa.profile"):
            prof = run_profile(comm, ["fp16"], sizes=[256, 1024], time_budget_s=0.3)
    finally:
        comm.Free()
    assert prof.loaded and list(prof.host_load.values()) == [0.85]
    assert any("taken under load" in r.getMessage() for r in caplog.records)
    assert all(f.spread >= 0 for f in (prof.codecs["fp16"].encode, prof.ef))
    again = Profile.from_json(prof.to_json())
    assert again.loaded and again.host_load == prof.host_load
    from hipress.secopa.cli import _profile_table

    assert "TAKEN UNDER LOAD" in _profile_table(again)
    quiet_cpu = iter([(0.0, 100.0, 0.0, 2), (10.0, 103.0, 2.0, 2)])  # 1 of 20
    monkeypatch.setattr(prof_mod, "cpu_sample", lambda: next(quiet_cpu))
    comm = MPI.COMM_SELF.Dup()
    try:
        quiet = run_profile(comm, ["fp16"], sizes=[256, 1024], time_budget_s=0.3)
    finally:
        comm.Free()
    assert not quiet.loaded


def _timeline(factors, n=1 << 20, feedback=True, fused=False):
    """Spans of onebit whose durations are ``factors`` times PROFILE4's predictions
    (``fused``: the aggregator's merge as one merge+encode span, as onebit's fused pass)."""
    cp, x = PROFILE4.codecs["onebit"], 4.0 * n
    enc = cp.encode(x) + (cp.decode(x) + PROFILE4.ef(x) if feedback else 0.0)
    events = []
    for i in range(5):
        wobble = 1.0 + 0.01 * (i - 2)  # the median is the middle one
        events += [
            {"name": "encode", "ph": "X", "ts": i, "dur": enc * factors["encode"] * wobble * 1e6,
             "args": {"codec": "onebit", "numel": n, "feedback": feedback}},
            {"name": "decode", "ph": "X", "ts": i, "dur": (cp.decode(x) + PROFILE4.write(x))
             * factors["decode"] * wobble * 1e6, "args": {"codec": "onebit", "numel": n}},
            {"name": "decode", "ph": "X", "ts": i, "dur": 1.0,  # a stored own payload
             "args": {"codec": "onebit", "numel": n, "reused": True}},
            {"name": "merge+encode", "ph": "X", "ts": i, "dur": (4 * cp.merge(x) + enc)
             * factors["merge"] * wobble * 1e6,
             "args": {"codec": "onebit", "numel": n, "payloads": 4, "feedback": feedback}}
            if fused else
            {"name": "decode+merge", "ph": "X", "ts": i, "dur": 4 * cp.merge(x)
             * factors["merge"] * wobble * 1e6,
             "args": {"codec": "onebit", "numel": n, "payloads": 4}},
            {"name": "allreduce", "ph": "X", "ts": i, "dur": 5.0, "args": {"bytes": 8}},
        ]
    return {"traceEvents": events}


def test_refit_from_timeline_scales_compute_to_what_training_measured(tmp_path, capsys):
    from hipress.secopa.profile import refit_from_timeline

    factors = {"encode": 2.0, "decode": 3.0, "merge": 1.5}
    refit, report = refit_from_timeline(PROFILE4, _timeline(factors))
    for op, f in factors.items():
        assert report[f"onebit/{op}"]["factor"] == pytest.approx(f)
        assert report[f"onebit/{op}"]["spans"] == 5  # the reused decode is not counted
        old, new = getattr(PROFILE4.codecs["onebit"], op), getattr(refit.codecs["onebit"], op)
        assert new.b == pytest.approx(old.b * f) and new.a == old.a
    assert refit.ef.b == pytest.approx(PROFILE4.ef.b * 2.0)
    assert refit.write.b == pytest.approx(PROFILE4.write.b * 3.0)
    assert refit.comm == PROFILE4.comm and refit.source == "timeline"
    assert refit.codecs["terngrad"] == PROFILE4.codecs["terngrad"]  # not in the timeline
    n = 25_000_000
    slow = CostModel(refit, 4).compressed(CODECS["onebit"], n, "ps", 8, True)
    fast = CostModel(PROFILE4, 4).compressed(CODECS["onebit"], n, "ps", 8, True)
    assert slow.compute_s > 1.5 * fast.compute_s
    assert "qsgd" not in {c.name for c in PROFILE4.codecs.values()}
    with pytest.raises(ProfileError, match="found qsgd x1"):
        refit_from_timeline(PROFILE4, [
            {"name": "encode", "ph": "X", "dur": 3.0, "args": {"codec": "qsgd", "numel": 10}}])
    # the CLI: hipress profile --from-timeline trace.json --profile base.json -o out.json
    base, trace, out = tmp_path / "base.json", tmp_path / "trace.json", tmp_path / "out.json"
    PROFILE4.save(base)
    trace.write_text(json.dumps(_timeline(factors)))
    assert cli.main(["profile", "--from-timeline", str(trace), "--profile", str(base),
                     "-o", str(out)]) == 0
    text = capsys.readouterr().out
    assert "onebit/encode" in text and "2.00" in text
    assert Profile.load(out).source == f"timeline:{trace}"
    assert cli.main(["profile", "--from-timeline", str(trace), "-o", str(out)]) == 1
    assert "needs --profile" in capsys.readouterr().err


@pytest.mark.parametrize("feedback", [True, False])
def test_refit_reads_the_fused_merge_encode_span_as_merge(feedback):
    from hipress.secopa.profile import refit_from_timeline

    factors = {"encode": 0.8, "decode": 1.2, "merge": 2.5}
    _, report = refit_from_timeline(PROFILE4, _timeline(factors, feedback=feedback,
                                                        fused=True))
    assert report["onebit/merge"]["spans"] == 5
    assert report["onebit/merge"]["factor"] == pytest.approx(2.5)
    assert report["onebit/encode"]["factor"] == pytest.approx(0.8)


def test_refit_prices_a_gradients_reduce_stages_together():
    """A compressed allreduce's stage spans (encode at stage 0, then stage) of one gradient
    and step are summed and priced against the profile's ``stages`` fit."""
    from hipress.secopa.profile import refit_from_timeline

    cp, n = PROFILE4.codecs["powersgd"], 1 << 20
    whole = cp.stages(4.0 * n)
    events = []
    for rank in (0, 1):
        for step, factor in enumerate((2.9, 3.0, 3.1)):
            for i, share in enumerate((0.5, 0.25, 0.25)):  # three stage spans, one step
                events.append({"name": "encode" if i == 0 else "stage", "ph": "X",
                               "ts": 100.0 * step + i, "dur": 1.0, "pid": rank,
                               "args": {"gradient": "w", "stage": i, "codec": "powersgd",
                                        "numel": n, "cpu_us": whole * factor * share * 1e6}})
    # an older version's stage spans name no codec: not counted
    events.append({"name": "stage", "ph": "X", "ts": 500.0, "dur": 9e9,
                   "args": {"gradient": "w", "stage": 1}})
    refit, report = refit_from_timeline(PROFILE4, events)
    assert report["powersgd/stages"] == pytest.approx(
        {"spans": 6, "factor": 3.0, "p20": 2.9, "p80": 3.1})
    assert "powersgd/encode" not in report  # stage 0 is not priced as an encode
    assert refit.codecs["powersgd"].stages.b == pytest.approx(cp.stages.b * 3.0)
    assert refit.codecs["powersgd"].encode == cp.encode
    with pytest.raises(ProfileError, match=r"no codec spans \(encode, decode, merge, stages\)"):
        refit_from_timeline(PROFILE4, events[-1:])


def _engine_steps(rank, cpu_s, task_steps, work):
    """One rank's timeline: engine-cpu events at ts 0, 10, 20, ... (the first is start-up)
    with ``cpu_s``/``task_steps`` each, and ``work`` (wall us, CPU us) encode spans per step
    between them."""
    events = []
    for i, (c, n) in enumerate(zip(cpu_s, task_steps)):
        events.append({"name": "engine-cpu", "ph": "X", "ts": 10.0 * i, "dur": 0.0, "pid": rank,
                       "args": {"step": i, "cpu_s": c, "task_steps": n}})
        for wall, cpu in work:
            events.append({"name": "encode", "ph": "X", "ts": 10.0 * i + 1, "dur": wall,
                           "pid": rank, "args": {"codec": "onebit", "numel": 1000,
                                                 "cpu_us": cpu}})
    return events


def test_refit_takes_the_engine_cost_per_task_step_from_the_job(tmp_path, capsys):
    from hipress.secopa.profile import fit_step_overhead, refit_from_timeline

    # two ranks, three steps each; the first step (start-up, 9 s of compilation) is left
    # out, and so are its spans (ts 1): per later step and rank 0.05 s of engine CPU, of
    # which 0.02 s in two encode spans (10 ms CPU, 25 ms wall each), over 100 task steps
    events = []
    for r in range(2):
        events += _engine_steps(r, [9.0, 0.05, 0.05], [7, 100, 100],
                                [(25_000.0, 10_000.0), (25_000.0, 10_000.0)])
    fit = fit_step_overhead(events)
    assert fit["steps"] == 400 and fit["cpu_s"] == pytest.approx(0.2)
    # spans after each rank's first mark: steps 1 and 2 (ts 11 and 21) of both ranks
    assert fit["work_cpu_s"] == pytest.approx(0.08)
    assert fit["step_overhead_s"] == pytest.approx((0.2 - 0.08) / 400)
    refit, report = refit_from_timeline(PROFILE4, events)
    assert refit.step_overhead_s == pytest.approx(0.12 / 400)
    assert report["engine/step"]["profiled_s"] == PROFILE4.step_overhead_s
    # the model charges it per task step: more partitions now cost more compute
    onebit = CODECS["onebit"]
    more = (CostModel(refit, 4).compressed(onebit, 10_000_000, "ps", 64, True).compute_s
            - CostModel(refit, 4).compressed(onebit, 10_000_000, "ps", 8, True).compute_s)
    assert more > (CostModel(PROFILE4, 4).compressed(onebit, 10_000_000, "ps", 64, True)
                   .compute_s - CostModel(PROFILE4, 4).compressed(onebit, 10_000_000, "ps",
                                                                  8, True).compute_s)
    # without engine-cpu events (an older HiPress, or one step per rank) it is kept
    assert fit_step_overhead(_timeline({"encode": 1.0, "decode": 1.0, "merge": 1.0})
                             ["traceEvents"]) is None
    assert fit_step_overhead(_engine_steps(0, [9.0], [7], [(1.0, 1.0)])) is None
    kept, report = refit_from_timeline(PROFILE4, _timeline({"encode": 1.0, "decode": 1.0,
                                                            "merge": 1.0}))
    assert kept.step_overhead_s == PROFILE4.step_overhead_s and "engine/step" not in report
    # the CLI says which
    base, trace, out = tmp_path / "base.json", tmp_path / "trace.json", tmp_path / "out.json"
    PROFILE4.save(base)
    trace.write_text(json.dumps(events))
    assert cli.main(["profile", "--from-timeline", str(trace), "--profile", str(base),
                     "-o", str(out)]) == 0
    assert "engine CPU per task step: 0.300 ms (profiled 0.050 ms)" in capsys.readouterr().out
    assert Profile.load(out).step_overhead_s == pytest.approx(3e-4)


def test_refit_measures_the_engines_share_of_a_core_and_the_model_uses_it(tmp_path, capsys):
    from hipress.engine.planning import Decision
    from hipress.secopa.pipeline import simulate
    from hipress.secopa.profile import fit_cpu_shares, refit_from_timeline

    def ev(name, ts, dur=0.0, pid=0, **args):
        return {"name": name, "ph": "X", "ts": ts, "dur": dur, "pid": pid, "args": args}

    # rank 0 submits step 0 from ts 0 to 100 and step 1 from 1000 to 1100; spans in a
    # backward pass got 10 us of CPU in 40 us, spans after it 30 us in 60 us
    events = [ev("submit", t, step=st, gradient=f"g{t}", numel=10)
              for st, ts in ((0, (0, 50, 100)), (1, (1000, 1100))) for t in ts]
    events += [ev("encode", 60, 40, codec="onebit", numel=1000, cpu_us=10.0),
               ev("merge", 1001, 40, cpu_us=10.0),
               ev("decode", 150, 60, codec="onebit", numel=1000, cpu_us=30.0),
               ev("merge+encode", 1100, 60, codec="onebit", numel=1000, payloads=4,
                  cpu_us=30.0),
               ev("allreduce", 20, 500.0)]  # a wait, not work: not counted
    shares = fit_cpu_shares(events)
    assert shares == {"backward": 0.25, "tail": 0.5, "spans_backward": 2.0,
                      "spans_tail": 2.0}
    assert fit_cpu_shares([ev("encode", 1, 5.0, codec="onebit", numel=4)]) is None
    refit, report = refit_from_timeline(PROFILE4, events)
    assert (refit.cpu_share_backward, refit.cpu_share_tail) == (0.25, 0.5)
    assert report["engine/cpu-share"] == shares
    assert Profile.from_json(refit.to_json()).cpu_share_tail == 0.5  # saved and read back
    # the cost model stretches compute by 1/0.25 (what planning sees: the backward pass)
    onebit, n = CODECS["onebit"], 2_000_000
    shared = PROFILE4.model_copy(update={"cpu_share_backward": 0.25, "cpu_share_tail": 0.5})
    alone, busy = CostModel(PROFILE4, 4), CostModel(shared, 4)
    assert busy.contention == 4.0 and alone.contention == 1.0
    c1 = alone.compressed(onebit, n, "ps", 1, True)
    c4 = busy.compressed(onebit, n, "ps", 1, True)
    assert c4.compute_s == pytest.approx(4 * c1.compute_s)
    assert c4.network_s == pytest.approx(c1.network_s)
    # the simulation: a gradient ready during the backward pass computes at a quarter of
    # a core, one ready at its end (the last arrival) at half a core
    one = {"a": Decision(True, 1, "ps"), "b": Decision(True, 1, "ps")}
    sim = simulate(busy, [("a", n, 0.0), ("b", n, 100.0)], one, onebit, True)
    assert sim.finish_s["a"] == pytest.approx(4 * c1.compute_s + c1.network_s)
    assert sim.finish_s["b"] - 100.0 == pytest.approx(2 * c1.compute_s + c1.network_s)
    with pytest.raises(ProfileError, match="cpu_share_backward"):
        Profile.from_json(PROFILE4.model_copy(update={"cpu_share_backward": 0.0}).to_json())


# ----------------------------------------------------------------------------- pipeline
def test_simulation_of_lone_gradients_is_their_own_cost():
    from hipress.engine.planning import Decision
    from hipress.secopa.pipeline import simulate

    model, onebit = CostModel(PROFILE4, 4), CODECS["onebit"]
    n = 2_000_000
    c = model.compressed(onebit, n, "ps", 1, True)
    # far apart: nothing shares a resource; K = 1 is compute, network, compute in turn
    sim = simulate(model, [("a", n, 0.0), ("b", n, 100.0)],
                   {"a": Decision(True, 1, "ps"), "b": Decision(True, 1, "ps")}, onebit, True)
    assert sim.finish_s["a"] == pytest.approx(c.compute_s + c.network_s)
    assert sim.exposed_s == pytest.approx(c.compute_s + c.network_s)
    assert sim.backward_s == 100.0 and sim.end_s == pytest.approx(100.0 + c.total_s)
    # uncompressed: its marginal time plus the fused buffer's fixed cost, once
    u = model.uncompressed(n)
    sim = simulate(model, [("a", n, 1.0)], {}, None)
    assert sim.exposed_s == pytest.approx(u.network_s + model.fused_fixed())
    assert sim.compute_busy_s == 0.0


def test_simulation_shares_compute_and_link_and_pipelines_partitions():
    from hipress.engine.planning import Decision
    from hipress.secopa.pipeline import simulate

    model, onebit = CostModel(PROFILE4, 4), CODECS["onebit"]
    n = 4_000_000
    c = model.compressed(onebit, n, "ps", 1, True)
    both = {"a": Decision(True, 1, "ps"), "b": Decision(True, 1, "ps")}
    sim = simulate(model, [("a", n, 0.0), ("b", n, 0.0)], both, onebit, True)
    # one partition of N = 4: this rank aggregates it with probability 1/4, so 3/4 of the
    # aggregation is another rank's engine's work (Cost.remote_s): a delay, not a load
    mine, net = c.compute_s - c.remote_s, c.network_s
    assert 0 < c.remote_s < c.compute_s / 2
    # K = N: every rank aggregates one partition; Ring and gather: every rank does the same
    assert model.compressed(onebit, n, "ps", 4, True).remote_s == 0.0
    assert model.compressed(onebit, n, "ring", 1, True).remote_s == 0.0
    assert model.compressed(CODECS["topk"], n, "gather", 1, True).remote_s == 0.0
    half = mine / 2
    # a encodes in [0, h] and sends in [h, h+w], then waits out the remote aggregation;
    # b encodes in [h, 2h]; a's decode starts when both that wait and b's encode are done
    assert sim.finish_s["a"] == pytest.approx(max(2 * half, half + net + c.remote_s) + half)
    assert sim.end_s >= 2 * mine - 1e-12 and sim.end_s >= 2 * net - 1e-12
    assert sim.end_s < 2 * (c.compute_s + net)  # overlap: less than one after the other
    assert sim.compute_busy_s == pytest.approx(2 * mine)
    # the link is held for the payload bytes at the patterns' per-byte slopes; the rest
    # of the network time is the messages' latency, which b's transfer overlaps
    assert 0 < c.link_s < net
    assert sim.network_busy_s == pytest.approx(2 * c.link_s)
    # K partitions of one gradient overlap their compute with their transfers
    k8 = model.compressed(onebit, n, "ps", 8, True)
    sim8 = simulate(model, [("a", n, 0.0)], {"a": Decision(True, 8, "ps")}, onebit, True)
    assert max(k8.compute_s, k8.network_s) - 1e-12 <= sim8.end_s < k8.compute_s + k8.network_s
    with pytest.raises(SeCoPaError, match="no codec"):
        simulate(model, [("a", n, 0.0)], {"a": Decision(True, 1, "ps")}, None)
    with pytest.raises(SeCoPaError, match="ready time"):
        simulate(model, [("a", n, float("nan"))], {}, None)


def test_simulation_overlaps_the_latency_of_many_small_messages():
    from hipress.engine.planning import Decision
    from hipress.secopa.pipeline import simulate
    from hipress.secopa.profile import Fit

    # 50 tiny Ring gradients, all ready at once, on links of 2-3 ms latency: each has N
    # latency-bound messages on its critical path. Their latency overlaps; only their
    # bytes queue on the link
    comm = PROFILE4.comm.model_copy(update={"ring_step": Fit(a=2e-3, b=1e-9, floor=2e-3),
                                            "allgather": Fit(a=3e-3, b=3e-9, floor=3e-3)})
    model = CostModel(PROFILE4.model_copy(update={"comm": comm}), 4)
    onebit, n = CODECS["onebit"], 256
    c = model.compressed(onebit, n, "ring", 1, True)
    assert c.network_s > 5 * c.compute_s  # latency-bound
    assert c.link_s < c.network_s / 1000  # a few hundred bytes: almost all latency
    names = [f"g{i}" for i in range(50)]
    sim = simulate(model, [(g, n, 0.0) for g in names] + [("z", 1, 100.0)],
                   {g: Decision(True, 1, "ring") for g in names}, onebit, True)
    # the link carried the 50 payloads and the fused 1-element buffer of "z"
    assert sim.network_busy_s == pytest.approx(50 * c.link_s + model.uncompressed(1).link_s)
    last = max(sim.finish_s[g] for g in names)
    # the engine's compute queues; the latency of the last one adds once, not 50 times
    assert 50 * c.compute_s - 1e-12 <= last < 50 * c.compute_s + c.network_s + 1e-9
    assert last < 50 * c.network_s / 4
    # the uncompressed fused path: only its bytes hold the link, its fixed cost is latency
    u = model.uncompressed(n)
    assert u.link_s == pytest.approx(PROFILE4.comm_at(4).allreduce.b * 4 * n)
    assert u.network_s > u.link_s


def test_simulation_charges_engine_work_and_the_wire_during_the_backward_pass():
    from hipress.engine.engine import FUSION_HOLD_BYTES
    from hipress.engine.planning import Decision
    from hipress.secopa.pipeline import simulate

    onebit, n = CODECS["onebit"], 2_000_000
    wired = PROFILE4.model_copy(update={"wire_cpu_s_per_byte": 1e-9})
    model = CostModel(wired, 4)
    c = model.compressed(onebit, n, "ps", 1, True)
    # compressed, ready at 0, the backward pass ends at 100 s: all of its compute and
    # its payload's wire CPU fall inside the pass; nothing is exposed
    ch = {"a": Decision(True, 1, "ps")}
    sim = simulate(model, [("a", n, 0.0), ("z", 1, 100.0)], ch, onebit, True)
    # (this rank's share: the average rank runs 1/4 of a one-partition aggregation)
    assert sim.backward_cpu_s == pytest.approx(c.compute_s - c.remote_s
                                               + 1e-9 * model.payload(onebit, n))
    assert sim.delay_s == pytest.approx(sim.exposed_s + sim.backward_cpu_s)
    # ready at the end of the pass: exposed, and nothing taken from the pass
    late = simulate(model, [("a", n, 100.0)], ch, onebit, True)
    assert late.backward_cpu_s == 0.0 and late.delay_s == late.exposed_s > 0
    # uncompressed and big enough to leave at once: only the wire's CPU, per byte
    m = FUSION_HOLD_BYTES // 4 * 8
    unc = simulate(model, [("u", m, 0.0), ("z", 1, 100.0)], {}, onebit)
    assert unc.backward_cpu_s == pytest.approx(1e-9 * 4 * m)
    # ... and after the pass the wire's CPU of the flushed 1-element buffer keeps the
    # compute server busy (share of a core 1 here): 4 bytes' worth
    assert unc.compute_busy_s == pytest.approx(1e-9 * 4)
    # all at once (synchronization alone): a big uncompressed transfer that starts first
    # delays the codec work behind it by its wire CPU
    both = [("u", m, 0.0), ("a", n, 0.0)]
    alone = simulate(model, [("a", n, 0.0)], ch, onebit, True)
    shared = simulate(model, both, ch, onebit, True)
    assert shared.compute_busy_s == pytest.approx(alone.compute_busy_s + 1e-9 * 4 * m)
    assert shared.finish_s["a"] >= alone.finish_s["a"] + 1e-9 * 4 * m - 1e-12
    # without a wire cost (a profile of an older version) the transfer takes no CPU
    assert simulate(CostModel(PROFILE4, 4), [("u", m, 0.0), ("z", 1, 100.0)], {},
                    onebit).backward_cpu_s == 0.0


def test_simulation_prices_powersgd_on_the_engines_path_and_the_gradients_shape():
    from hipress.engine.planning import Decision
    from hipress.secopa.pipeline import simulate

    psgd, model = get_codec("powersgd", rank=1), CostModel(PROFILE4, 4)
    shape = (1024, 2048)
    n = shape[0] * shape[1]
    arr = [("w", n, 0.0), ("z", 1, 5.0)]
    real = model.compressed(psgd, n, "allreduce", 1, True, shape)
    flat = model.compressed(psgd, n, "allreduce", 1, True)
    # the payload of the matrix view is (m + n) * rank floats (and a small header); flat,
    # the whole gradient
    assert 4 * (1024 + 2048) <= model.payload_shaped(psgd, shape) < 4 * (1024 + 2048) + 64
    assert real.network_s < flat.network_s / 10
    sim = simulate(model, arr, {"w": Decision(True, 1, "allreduce")}, psgd, True,
                   shapes={"w": shape})
    assert sim.finish_s["w"] == pytest.approx(real.compute_s + real.network_s)
    # PowerSGD cannot run under PS: asked for ps with 3 partitions (what the engine's
    # fixed policy says under sync.strategy ps), it is simulated as the engine runs it
    asked = simulate(model, arr, {"w": Decision(True, 3, "ps")}, psgd, True,
                     shapes={"w": shape})
    assert asked.finish_s == sim.finish_s
    # without the shape it is priced flat, as an allreduce of the whole gradient
    unshaped = simulate(model, arr, {"w": Decision(True, 1, "allreduce")}, psgd, True)
    assert unshaped.finish_s["w"] == pytest.approx(flat.compute_s + flat.network_s)


def test_simulation_bulks_small_ps_gradients_of_one_round():
    from hipress.engine.engine import BULK_MAX_BYTES
    from hipress.engine.planning import Decision
    from hipress.secopa.pipeline import simulate

    onebit, small = CODECS["onebit"], 1000
    model = CostModel(PROFILE4.model_copy(update={"round_s": 0.01}), 4)
    ps1 = Decision(True, 1, "ps")
    sim = simulate(model, [("a", small, 0.0), ("b", small, 0.005), ("c", small, 0.5)],
                   {"a": ps1, "b": ps1, "c": ps1}, onebit, True)
    both = model.compressed(onebit, 2 * small, "ps", 1, True)
    one = model.compressed(onebit, small, "ps", 1, True)
    # a and b arrive in one round: one bulk task of their elements, started a round
    # after the later of them; c alone, the last to arrive, at once: the rank waits for
    # its results then, and a waiting rank's round goes without waiting out round_s
    assert sim.finish_s["a"] == sim.finish_s["b"] == pytest.approx(
        0.015 + both.compute_s + both.network_s)
    assert sim.finish_s["c"] == pytest.approx(0.5 + one.compute_s + one.network_s)
    assert sim.compute_busy_s == pytest.approx(both.compute_s - both.remote_s
                                               + one.compute_s - one.remote_s)
    # Ring, two partitions, or more than BULK_MAX_BYTES: one task each, as in the engine
    big = BULK_MAX_BYTES // 4 + 1
    for ch, n in ((Decision(True, 1, "ring"), small), (Decision(True, 2, "ps"), small),
                  (ps1, big)):
        sim = simulate(model, [("a", n, 0.0), ("b", n, 0.0), ("z", 1, 9.0)],
                       {"a": ch, "b": ch}, onebit, True)
        c = model.compressed(onebit, n, ch.strategy, ch.partitions, True)
        assert sim.compute_busy_s == pytest.approx(2 * (c.compute_s - c.remote_s))


def test_plan_with_arrivals_minimizes_the_simulated_delay():
    onebit = CODECS["onebit"]
    big = 16_000_000
    grads = [("early", (big,)), ("small", (1000,)), ("one", (1,))]
    # "early" arrives at the start of a 10 s backward pass, with plenty of time to cross
    # the idle link uncompressed; "small" arrives at its end; "one" does not shrink (a
    # 56-byte payload for 4 bytes) and is never compressed, whatever policy wins
    arrivals = [("early", big, 0.0), ("small", 1000, 10.0), ("one", 1, 10.0)]
    free_wire = plan(PROFILE4, grads, onebit, "ps", 4, arrivals=arrivals)
    assert not free_wire.entry("early").compress  # encoding would only take CPU
    d = free_wire.predicted_delay_ms
    assert set(d) == {"plan", "compress_everything", "threshold", "compress_nothing"}
    assert d["plan"] <= min(d.values()) + 1e-9
    assert d["plan"] < d["compress_everything"]
    # -v says why: alone it would be faster compressed, and no plan beats sending nothing
    # compressed (that policy is the plan: Plan.basis)
    from hipress.secopa.planner import option_table
    assert free_wire.basis == "compress_nothing"
    row = next(line for line in option_table(free_wire, PROFILE4, grads, onebit).splitlines()
               if line.startswith("early"))
    assert " fused " in row and "compress-nothing policy" in row, row
    # the wire's CPU makes 64 MB uncompressed cost more than encoding it
    costly = PROFILE4.model_copy(update={"wire_cpu_s_per_byte": 2e-8})
    wired = plan(costly, grads, onebit, "ps", 4, arrivals=arrivals)
    assert wired.entry("early").compress
    assert not wired.entry("one").compress and not free_wire.entry("one").compress
    d = wired.predicted_delay_ms
    # no search beats compressing everything by 3 %: the plan is that policy, less rule 2
    # ("one" uncompressed: its fused buffer's fixed cost holds the link when "small"'s
    # payload is ready, 0.2 ms dearer than its 56-byte payload)
    assert wired.basis == "compress_everything"
    assert d["compress_everything"] <= d["plan"] < 1.003 * d["compress_everything"]
    assert d["plan"] < d["threshold"] < d["compress_nothing"]
    # without arrival times: the per-gradient model, no delays
    assert plan(PROFILE4, grads, onebit, "ps", 4).predicted_delay_ms == {}


def test_plan_leaves_a_fixed_policy_only_for_a_clear_predicted_gain(tmp_path, capsys):
    from hipress.secopa.planner import DEFAULT_MIN_GAIN, option_table

    onebit, big = CODECS["onebit"], 16_000_000
    # small gain: the search's partitions save 3 ms of a 10.16 s iteration (0.03 %)
    costly = PROFILE4.model_copy(update={"wire_cpu_s_per_byte": 2e-8})
    grads = [("early", (big,)), ("late", (big,)), ("one", (1,))]
    arrivals = [("early", big, 0.0), ("late", big, 10.0), ("one", 1, 10.0)]
    searched = plan(costly, grads, onebit, "ps", 4, arrivals=arrivals, min_gain=0.0)
    kept = plan(costly, grads, onebit, "ps", 4, arrivals=arrivals)
    assert DEFAULT_MIN_GAIN == 0.03 and kept.min_gain == 0.03
    assert searched.basis == "search" and kept.basis == "compress_everything"
    d_searched, d_kept = searched.predicted_delay_ms["plan"], kept.predicted_delay_ms["plan"]
    assert d_kept - 5.0 < d_searched < d_kept  # ms: faster, but by far less than 3 %
    assert [(g.compress, g.partitions) for g in searched.gradients] == [(True, 4), (True, 4),
                                                                      (False, 1)]
    row = next(x for x in option_table(searched, costly, grads, onebit).splitlines()
               if x.startswith("late"))
    assert "least delay" in row, row  # alone another K is faster
    # the plan is then compress-everything's choices, "one" kept uncompressed (rule 2)
    assert [(g.compress, g.partitions) for g in kept.gradients] == [(True, 8), (True, 8),
                                                                  (False, 1)]
    assert Plan.from_json(kept.to_json()).basis == "compress_everything"  # saved and read
    row = next(x for x in option_table(kept, costly, grads, onebit).splitlines()
               if x.startswith("late"))
    assert row.endswith("ps/8        fastest"), row  # alone, too, K = 8 is its fastest
    # a clear gain: eight 16 MB gradients at once on 4 GB/s links; sending half of them
    # uncompressed while the others encode beats every fixed policy by 8 %
    fast = make_profile(4, link_gbs=4.0)
    grads = [(f"g{i}", (4_000_000,)) for i in range(8)]
    p = plan(fast, grads, onebit, "ps", 4, arrivals=[(n, 4_000_000, 0.0) for n, _ in grads])
    d = p.predicted_delay_ms
    assert p.basis == "search" and sum(g.compress for g in p.gradients) == 4
    assert d["plan"] < 0.97 * min(d["compress_everything"], d["threshold"],
                                  d["compress_nothing"])
    # without arrival times the sum model's plan is its exact minimum, always "search"
    assert plan(fast, grads, onebit, "ps", 4).basis == "search"
    with pytest.raises(SeCoPaError, match=r"min_gain is a fraction of the iteration in \[0, 1\)"):
        plan(fast, grads, onebit, "ps", 4, arrivals=[], min_gain=1.0)
    # the CLI passes --min-gain and prints the basis
    prof_path, trace = tmp_path / "p.json", tmp_path / "t.json"
    costly.save(prof_path)
    events = [{"name": "submit", "ph": "X", "pid": 0, "ts": ts, "dur": 0,
               "args": {"gradient": f"classifier.{i}.weight", "numel": n, "step": 0}}
              for i, n, ts in ((0, 25088 * 4096, 0.0), (3, 4096 * 4096, 1e7))]
    trace.write_text(json.dumps({"traceEvents": events}))
    base = ["plan", "--profile", str(prof_path), "--gradients", "vgg19", "--codec", "onebit",
            "--timeline", str(trace), "--skip-steps", "0"]
    assert cli.main(base) == 0
    out = capsys.readouterr().out
    assert "no searched plan was predicted at least 3% of the iteration faster" in out, out
    assert cli.main(base + ["--min-gain", "2"]) == 1
    assert "min_gain is a fraction" in capsys.readouterr().err


def test_arrivals_from_timeline_and_plan_with_exposed_times(tmp_path, capsys):
    from hipress.secopa.pipeline import arrivals_from_timeline

    grads = load_gradients("resnet50")
    events = []
    for step in range(4):
        t0 = step * 1e6
        for i, (name, shape) in enumerate(reversed(grads)):  # the last layer first
            events.append({"name": "submit", "ph": "X", "pid": 0, "ts": t0 + 1000 * i,
                           "dur": 0, "args": {"gradient": name, "numel": math.prod(shape),
                                              "step": step}})
            events.append({"name": "done", "ph": "X", "pid": 0,
                           "ts": t0 + 1000 * i + 5000 + 1000 * step, "dur": 0,
                           "args": {"gradient": name, "step": step}})
        events.append({"name": "submit", "ph": "X", "pid": 1, "ts": t0, "dur": 0,
                       "args": {"gradient": "x", "numel": 1, "step": step}})
    steps, measured = arrivals_from_timeline({"traceEvents": events}, rank=0)
    assert len(steps) == 4 and len(steps[0]) == len(grads)
    assert steps[1][0] == (grads[-1][0], math.prod(grads[-1][1]), 0.0)
    assert measured[2]["backward_s"] == pytest.approx((len(grads) - 1) * 1e-3)
    assert measured[2]["exposed_s"] == pytest.approx(5e-3 + 2e-3)
    with pytest.raises(SeCoPaError, match="no submit events of rank 3"):
        arrivals_from_timeline({"traceEvents": events}, rank=3)
    with pytest.raises(SeCoPaError, match="no submit events of any rank for a gradient"):
        arrivals_from_timeline({"traceEvents": [e for e in events if e["name"] == "done"]})
    # every rank (the default): a gradient arrives when its last rank submits it
    late = [dict(e, pid=1, ts=e["ts"] + 3000) for e in events
            if e["pid"] == 0 and e["name"] == "submit" and e["args"]["step"] == 2]
    both, m_both = arrivals_from_timeline({"traceEvents": events + late})
    assert len(both[2]) == len(grads) + 1  # rank 1's "x" too
    assert m_both[2]["backward_s"] == pytest.approx(measured[2]["backward_s"] + 3e-3)
    assert m_both[2]["exposed_s"] == pytest.approx(measured[2]["exposed_s"] - 3e-3)
    p = plan(PROFILE4, grads, CODECS["onebit"], "ps", 4, arrivals=steps[2])
    ex = p.predicted_exposed_ms
    assert set(ex) == {"plan", "compress_everything", "threshold", "compress_nothing"}
    assert all(v >= 0 for v in ex.values())
    # arriving over 160 ms, much of the sync hides behind the backward pass
    assert ex["compress_nothing"] < p.predicted_ms["compress_nothing"]
    trace, prof_path = tmp_path / "trace.json", tmp_path / "p.json"
    trace.write_text(json.dumps({"traceEvents": events}))
    PROFILE4.save(prof_path)
    assert cli.main(["plan", "--profile", str(prof_path), "--gradients", "resnet50",
                     "--strategy", "ps", "--world-size", "4", "--codec", "onebit",
                     "--timeline", str(trace)]) == 0
    out = capsys.readouterr().out
    assert "exposed ms/iter" in out and f"{ex['plan']:.2f}" in out
    assert "exposed 7.00 ms" in out  # steps 2 and 3 after 2 warm-up steps: the lower median


# ----------------------------------------------------------------------------- CLI
def test_cli_plan_vgg19_writes_a_plan_and_prints_totals(tmp_path, capsys):
    prof_path = tmp_path / "profile.json"
    PROFILE4.save(prof_path)
    out = tmp_path / "plan.json"
    rc = cli.main(["plan", "--profile", str(prof_path), "--gradients", "vgg19", "--strategy",
                   "ring", "--world-size", "8", "--codec", "onebit", "-o", str(out)])
    assert rc == 0
    captured = capsys.readouterr()
    text = captured.out
    assert "under load" not in captured.err  # a quiet profile: no note
    p = Plan.load(out)
    assert len(p.gradients) == 38 and p.world_size == 8 and p.strategy == "ring"
    for key, label in (("plan", "plan "), ("compress_everything", "compress-everything"),
                       ("compress_nothing", "compress-nothing"), ("threshold", "threshold")):
        assert label in text
        assert f"{p.predicted_ms[key]:.2f}" in text
    assert p.predicted_ms["plan"] < p.predicted_ms["compress_nothing"]
    big = p.entry("classifier.0.weight")
    assert big.compress and big.strategy == "ring"
    # errors: one line, exit status 1
    rc = cli.main(["plan", "--profile", str(tmp_path / "missing.json"), "--gradients",
                   "vgg19", "--codec", "onebit"])
    assert rc == 1 and "cannot read SeCoPa profile" in capsys.readouterr().err
    rc = cli.main(["plan", "--profile", str(prof_path), "--gradients", "nosuchnet",
                   "--codec", "onebit"])
    assert rc == 1 and "vgg19" in capsys.readouterr().err
    # a profile taken under load still plans, with a note that names the hosts' shares
    PROFILE4.model_copy(update={"loaded": True, "host_load": {"h1": 0.41, "h2": 0.12}}).save(
        prof_path)
    rc = cli.main(["plan", "--profile", str(prof_path), "--gradients", "vgg19", "--codec",
                   "onebit"])
    err = capsys.readouterr().err
    assert rc == 0 and "was taken under load" in err and "h1 0.41, h2 0.12" in err


def test_cli_plan_verbose_prints_each_options_time_and_the_reason(tmp_path, capsys):
    prof_path = tmp_path / "profile.json"
    PROFILE4.save(prof_path)
    rc = cli.main(["plan", "--profile", str(prof_path), "--gradients", "vgg19", "--strategy",
                   "auto", "--world-size", "4", "--codec", "onebit", "-v"])
    assert rc == 0
    lines = capsys.readouterr().out.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("gradient "))
    assert lines[head].split()[:9] == ["gradient", "numel", "fused", "ms", "ps", "ms", "K",
                                       "ring", "ms"]
    rows = {line.split()[0]: line.split() for line in lines[head + 1:head + 39]}
    assert len(rows) == 38
    model = CostModel(PROFILE4, 4)
    p = plan(PROFILE4, load_gradients("vgg19"), CODECS["onebit"], "auto", 4)
    whys = set()
    for g in p.gradients:
        row = rows[g.name]
        assert int(row[1]) == g.numel
        assert float(row[2]) == pytest.approx(model.uncompressed(g.numel).total_s * 1e3,
                                              abs=1e-3)
        choice = f"{g.strategy}/{g.partitions}" if g.compress else "fused"
        assert row[7] == choice, (g.name, row)
        why = " ".join(row[8:])
        whys.add(why.split(" (")[0])
        times = [float(row[2])] + [float(row[i]) for i in (3, 5) if row[i] != "-"]
        if g.compress:  # the chosen path's column holds the chosen time and K
            col = {"ps": 3, "ring": 5}[g.strategy]
            assert float(row[col]) == pytest.approx(g.predicted_ms, abs=1e-3)
            assert int(row[col + 1]) == g.partitions
        if why == "fastest":
            assert g.predicted_ms == pytest.approx(min(times), abs=1e-3)
        else:
            assert why == "not shrinkable" or why.startswith("no fused buffer"), why
    assert "fastest" in whys
    assert rows["classifier.0.weight"][7] != "fused"


# ----------------------------------------------------------------------------- runtime
WORLD1 = types.SimpleNamespace(rank=0, size=1, mpi=None)


def test_plan_follower_file_and_fixed_policy(tmp_path, caplog):
    grads = [("big", (4_000_000,)), ("small", (10,))]
    p = plan(PROFILE4, grads, CODECS["onebit"], "ps", 4)
    path = tmp_path / "plan.json"
    p.save(path)
    cfg = config_from_dict({"sync": {"plan": str(path)}})
    f = PlanFollower(cfg, WORLD1)
    f.setup()
    assert f.active and f.mode == "file"
    big = np.zeros(4_000_000, np.float32)
    e = p.entry("big")
    assert e.compress
    assert f.decide("big", big, CODECS["onebit"], None) == (True, e.partitions, "ps")
    assert f.decide("small", np.zeros(10, np.float32), CODECS["onebit"], "auto") == (
        False, 1, "auto")
    # not in the plan: the fixed policy (min_compress_bytes 64 KiB, 4 MiB partitions)
    assert f.decide("other", np.zeros(3_000_000, np.float32), CODECS["onebit"], None) == (
        True, 3, "auto")
    assert f.decide("other2", np.zeros(100, np.float32), CODECS["onebit"], None)[0] is False
    assert f.decide("big", big, None, None) == (False, 1, "auto")
    # three missing names are warned of one by one, then once for all the rest
    caplog.clear()
    with caplog.at_level("WARNING", logger="hipress.secopa.runtime"):
        for i in range(6):
            f.decide(f"more{i}", np.zeros(100, np.float32), CODECS["onebit"], None)
    said = [r.getMessage() for r in caplog.records]
    assert sum("is not in SeCoPa plan" in m for m in said) == 1  # other, other2 were before
    assert len([m for m in said if "more gradients" in m]) == 1 and len(said) == 2
    assert "another model" in said[-1] and "'more1'" in said[-1]
    # sync.plan: none follows the fixed policy too
    g = PlanFollower(config_from_dict({"sync": {"partitions": 2}}), WORLD1)
    g.setup()
    assert not g.active
    assert g.decide("x", big, CODECS["onebit"], "ring") == (True, 2, "ring")
    # a broken plan file fails at setup, naming the field
    bad = json.loads(p.to_json())
    bad["gradients"][0]["numel"] = -5
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    h = PlanFollower(config_from_dict({"sync": {"plan": str(tmp_path / "bad.json")}}), WORLD1)
    with pytest.raises(PlanError, match="gradients.0.numel"):
        h.setup()


def test_plan_follower_auto_profiles_the_configured_codec(monkeypatch):
    from hipress.secopa import runtime

    monkeypatch.setattr(runtime, "AUTO_PROFILE_S", 0.3)
    calls = {}
    real = runtime.run_profile

    def fake_run_profile(comm, codecs, time_budget_s, blas_threads):
        calls["codecs"] = [c.name for c in codecs]
        calls["budget"] = time_budget_s
        calls["blas_threads"] = blas_threads  # the engine's sync.blas_threads (default 1)
        return real(comm, codecs, sizes=[256, 4096], time_budget_s=time_budget_s,
                    blas_threads=blas_threads)

    monkeypatch.setattr(runtime, "run_profile", fake_run_profile)
    from mpi4py import MPI

    world = types.SimpleNamespace(rank=0, size=1, mpi=MPI)
    cfg = config_from_dict({"compression": {"algorithm": "fp16", "rules": [
        {"pattern": "*.bias", "algorithm": "none"}]}, "sync": {"plan": "auto"}})
    f = PlanFollower(cfg, world)
    f.setup()
    assert calls == {"codecs": ["fp16"], "budget": 0.3, "blas_threads": 1}
    assert f.profile is not None and "fp16" in f.profile.codecs
    # world size 1: compressing never pays
    assert f.decide("w", np.zeros(10**6, np.float32), get_codec("fp16"), None) == (
        False, 1, "auto")
    # a codec that was not profiled falls back to the fixed policy
    assert f.decide("w2", np.zeros(10**6, np.float32), get_codec("onebit"), "ps") == (
        True, 1, "ps")


def test_comm_sizes_measure_the_anchor_second_so_a_short_profile_sees_the_bandwidth():
    from hipress.secopa.profile import COMM_ANCHOR_BYTES, DEFAULT_COMM_SIZES, comm_order

    got = comm_order(DEFAULT_COMM_SIZES)
    assert got[:3] == [64, COMM_ANCHOR_BYTES, 256] and sorted(got) == list(DEFAULT_COMM_SIZES)
    assert comm_order([64, 1024, 1 << 30]) == [64, 1024, 1 << 30]  # 1 KiB: the largest <= 4 MiB
    assert comm_order([1 << 23, 1 << 24, 1 << 25]) == [1 << 23, 1 << 24, 1 << 25]  # none <= 4 MiB
    assert comm_order([64, 1 << 20]) == [64, 1 << 20]


def test_step_vectors_read_one_ranks_steps_relative_to_its_first_submission():
    from hipress.secopa.pipeline import step_vectors

    def ev(kind, name, ts_ms, step):
        return {"name": kind, "ph": "X", "pid": 0, "ts": ts_ms * 1e3, "dur": 0,
                "args": {"gradient": name, "step": step}}

    events = [ev("submit", "fc", 1000.0, 1), ev("submit", "conv", 1004.0, 1),
              ev("done", "fc", 1006.0, 1), ev("done", "conv", 1009.5, 1),
              ev("submit", "other", 900.0, 1),  # not asked for: neither origin nor end
              ev("done", "other", 1100.0, 1),
              ev("submit", "fc", 2000.0, 2), ev("done", "fc", 2003.0, 2),  # conv missing
              ev("submit", "fc", 3000.0, 3),  # a step not asked for
              {"name": "encode", "ph": "X", "ts": 1.0, "args": {"gradient": "fc", "step": 1}}]
    got = step_vectors(events, ["conv", "fc"], [1, 2, 5])
    assert got.shape == (3, 3) and got.dtype == np.float64
    np.testing.assert_allclose(got[0], [4e-3, 0.0, 9.5e-3], atol=1e-9)
    np.testing.assert_allclose(got[1], [-1.0, 0.0, 3e-3], atol=1e-9)
    assert (got[2] == -1.0).all()  # no submission in step 5


class _FakeEngine:
    """What PlanFollower.step_done uses of the engine, at world size 1 of a 2-rank plan."""

    def __init__(self):
        from hipress.timeline import Timeline

        self.timeline = Timeline(False)
        self.step_count = 0
        self.sent = []

    def submit(self, array, name, op="average"):
        self.sent.append((name, op, array.shape))
        return types.SimpleNamespace(wait=lambda: array.copy())

    def broadcast(self, array, root, name):
        self.sent.append((name, root, array.shape))
        return types.SimpleNamespace(wait=lambda: array.copy())


def _observing_follower(observe_steps, **sync):
    cfg = config_from_dict({"compression": {"algorithm": "onebit"},
                            "sync": {"plan": "auto", "plan_observe_steps": observe_steps,
                                     **sync}})
    f = PlanFollower(cfg, types.SimpleNamespace(rank=0, size=2, mpi=None))
    prof = make_profile(2)
    f.profile, f._main_codec, f._ready = prof, get_codec("onebit"), True
    f._main_key = codec_key(f._main_codec.name, f._main_codec.params())
    f._model = CostModel(prof, 2)
    return f


def test_plan_follower_auto_plans_the_observed_steps_and_follows_the_plan(caplog):
    f = _observing_follower(2)
    eng = _FakeEngine()
    onebit = get_codec("onebit")
    shapes = {"fc": (1024, 1024), "conv": (64, 64, 3, 3), "bias": (64,)}
    arrays = {n: np.zeros(s, np.float32) for n, s in shapes.items()}
    for step in range(3):  # step 0 left out, steps 1 and 2 observed
        for i, (n, a) in enumerate(arrays.items()):
            # the fixed policy meanwhile: >= 64 KiB compressed, 4 MiB partitions
            assert f.decide(n, a, onebit, None) == ((True, 1, "auto") if a.nbytes >= 65536
                                                    else (False, 1, "auto"))
            t = eng.timeline.now_us() + 2000 * i
            eng.timeline.add("submit", t, 0, gradient=n, numel=a.size, step=step)
            eng.timeline.add("done", t + 30000, 0, gradient=n, step=step)
        eng.step_count = step + 1
        with caplog.at_level("INFO", logger="hipress.secopa.runtime"):
            f.step_done(eng)
        assert eng.timeline.enabled == (step < 2), step
    assert f.observed and f.plan is not None
    assert eng.sent == [("__secopa.arrivals", "max", (2 * 4,)),
                        ("__secopa.plan", 0, eng.sent[1][2])]
    assert eng.timeline.events() == []  # the in-memory recording is dropped
    assert {g.name for g in f.plan.gradients} == set(shapes) and f.plan.predicted_delay_ms
    said = [r.getMessage() for r in caplog.records if "SeCoPa planned" in r.getMessage()]
    assert len(said) == 1 and "observed steps 1-2" in said[0] and "not refitted" in said[0]
    for n, a in arrays.items():  # the plan decides now
        e = f.plan.entry(n)
        want = (True, e.partitions, e.strategy) if e.compress else (False, 1, "auto")
        assert f.decide(n, a, onebit, None) == want, n
    # a gradient the plan does not name: the per-gradient model, not the fixed policy
    assert f.decide("new", np.zeros(16, np.float32), onebit, None) == (False, 1, "auto")
    eng.step_count = 10
    f.step_done(eng)  # plans once
    assert len(eng.sent) == 2


_VERIFY_SHAPES = {"fc": (1024, 1024), "conv": (64, 64, 3, 3), "bias": (64,)}


def _run_timed_steps(f, eng, monkeypatch, durations):
    """Drive f.step_done once per step of ``durations`` (seconds, on a fake clock), each
    step submitting _VERIFY_SHAPES' gradients into the timeline as a backward pass would."""
    from hipress.secopa import runtime

    if not hasattr(eng, "now"):
        eng.now = 0.0
        monkeypatch.setattr(runtime, "_clock", lambda: eng.now)
    onebit = get_codec("onebit")
    arrays = {n: np.zeros(s, np.float32) for n, s in _VERIFY_SHAPES.items()}
    for step, took in enumerate(durations, start=eng.step_count):
        eng.now += took
        for i, (n, a) in enumerate(arrays.items()):
            f.decide(n, a, onebit, None)
            t = eng.timeline.now_us() + 2000 * i
            eng.timeline.add("submit", t, 0, gradient=n, numel=a.size, step=step)
            eng.timeline.add("done", t + 30000, 0, gradient=n, step=step)
        eng.step_count = step + 1
        f.step_done(eng)


def _searched_plan(monkeypatch, basis="search"):
    """Make the run-time planner's plans say ``basis`` (the fake profile's may not)."""
    from hipress.secopa import runtime

    real = runtime.plan

    def planned(*a, **kw):
        return real(*a, **kw).model_copy(update={"basis": basis})

    monkeypatch.setattr(runtime, "plan", planned)


@pytest.mark.parametrize("plan_step, kept", [(1.25, False), (1.02, True), (0.8, True)])
def test_plan_follower_auto_times_its_plan_and_drops_one_slower_than_the_fixed_policy(
        monkeypatch, tmp_path, caplog, plan_step, kept):
    save = tmp_path / "plan.json"
    f = _observing_follower(2, plan_save=str(save))
    eng = _FakeEngine()
    _searched_plan(monkeypatch)
    # step 0 left out; steps 1-2 observed (1.0 s and 1.1 s: median 1.05); planned at the
    # end of step 2; step 3 settles the plan; steps 4-6 timed under it (median plan_step)
    steps = [0.5, 1.0, 1.1, 3.0, plan_step, plan_step * 0.9, plan_step * 1.1]
    with caplog.at_level("INFO", logger="hipress.secopa.runtime"):
        _run_timed_steps(f, eng, monkeypatch, steps[:3])
        assert f.plan is not None and f.verified is None
        assert not save.exists()  # written once kept
        planned = f.plan
        _run_timed_steps(f, eng, monkeypatch, steps[3:])
    assert [s[0] for s in eng.sent] == ["__secopa.arrivals", "__secopa.plan", "__secopa.verify"]
    assert eng.sent[-1][1:] == ("max", (5,))  # 2 observed steps, 3 timed
    assert f.verified == pytest.approx({"fixed_step_s": 1.05, "plan_step_s": plan_step,
                                        "steps": 3.0, "kept": float(kept)})
    said = [r.getMessage() for r in caplog.records
            if r.getMessage().startswith(("SeCoPa kept", "SeCoPa dropped"))]
    assert len(said) == 1, said
    timing = [r.getMessage() for r in caplog.records
              if r.getMessage().startswith("SeCoPa follows its plan")]
    assert timing == [f"SeCoPa follows its plan from step 3 and times steps 4-6 against the "
                      f"observed fixed-policy steps before keeping it (sync.plan_verify_steps)"
                      f"; {save} is written once it is kept"], timing
    assert f"steps 4-6 under it took {plan_step:.3f} s" in said[0], said[0]
    assert f"{plan_step / 1.05:.2f}x" in said[0], said[0]
    onebit = get_codec("onebit")
    arrays = {n: np.zeros(s, np.float32) for n, s in _VERIFY_SHAPES.items()}
    if kept:
        assert f.plan is planned and not f.reverted
        assert save.read_text().strip() == planned.to_json().strip()
        for n, a in arrays.items():
            e = planned.entry(n)
            want = (True, e.partitions, e.strategy) if e.compress else (False, 1, "auto")
            assert f.decide(n, a, onebit, None) == want, n
    else:
        assert f.plan is None and f.reverted and not save.exists()
        assert "SeCoPa dropped its plan" in said[0] and "not written" in said[0], said[0]
        for n, a in arrays.items():  # the fixed policy: >= 64 KiB compressed, 4 MiB parts
            assert f.decide(n, a, onebit, None) == ((True, 1, "auto") if a.nbytes >= 65536
                                                    else (False, 1, "auto")), n
    _run_timed_steps(f, eng, monkeypatch, [1.0, 1.0])  # checked once
    assert len(eng.sent) == 3


def test_plan_follower_auto_check_with_a_clock_that_did_not_move_keeps_the_plan(
        monkeypatch, caplog):
    f = _observing_follower(2)
    eng = _FakeEngine()
    _searched_plan(monkeypatch)
    with caplog.at_level("INFO", logger="hipress.secopa.runtime"):
        _run_timed_steps(f, eng, monkeypatch, [0.0] * 7)  # a coarse clock: every step 0 s
    assert f.plan is not None and not f.reverted
    assert f.verified == {"fixed_step_s": 0.0, "plan_step_s": 0.0, "steps": 3.0, "kept": 1.0}
    assert any("(1.00x)" in r.getMessage() for r in caplog.records), caplog.text


@pytest.mark.parametrize("basis, verify", [("threshold", 3), ("search", 0)])
def test_plan_follower_auto_does_not_time_the_fixed_policy_or_when_told_not_to(
        monkeypatch, tmp_path, basis, verify):
    save = tmp_path / "plan.json"
    f = _observing_follower(2, plan_save=str(save), plan_verify_steps=verify)
    eng = _FakeEngine()
    _searched_plan(monkeypatch, basis)
    _run_timed_steps(f, eng, monkeypatch, [0.5, 1.0, 1.0])
    assert f.plan is not None and f.plan.basis == basis
    assert save.read_text().strip() == f.plan.to_json().strip()  # written at once
    _run_timed_steps(f, eng, monkeypatch, [5.0] * 6)  # far slower: not timed, kept
    assert f.plan is not None and f.verified is None and not f.reverted
    assert [s[0] for s in eng.sent] == ["__secopa.arrivals", "__secopa.plan"]


def test_plan_follower_auto_says_why_it_cannot_plan_and_decides_each_gradient(caplog):
    f = _observing_follower(1)
    eng = _FakeEngine()
    for count in (1, 2):  # nothing of the codec was submitted in the observed step
        eng.step_count = count
        with caplog.at_level("WARNING", logger="hipress.secopa.runtime"):
            f.step_done(eng)
    assert f.observed and f.plan is None and not eng.timeline.enabled
    said = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(said) == 1, said
    assert "no gradient of codec 'onebit' was submitted in steps 1-1" in said[0]
    assert "deciding each gradient from the profile" in said[0]
    big = np.zeros((1024, 1024), np.float32)
    onebit = get_codec("onebit")
    got = f.decide("fc", big, onebit, None)  # the per-gradient model's answer, cached
    assert got == f._cache[("fc", (1024, 1024), codec_key(onebit.name, onebit.params()), "auto")]


def test_cli_plan_verbose_with_a_timeline_prints_each_options_change_of_delay(tmp_path,
                                                                              capsys):
    from hipress.engine.planning import Decision
    from hipress.secopa.pipeline import UNCOMPRESSED, simulate

    grads = load_gradients("resnet50")
    events = []
    for step in range(3):
        for i, (name, shape) in enumerate(reversed(grads)):  # the last layer first, 1 ms apart
            events.append({"name": "submit", "ph": "X", "pid": 0, "ts": step * 1e6 + 1000 * i,
                           "dur": 0, "args": {"gradient": name, "numel": math.prod(shape),
                                              "step": step}})
    trace, prof_path = tmp_path / "trace.json", tmp_path / "p.json"
    trace.write_text(json.dumps({"traceEvents": events}))
    PROFILE4.save(prof_path)
    rc = cli.main(["plan", "--profile", str(prof_path), "--gradients", "resnet50",
                   "--strategy", "ps", "--world-size", "4", "--codec", "onebit", "--timeline",
                   str(trace), "--skip-steps", "1", "--min-gain", "0", "-v"])
    assert rc == 0
    lines = capsys.readouterr().out.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("gradient "))
    assert lines[head].split()[:10] == ["gradient", "numel", "fused", "ms", "ps", "ms", "K",
                                        "fused", "+ms", "ps"]
    rows = {line.split()[0]: line.split() for line in lines[head + 1:head + 1 + len(grads)]}
    assert len(rows) == len(grads)
    # the same plan, and each +ms recomputed with the simulation itself
    arrivals = [(n, math.prod(s), 1e-3 * i) for i, (n, s) in enumerate(reversed(grads))]
    p = plan(PROFILE4, grads, CODECS["onebit"], "ps", 4, arrivals=arrivals, min_gain=0.0)
    model = CostModel(PROFILE4, 4)
    base = {g.name: Decision(True, g.partitions, g.strategy) if g.compress else UNCOMPRESSED
            for g in p.gradients}

    def delay(choices):
        return simulate(model, arrivals, choices, CODECS["onebit"], p.feedback,
                        shapes=dict(grads)).delay_s * 1e3

    plan_ms = delay(base)
    assert plan_ms == pytest.approx(p.predicted_delay_ms["plan"], rel=1e-9)
    checked = 0
    for g in p.gradients:
        # name, numel, fused ms, ps ms, K, fused +ms, ps +ms, choice, why...
        row = rows[g.name]
        assert row[7] == (f"ps/{g.partitions}" if g.compress else "fused"), row
        fused_cell, ps_cell = row[5], row[6]
        if not g.compress:
            assert float(fused_cell) == 0.0
        elif int(row[4]) == g.partitions:  # the plan took the path's best K
            assert float(ps_cell) == 0.0
        if g.numel >= 1 << 20 and checked < 3:  # a few large ones, simulated here
            other = UNCOMPRESSED if g.compress else Decision(True, int(row[4]), "ps")
            cell = fused_cell if g.compress else ps_cell
            want = delay(dict(base, **{g.name: other})) - plan_ms
            assert float(cell) == pytest.approx(want, abs=2e-3), (g.name, row)
            assert want != 0.0
            checked += 1
    assert checked == 3
