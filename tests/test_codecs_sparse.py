"""Sparsification codecs (topk, randomk, dgc, graddrop) and the DGC memory."""

from __future__ import annotations

import math
import os
import pickle

import numpy as np
import pytest

import hipress.memory.dgc  # noqa: F401  (registers memory "dgc")
from hipress.backend import bfloat16
from hipress.codecs import Payload, codec_class, get_codec, layout_nbytes
from hipress.codecs import topk as topk_module
from hipress.codecs.dgc import DGCCodec
from hipress.codecs.graddrop import GradDropCodec, threshold_indices
from hipress.codecs.randomk import RandomKCodec, random_indices, stream_key
from hipress.codecs.topk import (
    TopKCodec,
    magnitude_key,
    sampled_key_threshold,
    select_ge,
    topk_indices,
    topk_positions,
)
from hipress.errors import CodecError, NonFiniteGradientError, PayloadError
from hipress.memory import ResidualMemory, get_memory
from hipress.memory.dgc import DGCMemory

DTYPES = [np.float16, bfloat16, np.float32, np.float64]
SHAPES = [(1,), (7,), (8,), (9,), (33,), (3, 5)]


def make(name, **kw):
    return get_codec(name, **kw)


def ratio_codecs():
    return [make("topk", ratio=0.3), make("randomk", ratio=0.3), make("dgc", ratio=0.3),
            make("graddrop", drop_ratio=0.7)]


def wire(payload):
    """Serialize and parse back, as the engine does."""
    return Payload.from_bytes(payload.to_bytes())


def bits(a):
    return np.ascontiguousarray(a).view(np.uint8)


# --------------------------------------------------------------------- registry
def test_registry_ids_and_flags():
    assert codec_class("topk").codec_id == 20
    assert codec_class("randomk").codec_id == 21
    assert codec_class("dgc").codec_id == 22
    assert codec_class("graddrop").codec_id == 23
    t, r, d, g = TopKCodec, RandomKCodec, DGCCodec, GradDropCodec
    assert (t.variable_size, t.summable, t.stochastic, t.error_feedback) == (False, False, False,
                                                                             True)
    assert (r.variable_size, r.summable, r.stochastic, r.error_feedback) == (False, True, True,
                                                                             True)
    assert (d.variable_size, d.summable, d.stochastic, d.error_feedback) == (True, False, True,
                                                                             True)
    assert (g.variable_size, g.summable, g.stochastic, g.error_feedback) == (True, False, True,
                                                                             True)
    assert not any(c.lossless for c in (t, r, d, g))
    assert DGCCodec.default_memory == "dgc"
    assert not any(c.mergeable for c in (t, r, d, g))


def test_params_and_repr():
    assert make("topk", ratio=0.05).params() == {"ratio": 0.05}
    assert make("randomk", ratio=0.5, seed=3).params() == {"ratio": 0.5, "seed": 3}
    assert make("dgc").params() == {"ratio": 0.001, "sample_ratio": 0.01, "momentum": 0.9,
                                    "clip_norm": None, "seed": 0}
    assert make("graddrop").params() == {"drop_ratio": 0.99, "sample_ratio": 0.001, "seed": 0}
    assert make("dgc", momentum=0.5, clip_norm=2).memory_params() == {"momentum": 0.5,
                                                                      "clip_norm": 2.0}
    assert repr(make("topk", ratio=0.25)) == "TopKCodec(ratio=0.25)"


# ------------------------------------------------------------------- validation
@pytest.mark.parametrize("name", ["topk", "randomk", "dgc"])
@pytest.mark.parametrize("bad", [0, 0.0, -0.1, 1.5, float("nan"), "abc", None])
def test_ratio_validation(name, bad):
    with pytest.raises(CodecError, match=r"ratio must be .*\(0, 1\]"):
        make(name, ratio=bad)


@pytest.mark.parametrize("bad", [0, 1, 1.0, -0.5, 1.2, float("nan"), "x"])
def test_graddrop_drop_ratio_validation(bad):
    with pytest.raises(CodecError, match=r"drop_ratio must be in \(0, 1\)"):
        make("graddrop", drop_ratio=bad)


def test_other_param_validation():
    with pytest.raises(CodecError, match=r"momentum must be in \[0, 1\)"):
        make("dgc", momentum=1.0)
    with pytest.raises(CodecError, match=r"momentum must be in \[0, 1\)"):
        make("dgc", momentum=-0.1)
    with pytest.raises(CodecError, match="clip_norm must be None"):
        make("dgc", clip_norm=0)
    with pytest.raises(CodecError, match="clip_norm must be None"):
        make("dgc", clip_norm=float("inf"))
    with pytest.raises(CodecError, match=r"sample_ratio must be in \(0, 1\]"):
        make("dgc", sample_ratio=0)
    with pytest.raises(CodecError, match=r"sample_ratio must be in \(0, 1\]"):
        make("graddrop", sample_ratio=2)
    for name in ("randomk", "dgc", "graddrop"):
        with pytest.raises(CodecError, match="seed must be an integer"):
            make(name, seed=1.5)
    with pytest.raises(CodecError, match="bad parameters"):
        make("topk", k=3)
    with pytest.raises(CodecError, match="world_size must be an integer >= 1"):
        DGCMemory(world_size=0)
    with pytest.raises(CodecError, match=r"momentum must be in \[0, 1\)"):
        DGCMemory(momentum=2)


# ------------------------------------------------------------------------ top-k
def test_topk_hand_example():
    x = np.array([5, 0, 0, 0, 0, -4], dtype=np.float32)
    c = make("topk", ratio=0.34)  # floor(0.34 * 6) = 2
    p = c.encode(x, "w")
    idx, vals = p.sections
    assert idx.dtype == np.int32 and vals.dtype == np.float32
    assert idx.tolist() == [0, 5]
    assert vals.tolist() == [5.0, -4.0]
    assert np.array_equal(c.decode(wire(p)), x)
    assert p.nbytes == c.payload_nbytes(6) == layout_nbytes(1, [(np.int32, 2), (np.float32, 2)])


def test_topk_k_clamp():
    c = make("topk", ratio=0.1)
    assert c.k_for(100) == 10
    assert c.k_for(5) == 1
    assert c.k_for(1) == 1
    assert c.payload_layout((5,), np.float32) == [(np.dtype(np.int32), 1),
                                                  (np.dtype(np.float32), 1)]
    p = c.encode(np.array([0.5, -3, 2, 1, 0.25], np.float32))
    assert p.sections[0].tolist() == [1] and p.sections[1].tolist() == [-3.0]
    full = make("topk", ratio=1.0)
    x = np.arange(7, dtype=np.float64) - 3
    assert np.array_equal(full.decode(full.encode(x)), x)


def test_topk_index_dtype_wide_gradient():
    c = make("topk", ratio=1e-9)
    idx_dt, val_dt = (dt for dt, _ in c.payload_layout((2**31,), np.float16))
    assert idx_dt == np.int64 and val_dt == np.float16
    assert c.payload_layout((2**31 - 1,), np.float16)[0][0] == np.int32


@pytest.mark.parametrize("name", ["topk", "dgc", "graddrop"])
def test_float16_index_beyond_float16_range(name):
    # 39999 is not representable in float16: indices must be int32 whatever the values.
    x = np.zeros(40000, dtype=np.float16)
    x[39999] = 1.0
    c = make(name, drop_ratio=1 - 1e-5) if name == "graddrop" else make(name, ratio=1e-5)
    p = wire(c.encode(x, "emb"))
    assert p.sections[0].dtype == np.int32
    assert p.sections[0].tolist() == [39999]
    y = c.decode(p)
    assert y.dtype == np.float16 and y[39999] == 1.0 and np.count_nonzero(y) == 1


def test_magnitude_key_orders_like_abs():
    vals = np.array([0.0, -0.0, 1e-8, -1e-8, 1.0, -2.0, 3.5, -np.inf, np.inf, np.nan, 65504.0,
                     -1e-45], dtype=np.float64)
    for dt in DTYPES:
        x = vals.astype(dt)
        key = magnitude_key(x)
        assert key.dtype.itemsize == x.dtype.itemsize and key.dtype.kind == "u"
        absx = np.abs(x.astype(np.float64))
        finite = ~np.isnan(absx)
        for i in range(x.size):
            for j in range(x.size):
                if finite[i] and finite[j]:
                    assert (key[i] < key[j]) == (absx[i] < absx[j]), (dt, x[i], x[j])
        # NaN ranks above everything, Inf above every finite value.
        assert key[9] > key[:9].max() and key[8] > key[np.isfinite(absx)].max()


def ref_topk(x, k):
    return set(np.argsort(-np.abs(x.astype(np.float64)), kind="stable")[:k].tolist())


@pytest.mark.parametrize("n,ratio", [(200_000, 0.01), (200_000, 0.001), (100_000, 0.1),
                                     (70_000, 1 / 70_000)])
def test_topk_exact_on_large_inputs(n, ratio):
    x = np.random.default_rng(n).standard_normal(n).astype(np.float32)
    c = make("topk", ratio=ratio)
    k = c.k_for(n)
    p = c.encode(x, "big")
    idx = p.sections[0]
    assert idx.size == k and np.all(np.diff(idx) > 0)
    assert set(idx.tolist()) == ref_topk(x, k)
    assert np.array_equal(bits(p.sections[1]), bits(x[idx]))


def test_topk_mostly_zero_gradient():
    n = 100_000
    x = np.zeros(n, np.float32)
    pos = np.random.default_rng(1).choice(n, 300, replace=False)
    x[pos] = np.arange(1, 301, dtype=np.float32)
    c = make("topk", ratio=0.001)  # k = 100, all among the 300 nonzeros
    assert set(c.encode(x).sections[0].tolist()) == set(pos[200:].tolist())
    c = make("topk", ratio=0.01)  # k = 1000 > 300 nonzeros: all of them plus zeros
    idx = c.encode(x).sections[0]
    assert idx.size == 1000 and set(pos.tolist()) <= set(idx.tolist())


class _AdversarialRng:
    """Samples only the largest entries, so the prefilter threshold is far too high."""

    def __init__(self, x):
        self.top = np.argsort(np.abs(x))[-10:]

    def integers(self, lo, hi, size):
        return np.resize(self.top, size)


class _LowRng:
    """Samples only the smallest entries, so the prefilter would catch nearly everything."""

    def __init__(self, x):
        self.low = np.argsort(np.abs(x))[:10]

    def integers(self, lo, hi, size):
        return np.resize(self.low, size)


@pytest.mark.parametrize("numba", [True, False])
def test_topk_prefilter_falls_back(monkeypatch, numba):
    monkeypatch.setattr(topk_module, "use_numba", numba)
    n, k = 100_000, 5000
    x = np.random.default_rng(2).standard_normal(n).astype(np.float32)
    for rng in (_AdversarialRng(x), _LowRng(x), np.random.default_rng(0), None):
        idx = topk_positions(x, k, rng)
        assert np.all(np.diff(idx) > 0)
        assert set(idx.tolist()) == ref_topk(x, k)


def test_topk_indices_exact():
    key = np.array([3, 1, 4, 1, 5, 9, 2, 6], np.uint32)
    assert topk_indices(key, 3).tolist() == [4, 5, 7]
    assert topk_indices(key, 8).tolist() == list(range(8))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_select_ge_numba_matches_reference(monkeypatch, dtype):
    x = np.random.default_rng(9).standard_normal(10_000).astype(dtype)
    x[::97] = 0
    x[5] = -np.inf
    t = magnitude_key(np.array([1.5], dtype))[0]
    ref = np.flatnonzero(np.abs(x.astype(np.float64)) >= 1.5)
    for numba in (True, False):
        monkeypatch.setattr(topk_module, "use_numba", numba)
        got = select_ge(x, t, 10_000)
        assert np.array_equal(got, ref)
        assert select_ge(x, t, ref.size - 1) is None
        assert np.array_equal(select_ge(x, t, ref.size), ref)


def test_sampled_key_threshold_estimates_quantile():
    x = np.random.default_rng(3).standard_normal(1 << 20).astype(np.float32)
    t = sampled_key_threshold(x, 10_000, 100_000, np.random.default_rng(1))
    assert t.dtype == np.uint32
    frac = np.mean(magnitude_key(x) >= t) * x.size / 10_000
    # ks = round(10000 / 2**20 * 1e5) = 954 sampled above: relative sd 1/sqrt(954) = 3.2%.
    assert 0.85 < frac < 1.15


def test_topk_ties_give_exactly_k():
    x = np.ones(100_000, np.float32)
    c = make("topk", ratio=0.01)
    p = c.encode(x)
    assert p.sections[0].size == 1000 and np.all(p.sections[1] == 1)


# ----------------------------------------------------------- all codecs, shapes
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_roundtrip_shape_dtype_exact_values(dtype, shape):
    x = np.random.default_rng(7).standard_normal(shape).astype(dtype)
    x[x == 0] = 1  # no zeros, so "sent" == "nonzero in the output"
    for c in ratio_codecs():
        p = c.encode(x, "layer.w")
        assert p.dtype == np.dtype(dtype) and p.shape == shape
        if c.variable_size:
            assert p.nbytes <= c.payload_nbytes(shape, dtype)
        else:
            assert p.nbytes == c.payload_nbytes(shape, dtype)
        y = c.decode(wire(p))
        assert y.shape == shape and y.dtype == np.dtype(dtype)
        sent = y != 0
        assert sent.any()
        assert np.array_equal(bits(y[sent]), bits(x[sent])), c.name
        n = x.size
        k = c.k_for(n)
        if c.name in ("topk", "randomk"):
            assert int(sent.sum()) == k
        else:
            assert 1 <= int(sent.sum()) <= min(n, 2 * k)
        if c.name != "randomk":  # a "top set": every sent magnitude >= every unsent one
            a = np.abs(x.astype(np.float64)).reshape(-1)
            s = sent.reshape(-1)
            if (~s).any():
                assert a[s].min() >= a[~s].max()


@pytest.mark.parametrize("shape", [(0,), (3, 0)], ids=str)
def test_empty_gradients(shape):
    for c in ratio_codecs():
        p = c.encode(np.zeros(shape, np.float32), "e")
        assert p.sections == ()
        y = c.decode(wire(p))
        assert y.shape == shape and y.dtype == np.float32


def test_all_zero_gradient_threshold_codecs_send_nothing():
    x = np.zeros(50_000, np.float32)
    for c in (make("dgc", ratio=0.01), make("graddrop")):
        p = c.encode(x, "z")
        assert p.sections[0].size == 0
        assert np.array_equal(c.decode(wire(p)), x)


def test_noncontiguous_input():
    x = np.random.default_rng(3).standard_normal((20, 10)).astype(np.float32)[:, ::2]
    for c in ratio_codecs():
        y = c.decode(c.encode(x, "nc"))
        assert y.shape == (20, 5)
        m = y != 0
        assert np.array_equal(y[m], x[m])


# --------------------------------------------------------------------- NaN/Inf
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf, -np.nan])
@pytest.mark.parametrize("name", ["topk", "dgc", "graddrop"])
def test_non_finite_detected_anywhere(name, bad):
    n = 100_000
    x = np.random.default_rng(5).standard_normal(n).astype(np.float32)
    x[76_543] = bad
    c = make(name) if name == "graddrop" else make(name, ratio=0.001)
    with pytest.raises(NonFiniteGradientError, match="'fc.weight'"):
        c.encode(x, "fc.weight")


def test_randomk_non_finite_at_a_sent_position():
    x = np.full(64, np.nan, np.float32)
    with pytest.raises(NonFiniteGradientError, match="'g'"):
        make("randomk", ratio=0.1).encode(x, "g")


def test_many_nans_threshold_codecs():
    x = np.random.default_rng(0).standard_normal(100_000).astype(np.float32)
    x[::3] = np.nan
    for c in (make("dgc", ratio=0.01), make("graddrop")):
        with pytest.raises(NonFiniteGradientError):
            c.encode(x, "n")


# ---------------------------------------------------------------- bad payloads
def sparse_payload(codec_id, idx, vals, n, dtype=np.float32):
    return Payload(codec_id, np.dtype(dtype), (n,),
                   (np.asarray(idx, np.int32), np.asarray(vals, dtype)))


@pytest.mark.parametrize("name", ["topk", "dgc", "graddrop"])
def test_out_of_range_index_rejected(name):
    c = make(name, ratio=0.5) if name != "graddrop" else make(name, drop_ratio=0.5)
    for bad in (10, -1):
        p = sparse_payload(c.codec_id, [1, 2, bad, 4, 5], [1, 1, 1, 1, 1], 10)
        with pytest.raises(PayloadError, match=r"outside \[0, 10\)"):
            c.decode(wire(p))


@pytest.mark.parametrize("name", ["dgc", "graddrop"])
def test_variable_size_counts(name):
    c = make(name, ratio=0.2) if name == "dgc" else make(name, drop_ratio=0.8)
    n = 50  # k = 10, bound = 20
    assert c.payload_layout((n,), np.float32)[0][1] == 20
    y = c.decode(sparse_payload(c.codec_id, [], [], n))
    assert np.array_equal(y, np.zeros(n, np.float32))
    idx = np.arange(0, 40, 2)
    y = c.decode(wire(sparse_payload(c.codec_id, idx, idx + 1.0, n)))
    assert np.array_equal(y[idx], idx + 1.0) and np.count_nonzero(y) == 20
    with pytest.raises(PayloadError, match="do not match"):  # 21 > bound
        c.decode(sparse_payload(c.codec_id, np.arange(21), np.ones(21), n))
    with pytest.raises(PayloadError, match="3 indices but 2 values"):
        c.decode(sparse_payload(c.codec_id, [1, 2, 3], [1, 2], n))


def test_foreign_and_mismatched_payloads():
    x = np.arange(10, dtype=np.float32)
    t = make("topk", ratio=0.5)
    with pytest.raises(PayloadError, match="codec id 21"):
        t.decode(make("randomk", ratio=0.5).encode(x, "a"))
    with pytest.raises(PayloadError, match="do not match"):  # fixed size: 4 != k = 5
        t.decode(sparse_payload(20, [1, 2, 3, 4], [1, 1, 1, 1], 10))
    r = make("randomk", ratio=0.5)
    bad = Payload(21, np.dtype(np.float32), (10,), (np.zeros(1, np.uint64), np.ones(4, np.float32)))
    with pytest.raises(PayloadError, match="do not match"):
        r.decode(bad)


# ----------------------------------------------------------------------- random-k
def test_random_indices_properties():
    for n, k in [(10, 3), (10, 7), (10, 10), (1, 1), (100, 50), (100, 51), (2, 1), (1000, 999),
                 (1 << 20, 1 << 10)]:
        idx = random_indices(12345, n, k)
        assert idx.size == k and idx.dtype == np.int32
        assert np.all(np.diff(idx) > 0) and idx.min() >= 0 and idx.max() < n
    assert np.array_equal(random_indices(1, 1000, 10), random_indices(1, 1000, 10))
    assert not np.array_equal(random_indices(1, 1000, 10), random_indices(2, 1000, 10))


def test_random_indices_uniform():
    # 4000 draws of 3 of 10: each position is chosen with p = 0.3 -> 1200 +- 29 (1 sd).
    counts = np.zeros(10)
    for s in range(4000):
        counts[random_indices(s, 10, 3)] += 1
    assert np.all(np.abs(counts - 1200) < 5 * 29), counts
    # ... and the complement path (7 of 10): p = 0.7.
    counts = np.zeros(10)
    for s in range(4000):
        counts[random_indices(s, 10, 7)] += 1
    assert np.all(np.abs(counts - 2800) < 5 * 29), counts


def test_random_indices_stable_stream():
    # Ranks (and checkpoints) depend on these exact values. SeedSequence, PCG64's raw output
    # and the algorithm are stable across NumPy versions and machines: never change them.
    assert stream_key(0, "w", 0) == 14414078852277808724
    assert stream_key(7, "fc.weight", 3) == 4437532191615129411
    assert random_indices(42, 100, 5).tolist() == [19, 22, 76, 77, 78]
    assert random_indices(stream_key(0, "w", 0), 1000, 8).tolist() == [
        33, 115, 138, 362, 559, 657, 762, 782]


def test_randomk_shared_indices_across_ranks_and_steps():
    n = 1000
    rank0, rank1 = make("randomk", ratio=0.02, seed=7), make("randomk", ratio=0.02, seed=7)
    x0 = np.random.default_rng(0).standard_normal(n).astype(np.float32)
    x1 = np.random.default_rng(1).standard_normal(n).astype(np.float32)
    seen = []
    for _step in range(3):
        p0, p1 = rank0.encode(x0, "w"), rank1.encode(x1, "w")
        assert p0.sections[0].tolist() == p1.sections[0].tolist()  # same stream key
        i0 = np.flatnonzero(rank0.decode(p0))
        i1 = np.flatnonzero(make("randomk", ratio=0.02).decode(wire(p1)))
        assert i0.size == 20 and np.array_equal(i0, i1)  # a stateless decoder agrees
        assert np.array_equal(p0.sections[1], x0[i0]) and np.array_equal(p1.sections[1], x1[i0])
        seen.append(tuple(i0))
    assert len(set(seen)) == 3  # different steps, different positions
    other_seed = make("randomk", ratio=0.02, seed=8).encode(x0, "w")
    assert other_seed.sections[0][0] != make("randomk", ratio=0.02, seed=7).encode(x0, "w") \
        .sections[0][0]
    other_name = make("randomk", ratio=0.02, seed=7).encode(x0, "b")
    first = make("randomk", ratio=0.02, seed=7).encode(x0, "w")
    assert not np.array_equal(np.flatnonzero(rank0.decode(other_name)),
                              np.flatnonzero(rank0.decode(first)))


def test_randomk_payload_has_no_indices():
    c = make("randomk", ratio=0.01)
    p = c.encode(np.ones(10_000, np.float16), "w")
    assert [(s.dtype, s.size) for s in p.sections] == [(np.dtype(np.uint64), 1),
                                                        (np.dtype(np.float16), 100)]
    assert p.nbytes == layout_nbytes(1, [(np.uint64, 1), (np.float16, 100)])
    # header 8 + shape 8 + 1 + 2 sections * 9 = 35 -> 40; key 8; values 200 -> 248 bytes
    assert c.compression_ratio(10_000, np.float16) == 20_000 / 248


def test_randomk_summable_two_ranks_by_hand():
    n, prescale = 40, 0.5
    xs = [np.random.default_rng(r).standard_normal(n).astype(np.float32) for r in (0, 1)]
    codecs = [make("randomk", ratio=0.25, seed=3) for _ in range(2)]
    mems = [ResidualMemory() for _ in range(2)]
    for step in range(3):
        comp = [m.compensate("w", x) for m, x in zip(mems, xs)]
        gens = [c.reduce_stages(v, "w", 2, prescale) for c, v in zip(codecs, comp)]
        stages = [next(g) for g in gens]
        assert all(op == "sum" for _, op in stages)
        assert stages[0][0].size == stages[1][0].size == 10
        assert stages[0][0].dtype == np.float32
        total = stages[0][0] + stages[1][0]  # what allreduce(sum) returns
        outs = []
        for g in gens:
            with pytest.raises(StopIteration) as stop:
                g.send(total.copy())
            outs.append(stop.value.value)
        (res0, fb0), (res1, fb1) = outs
        assert np.array_equal(bits(res0), bits(res1))
        # The positions are those encode uses at the same step.
        idx = np.flatnonzero(codecs[0].decode(_encode_at(step, n)))
        assert idx.size == 10
        ref = np.zeros(n, np.float32)
        ref[idx] = comp[0][idx] * np.float32(0.5) + comp[1][idx] * np.float32(0.5)
        assert np.array_equal(res0, ref)
        for r, fb in ((0, fb0), (1, fb1)):
            expect = np.zeros(n, np.float32)
            expect[idx] = comp[r][idx]
            assert np.array_equal(fb, expect)
            mems[r].update("w", comp[r], fb)
            e = mems[r].get("w")
            assert np.all(e[idx] == 0)
            assert np.array_equal(e[np.setdiff1d(np.arange(n), idx)],
                                  comp[r][np.setdiff1d(np.arange(n), idx)])


def _encode_at(step, n):
    c = make("randomk", ratio=0.25, seed=3)
    c.load_state_dict({"w": step})
    return c.encode(np.ones(n, np.float32), "w")


def test_randomk_reduce_stages_float16_prescale_and_shape():
    x = np.full((4, 5), 30000, np.float16)
    c = make("randomk", ratio=0.5)
    g = c.reduce_stages(x, "h", 4, prescale=0.25)
    arr, op = next(g)
    assert arr.dtype == np.float16 and np.all(arr == 7500)
    with pytest.raises(StopIteration) as stop:
        g.send(arr * np.float16(4))
    res, fb = stop.value.value
    assert res.shape == fb.shape == (4, 5) and res.dtype == np.float16
    assert np.count_nonzero(res) == 10 and np.all(res[res != 0] == 30000)
    assert np.array_equal(np.flatnonzero(res), np.flatnonzero(fb))


def test_randomk_state_dict_round_trip():
    x = np.random.default_rng(0).standard_normal(500).astype(np.float32)
    a = make("randomk", ratio=0.05, seed=11)
    for _ in range(3):
        a.encode(x, "w")
    a.encode(x, "b")
    state = a.state_dict()
    assert state == {"w": 3, "b": 1}
    b = make("randomk", ratio=0.05, seed=11)
    b.load_state_dict(pickle.loads(pickle.dumps(state)))
    pa, pb = a.encode(x, "w"), b.encode(x, "w")
    assert pa.to_bytes() == pb.to_bytes()
    b.load_state_dict({"w": np.int64(5)})
    assert b.state_dict() == {"w": 5}
    with pytest.raises(CodecError, match="non-negative integer"):
        b.load_state_dict({"w": -1})
    with pytest.raises(CodecError, match="non-negative integer"):
        b.load_state_dict({"w": 1.5})


# --------------------------------------------------------------------------- DGC
def test_dgc_selects_about_k_on_normal_vector():
    # n = 2**20, ratio 0.001 -> k = 1048; sample = 1% = 10486, ks = round(k / n * 10486) = 10.
    # The fraction above the sampled threshold is Beta(ks, s - ks + 1): mean k/n, relative
    # sd 1/sqrt(10) = 0.32. P(count < k/3) = 0.24%, P(count > 2k) = 0.5% (then exactly k).
    # So each count must lie in [k/3, 2k], and the mean of 12 steps within 0.25 of k
    # (3.5 sd of the mean).
    n = 1 << 20
    x = np.random.default_rng(0).standard_normal(n).astype(np.float32)
    c = make("dgc", ratio=0.001)
    k = c.k_for(n)
    assert k == 1048
    counts = []
    for _ in range(12):
        p = c.encode(x, "fc")
        idx = p.sections[0]
        counts.append(idx.size)
        assert k / 3 <= idx.size <= 2 * k
        a = np.abs(x)
        chosen = np.zeros(n, bool)
        chosen[idx] = True
        assert a[chosen].min() >= a[~chosen].max()  # a top set
    assert abs(np.mean(counts) / k - 1) < 0.25, counts
    assert len(set(counts)) > 1  # the sample changes with the step


def test_graddrop_selects_about_k():
    # n = 2**20, keep 1% -> k = 10485; sample = max(0.1% n, 4096) = 4096, ks = 41:
    # relative sd 0.16, so [k/2, 2k] is > 3 sd on the low side.
    n = 1 << 20
    x = np.random.default_rng(1).standard_normal(n).astype(np.float32)
    c = make("graddrop")
    k = c.k_for(n)
    assert k == 10485
    for _ in range(5):
        size = c.encode(x, "fc").sections[0].size
        assert k / 2 <= size <= 2 * k


@pytest.mark.parametrize("numba", [True, False])
def test_threshold_selection_caps_at_bound(monkeypatch, numba):
    monkeypatch.setattr(topk_module, "use_numba", numba)
    x = np.ones(100_000, np.float32)  # every element ties at the threshold
    idx = threshold_indices(x, 100, 4096, np.random.default_rng(0))
    assert idx.size == 100  # 100000 > bound 200 -> exact top-k of the selection
    x[:50] = 2
    idx = threshold_indices(x, 100, 4096, np.random.default_rng(0))
    assert idx.size == 100 and set(range(50)) <= set(idx.tolist())


@pytest.mark.parametrize("name", ["topk", "dgc", "graddrop"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_numba_and_numpy_paths_agree(monkeypatch, name, dtype):
    x = np.random.default_rng(6).standard_normal(300_000).astype(dtype)
    x[1000:5000] = 0
    out = []
    for numba in (True, False):
        monkeypatch.setattr(topk_module, "use_numba", numba)
        c = make(name) if name == "graddrop" else make(name, ratio=0.002)
        out.append(c.encode(x, "w").to_bytes())
    assert out[0] == out[1]


def test_dgc_small_gradient_is_exact_topk():
    x = np.random.default_rng(4).standard_normal(4000).astype(np.float32)  # < 4096 samples
    c = make("dgc", ratio=0.01)
    idx = c.encode(x, "s").sections[0]
    assert set(idx.tolist()) == ref_topk(x, 40)


def test_graddrop_k_rounding():
    assert make("graddrop", drop_ratio=0.9).k_for(100) == 10
    assert make("graddrop", drop_ratio=0.99).k_for(100) == 1
    assert make("graddrop", drop_ratio=0.5).k_for(7) == 3


@pytest.mark.parametrize("name", ["dgc", "graddrop"])
def test_threshold_codec_state_dict_round_trip(name):
    x = np.random.default_rng(0).standard_normal(200_000).astype(np.float32)
    a = make(name)
    a.encode(x, "w")
    a.encode(x, "w")
    b = make(name)
    b.load_state_dict(a.state_dict())
    assert a.state_dict() == {"w": 2}
    assert a.encode(x, "w").to_bytes() == b.encode(x, "w").to_bytes()


def test_topk_has_no_state():
    c = make("topk")
    assert c.state_dict() == {}
    with pytest.raises(CodecError):
        c.load_state_dict({"w": 1})


# -------------------------------------------------------------------- DGC memory
def dgc_step(mem, codec, name, g):
    v = mem.compensate(name, g)
    p = codec.encode(v, name)
    d = codec.decode(wire(p))
    mem.update(name, v, d)
    return d


def test_dgc_memory_momentum_correction_by_hand():
    mem = get_memory("dgc", momentum=0.5)
    assert isinstance(mem, DGCMemory)
    codec = make("dgc", ratio=0.25)  # 4 elements: k = 1, exact top-1
    f32 = np.float32
    # step 1: u = g, v = g = [1, -2, 3, .5]; send 3 at 2; mask u and v there
    d = dgc_step(mem, codec, "w", np.array([1, -2, 3, 0.5], f32))
    assert d.tolist() == [0, 0, 3, 0]
    assert mem.get("w/v").tolist() == [1, -2, 0, 0.5]
    assert mem.get("w/u").tolist() == [1, -2, 0, 0.5]
    # step 2: u = .5 u + 1 = [1.5, 0, 1, 1.25]; v = [2.5, -2, 1, 1.75]; send 2.5 at 0
    d = dgc_step(mem, codec, "w", np.ones(4, f32))
    assert d.tolist() == [2.5, 0, 0, 0]
    assert mem.get("w").tolist() == [0, -2, 1, 1.75]
    assert mem.get("w/u").tolist() == [0, 0, 1, 1.25]
    # step 3: u = [0, 0, .5, .625]; v = [0, -2, 1.5, 2.375]; send 2.375 at 3
    d = dgc_step(mem, codec, "w", np.zeros(4, f32))
    assert d.tolist() == [0, 0, 0, 2.375]
    assert mem.get("w/v").tolist() == [0, -2, 1.5, 0]
    assert mem.get("w/u").tolist() == [0, 0, 0.5, 0]
    assert mem.get("w/v").dtype == np.float32 and "w" in mem


def test_dgc_memory_float16_state_float32():
    mem = DGCMemory(momentum=0.9)
    v = mem.compensate("h", np.array([1, 2], np.float16))
    assert v.dtype == np.float32
    mem.update("h", v, np.zeros(2, np.float32))
    assert mem.get("h/u").dtype == np.float32 and mem.get("h").tolist() == [1, 2]


def test_dgc_memory_clipping():
    mem = DGCMemory(momentum=0.0, clip_norm=2.0, world_size=4)  # per-rank norm 2 / sqrt(4) = 1
    assert mem.clip_threshold == 1.0
    v = mem.compensate("c", np.array([3, 4], np.float32))  # norm 5 -> scaled by 1/5
    np.testing.assert_allclose(v, [0.6, 0.8], rtol=1e-6, atol=0)
    mem.update("c", v, np.zeros(2, np.float32))
    small = mem.compensate("s", np.array([0.3, 0.4], np.float32))  # norm .5 < 1: untouched
    assert small.tolist() == np.array([0.3, 0.4], np.float32).tolist()


def test_dgc_memory_non_finite_leaves_state():
    mem = DGCMemory(momentum=0.5, clip_norm=1.0)
    codec = make("dgc", ratio=0.5)
    dgc_step(mem, codec, "w", np.array([1, 2], np.float32))
    before = mem.state_dict()
    with pytest.raises(NonFiniteGradientError, match="'w'"):
        mem.compensate("w", np.array([np.nan, 1], np.float32))
    # without clipping the codec raises; the memory state is only changed by update()
    mem2 = DGCMemory(momentum=0.5)
    dgc_step(mem2, codec, "w", np.array([1, 2], np.float32))
    before2 = mem2.state_dict()
    v = mem2.compensate("w", np.array([np.inf, 1], np.float32))
    with pytest.raises(NonFiniteGradientError):
        codec.encode(v, "w")
    for m, b in ((mem, before), (mem2, before2)):
        after = m.state_dict()
        assert after.keys() == b.keys()
        assert all(np.array_equal(after[k], b[k]) for k in b)


def test_dgc_memory_update_requires_compensate():
    with pytest.raises(CodecError, match="without a compensate"):
        DGCMemory().update("w", np.zeros(2, np.float32), np.zeros(2, np.float32))


def test_dgc_memory_does_not_modify_gradient():
    g = np.array([1.0, 2.0, 3.0], np.float32)
    keep = g.copy()
    mem = DGCMemory(momentum=0.0)
    dgc_step(mem, make("dgc", ratio=0.4), "w", g)
    assert np.array_equal(g, keep)


def test_dgc_memory_state_dict_round_trip():
    rng = np.random.default_rng(0)
    codec = make("dgc", ratio=0.1)
    a = DGCMemory(momentum=0.9)
    grads = [rng.standard_normal((6, 7)).astype(np.float32) for _ in range(6)]
    for g in grads[:3]:
        dgc_step(a, codec, "conv", g)
        dgc_step(a, codec, "fc", g[0])
    state = a.state_dict()
    assert sorted(state) == ["conv/u", "conv/v", "fc/u", "fc/v"]
    assert all(isinstance(v, np.ndarray) and v.dtype == np.float32 for v in state.values())
    b = DGCMemory(momentum=0.9)
    b.load_state_dict(state)
    c = pickle.loads(pickle.dumps(a))
    for g in grads[3:]:
        da = dgc_step(a, codec, "conv", g)
        assert np.array_equal(da, dgc_step(b, codec, "conv", g))
        assert np.array_equal(da, dgc_step(c, codec, "conv", g))
    assert np.array_equal(a.get("conv"), b.get("conv"))
    with pytest.raises(CodecError, match="must end in '/u' or '/v'"):
        b.load_state_dict({"conv": np.zeros(3, np.float32)})
    with pytest.raises(CodecError, match=r"lacks \['conv/u'\]"):
        b.load_state_dict({"conv/v": np.zeros(3, np.float32)})
    b.reset("conv")
    assert "conv" not in b and "fc" in b
    b.reset()
    assert b.state_dict() == {}


def test_dgc_memory_zero_momentum_is_residual_feedback():
    rng = np.random.default_rng(3)
    mem = DGCMemory(momentum=0.0)
    codec = make("dgc", ratio=0.05)
    total_g = np.zeros(300, np.float64)
    total_d = np.zeros(300, np.float64)
    for _ in range(20):
        g = rng.standard_normal(300).astype(np.float32)
        total_g += g
        total_d += dgc_step(mem, codec, "w", g)
    np.testing.assert_allclose(total_d + mem.get("w"), total_g, rtol=0, atol=1e-4)


# ------------------------------------------------------------ error feedback
@pytest.mark.parametrize("name", ["topk", "dgc", "graddrop", "randomk"])
def test_error_feedback_tracks_gradient_sum(name):
    # e_t = c_t - C(c_t), c_t = g_t + e_{t-1}. For a top set of m of n elements,
    # ||c - C(c)||^2 <= (1 - m/n) ||c||^2, so with q = sqrt(1 - m_min/n):
    # ||e_t|| <= q (||g_t|| + ||e_{t-1}||) <= q / (1 - q) * max ||g||. Random-k satisfies it
    # only in expectation; we check it against 2x the bound there.
    n, steps = 1000, 60
    rng = np.random.default_rng(11)
    codec = make(name) if name == "graddrop" else make(name, ratio=0.05)
    if name == "graddrop":
        codec = make(name, drop_ratio=0.95)
    mem = ResidualMemory()
    sum_g = np.zeros(n)
    sum_d = np.zeros(n)
    gmax = 0.0
    norms, sizes = [], []
    for _ in range(steps):
        g = rng.standard_normal(n).astype(np.float32)
        gmax = max(gmax, float(np.linalg.norm(g)))
        c = mem.compensate("w", g)
        p = codec.encode(c, "w")
        d = codec.decode(wire(p))
        mem.update("w", c, d)
        sum_g += g
        sum_d += d
        sizes.append(int(np.count_nonzero(d)))
        norms.append(float(np.linalg.norm(mem.get("w"))))
    np.testing.assert_allclose(sum_d + mem.get("w"), sum_g, rtol=0, atol=1e-3)
    q = math.sqrt(1 - min(sizes) / n)
    bound = q / (1 - q) * gmax * (2 if name == "randomk" else 1)
    assert max(norms) <= bound, (max(norms), bound)
    assert min(sizes) >= (50 if name in ("topk", "randomk") else 15)


# ------------------------------------------------------------------ GPU (CuPy)
def _cupy_or_skip():
    """Return cupy with a usable GPU; skip without one, fail when HIPRESS_EXPECT_GPU=1."""
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() > 0:
            return cupy
        why = "no CUDA device"
    except Exception as exc:  # ImportError or a CUDA runtime error
        why = f"cupy unusable: {exc}"
    if os.environ.get("HIPRESS_EXPECT_GPU") == "1":
        pytest.fail(f"a GPU was expected (HIPRESS_EXPECT_GPU=1) but {why}")
    pytest.skip(why)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64],
                         ids=lambda d: np.dtype(d).name)
def test_gpu_topk_matches_cpu(dtype):
    cp = _cupy_or_skip()
    x = np.random.default_rng(0).standard_normal(300_001).astype(dtype)
    a = np.abs(x.astype(np.float64))
    for ratio in (0.01, 0.2, 1e-5):
        c = make("topk", ratio=ratio)
        pc, pg = c.encode(x, "w"), c.encode(cp.asarray(x), "w")
        assert isinstance(pg.sections[0], cp.ndarray)
        assert pg.sections[0].dtype == np.int32
        ig = cp.asnumpy(pg.sections[0])
        assert ig.size == c.k_for(x.size) and np.all(np.diff(ig) > 0)
        assert np.array_equal(cp.asnumpy(pg.sections[1]), x[ig])
        if dtype == np.float16:  # many ties at the k-th magnitude: same magnitudes
            assert np.array_equal(np.sort(a[ig]), np.sort(a[pc.sections[0]]))
        else:  # exact top-k, no ties: same positions whatever the prefilter sampled
            assert pg.to_bytes() == pc.to_bytes()
        y = c.decode(pg)
        assert isinstance(y, cp.ndarray)
        assert np.array_equal(cp.asnumpy(y), c.decode(Payload.from_bytes(pg.to_bytes())))


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["dgc", "graddrop"])
def test_gpu_threshold_codecs(name):
    cp = _cupy_or_skip()
    n = 1 << 20
    x = np.random.default_rng(1).standard_normal(n).astype(np.float32)
    c = make(name) if name == "graddrop" else make(name, ratio=0.001)
    k = c.k_for(n)
    for _ in range(3):
        p = c.encode(cp.asarray(x), "w")
        idx = cp.asnumpy(p.sections[0])
        assert k / 3 <= idx.size <= 2 * k and np.all(np.diff(idx) > 0)
        assert np.array_equal(cp.asnumpy(p.sections[1]), x[idx])
        a = np.abs(x)
        chosen = np.zeros(n, bool)
        chosen[idx] = True
        assert a[chosen].min() >= a[~chosen].max()
        host = Payload.from_bytes(p.to_bytes())
        assert np.array_equal(cp.asnumpy(c.decode(p)), c.decode(host))
    x[12345] = np.nan
    with pytest.raises(NonFiniteGradientError, match="'w'"):
        c.encode(cp.asarray(x), "w")
    z = c.encode(cp.zeros(n, cp.float32), "z")
    assert z.sections[0].size == 0


@pytest.mark.gpu
def test_gpu_randomk_identical_to_cpu():
    cp = _cupy_or_skip()
    x = np.random.default_rng(2).standard_normal((300, 77)).astype(np.float32)
    cpu, gpu = make("randomk", ratio=0.01, seed=5), make("randomk", ratio=0.01, seed=5)
    for _ in range(2):
        pc, pg = cpu.encode(x, "w"), gpu.encode(cp.asarray(x), "w")
        assert pg.to_bytes() == pc.to_bytes()  # a CPU rank and a GPU rank agree
        assert np.array_equal(cp.asnumpy(gpu.decode(pg)), cpu.decode(pc))
    gc, gg = cpu.reduce_stages(x, "r", 2, 0.5), gpu.reduce_stages(cp.asarray(x), "r", 2, 0.5)
    ac, ag = next(gc)[0], next(gg)[0]
    assert np.array_equal(cp.asnumpy(ag), ac)
    with pytest.raises(StopIteration) as sc:
        gc.send(ac * 2)
    with pytest.raises(StopIteration) as sg:
        gg.send(ag * 2)
    (rc, fc), (rg, fg) = sc.value.value, sg.value.value
    assert np.array_equal(cp.asnumpy(rg), rc) and np.array_equal(cp.asnumpy(fg), fc)


@pytest.mark.gpu
def test_gpu_dgc_memory_hand_example():
    cp = _cupy_or_skip()
    mem = DGCMemory(momentum=0.5, clip_norm=100.0)
    codec = make("dgc", ratio=0.25)
    f32 = cp.float32
    d = dgc_step(mem, codec, "w", cp.asarray([1, -2, 3, 0.5], f32))  # decoded on the host
    assert cp.asnumpy(d).tolist() == [0, 0, 3, 0]
    v = mem.compensate("w", cp.ones(4, f32))
    d = codec.decode(Payload.from_bytes(codec.encode(v, "w").to_bytes(), xp=cp))
    assert isinstance(d, cp.ndarray)
    mem.update("w", v, d)
    assert cp.asnumpy(d).tolist() == [2.5, 0, 0, 0]
    assert cp.asnumpy(mem.get("w")).tolist() == [0, -2, 1, 1.75]
    assert cp.asnumpy(mem.get("w/u")).tolist() == [0, 0, 1, 1.25]
    state = mem.state_dict()
    assert all(type(v) is np.ndarray for v in state.values())


# --------------------------------------------- sparse fast paths (decode_add, memories)
def _sparse_codecs():
    return [make("topk", ratio=0.1), make("dgc", ratio=0.1, sample_ratio=1.0),
            make("graddrop", drop_ratio=0.9)]


@pytest.mark.parametrize("codec", _sparse_codecs(), ids=lambda c: c.name)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_sparse_decode_add_equals_dense_add(codec, dtype):
    rng = np.random.default_rng(3)
    x = rng.standard_normal(1000).astype(dtype)
    p = wire(codec.encode(x, "g"))
    acc = rng.standard_normal(1000).astype(dtype)
    want = acc + codec.decode(p).astype(dtype)
    codec.decode_add(p, acc)
    assert bits(acc).tobytes() == bits(want).tobytes()
    idx, values = codec.sparse_entries(p, numel=1000)
    assert 0 < idx.size <= 200 and np.all(np.diff(idx) > 0)
    assert np.array_equal(values, x[idx])


def test_sparse_entries_checks_like_decode():
    c = make("topk", ratio=0.5)
    assert make("onebit").sparse_entries(make("onebit").encode(np.ones(8, np.float32))) is None
    with pytest.raises(PayloadError, match=r"outside \[0, 10\)"):
        c.sparse_entries(sparse_payload(c.codec_id, [1, 2, 3, 4, 10], [1] * 5, 10))
    p = wire(c.encode(np.arange(10, dtype=np.float32)))
    with pytest.raises(PayloadError, match="12"):
        c.sparse_entries(p, numel=12)
    with pytest.raises(PayloadError, match="codec id"):
        make("dgc", ratio=0.5).sparse_entries(p)


def _dense_memory_step(mem, codec, name, g):
    """The error-feedback step with a dense decode (the reference of the sparse one)."""
    c = mem.compensate(name, g)
    p = codec.encode(c, name=name)
    mem.update(name, c, codec.decode(p))
    return p


@pytest.mark.parametrize("memory", ["residual", "dgc"])
@pytest.mark.parametrize("codec", _sparse_codecs(), ids=lambda c: c.name)
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_sparse_memory_update_bit_identical_to_dense(memory, codec, dtype):
    """Memory.encode's sparse update leaves the same state bits as compensate/decode/update."""
    fast = get_memory(memory, **({"momentum": 0.9} if memory == "dgc" else {}))
    ref = get_memory(memory, **({"momentum": 0.9} if memory == "dgc" else {}))
    fast_codec, ref_codec = pickle.loads(pickle.dumps(codec)), pickle.loads(pickle.dumps(codec))
    rng = np.random.default_rng(5)
    for step in range(4):
        g = rng.standard_normal((40, 25)).astype(dtype)
        g[0, :3] = 0.0  # zeros that may be sent (momentum is kept there)
        p, decoded = fast.encode(fast_codec, "w", g)
        assert decoded is None  # never built
        q = _dense_memory_step(ref, ref_codec, "w", g)
        assert p.to_bytes() == q.to_bytes(), step
        a, b = fast.state_dict(), ref.state_dict()
        assert sorted(a) == sorted(b)
        for k in a:
            assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape
            assert bits(a[k]).tobytes() == bits(b[k]).tobytes(), (step, k)


def test_dgc_memory_sparse_update_needs_compensate():
    mem = DGCMemory()
    with pytest.raises(CodecError, match="without a compensate"):
        mem.update_sparse("w", np.zeros(4, np.float32), np.array([1]), np.ones(1, np.float32))


def test_gather_sum_writes_sparse_payloads_in_place():
    """The gather path's in-place sparse sum equals decode-all-then-sum, then average."""
    from hipress.engine import tasks as T
    from hipress.memory import NoMemory
    from hipress.timeline import Timeline

    codec = make("topk", ratio=0.2)
    rng = np.random.default_rng(9)
    xs = [rng.standard_normal(500).astype(np.float32) for _ in range(3)]
    bufs = [codec.encode(x[100:400], "g").to_buffer() for x in xs]
    env = T.TaskEnv(rank=0, size=3, timeline=Timeline(False), stats={})
    flat = xs[0].copy()
    job = T.Job(name="g", flat=flat, out=flat, shape=(500,), average=True, codec=codec,
                memory=NoMemory(), contributes=True)
    T._sparse_sum_write_step(env, job, codec, [(bufs[0], None)] + bufs[1:], 100, 400, "p0")
    acc = T._decode_sum_step(env, job, codec, bufs, "p0", 300)  # the dense reference
    want = xs[0].copy()
    T._write(env, T.Job(name="g", flat=want, out=want, shape=(500,), average=True,
                        codec=codec, memory=NoMemory(), contributes=True), 100, 400, acc)
    assert bits(flat).tobytes() == bits(want).tobytes()
    assert np.array_equal(flat[:100], xs[0][:100]) and np.count_nonzero(flat[100:400]) > 60
    with pytest.raises(PayloadError):  # a payload of another size is refused
        T._sparse_sum_write_step(env, job, codec, bufs, 100, 401, "p0")
