"""Codec-specific tests of the quantization codecs (onebit, tbq, terngrad, qsgd, signsgd,
efsignsgd, minmax8): hand-computed values, payload sizes, NaN policy, parameter
validation, error-feedback tracking, the summable TernGrad path, and the Numba fast paths
against the NumPy references."""

from __future__ import annotations

import numpy as np
import pytest

from hipress.backend import bfloat16
from hipress.codecs import Payload, get_codec, layout_nbytes
from hipress.codecs import _kernels_quant as kq
from hipress.codecs.base import header_nbytes
from hipress.errors import CodecError, NonFiniteGradientError
from hipress.memory.base import ResidualMemory

DTYPES = [np.float32, np.float64, np.float16, bfloat16]
ALL = [
    ("onebit", {}),
    ("tbq", {"threshold": 0.5}),
    ("terngrad", {"seed": 7}),
    ("qsgd", {"levels": 15, "seed": 7}),
    ("signsgd", {}),
    ("efsignsgd", {}),
    ("minmax8", {}),
]
FAST = [c for c in ALL if c[0] != "minmax8"]


def pair(name, **kw):
    """Return (codec on its fast path, same codec forced onto the NumPy reference)."""
    fast = get_codec(name, **kw)
    ref = get_codec(name, **kw)
    ref.use_fast_path = False
    return fast, ref


def roundtrip(codec, x, name="g"):
    p = codec.encode(x, name)
    wire = p.to_bytes()
    assert len(wire) == p.nbytes == codec.payload_nbytes(x.shape, x.dtype)
    return p, codec.decode(Payload.from_bytes(wire))


def f64(a):
    return np.asarray(a).astype(np.float64)


# ------------------------------------------------------------------ common properties
@pytest.mark.parametrize("name,kw", ALL)
@pytest.mark.parametrize("shape", [(1,), (7,), (8,), (9,), (33,), (3, 5), (0,), (4, 0)])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_shape_dtype_and_size(name, kw, shape, dtype):
    codec = get_codec(name, **kw)
    x = np.random.default_rng(3).standard_normal(shape).astype(dtype)
    _, y = roundtrip(codec, x)
    assert y.shape == x.shape and y.dtype == np.dtype(dtype)


@pytest.mark.parametrize("name,kw", ALL)
def test_capability_flags_and_params(name, kw):
    codec = get_codec(name, **kw)
    assert codec.params() == kw
    assert codec.error_feedback == (name in ("onebit", "tbq", "efsignsgd"))
    assert codec.stochastic == (name in ("terngrad", "qsgd"))
    assert codec.summable == (name == "terngrad")
    assert not codec.lossless and not codec.variable_size


@pytest.mark.parametrize("name,kw", ALL)
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("fast", [True, False])
def test_non_finite_refused(name, kw, bad, fast):
    codec = get_codec(name, **kw)
    codec.use_fast_path = fast
    x = np.linspace(-1, 1, 37).astype(np.float32)
    x[20] = bad
    with pytest.raises(NonFiniteGradientError, match="layer3.weight"):
        codec.encode(x, "layer3.weight")


def test_expected_layouts():
    n = 100
    assert get_codec("onebit")._layout((n,), np.float32) == [(np.uint8, 13), (np.float32, 2)]
    assert get_codec("tbq", threshold=1)._layout((n,), np.float32) == [
        (np.uint8, 25), (np.float32, 1)]
    assert get_codec("terngrad")._layout((n,), np.float32) == [(np.uint8, 25), (np.float32, 1)]
    assert get_codec("qsgd")._layout((n,), np.float32) == [
        (np.float32, 1), (np.uint8, 13), (np.uint8, 100)]
    assert get_codec("signsgd")._layout((n,), np.float32) == [(np.uint8, 13)]
    assert get_codec("efsignsgd")._layout((n,), np.float32) == [(np.uint8, 13), (np.float32, 1)]
    assert get_codec("minmax8")._layout((n,), np.float32) == [(np.float32, 2), (np.uint8, 100)]
    # 16M float32 elements: onebit is ~32x smaller, 2-bit codecs ~16x.
    assert get_codec("onebit").compression_ratio(2**24) > 31.9
    assert get_codec("terngrad").compression_ratio(2**24) > 15.9


@pytest.mark.parametrize("name,kw", ALL)
def test_payload_nbytes_every_size(name, kw):
    codec = get_codec(name, **kw)
    rng = np.random.default_rng(0)
    for n in range(1, 41):
        p = codec.encode(rng.standard_normal(n).astype(np.float32), "g")
        assert len(p.to_bytes()) == codec.payload_nbytes(n)


# ------------------------------------------------------------------------- onebit
def test_onebit_exact_values():
    g = np.array([1, 2, -3, -1, 0, 0.5, -0.5, 4], np.float32)
    for codec in pair("onebit"):
        p, y = roundtrip(codec, g)
        bits, scales = p.sections
        # negatives at 2, 3, 6 -> 0b00110010
        assert bits.tolist() == [0b00110010]
        # mean of {1, 2, 0, 0.5, 4} = 1.5; mean of {-3, -1, -0.5} = -1.5
        assert scales.dtype == np.float32 and scales.tolist() == [1.5, -1.5]
        assert y.tolist() == [1.5, 1.5, -1.5, -1.5, 1.5, 1.5, -1.5, 1.5]


def test_onebit_8_elements_cost_one_byte():
    codec = get_codec("onebit")
    p = codec.encode(np.arange(8, dtype=np.float32) - 4, "g")
    assert p.sections[0].dtype == np.uint8 and p.sections[0].size == 1
    assert p.sections[0].tolist() == [0b11110000]
    # header (1 dim, 2 sections) + 1 byte padded to 8 + 2 float32
    assert p.nbytes == header_nbytes(1, 2) + 8 + 8 == 56
    assert codec.payload_nbytes(9) == header_nbytes(1, 2) + 8 + 8  # 2 bytes still pad to 8
    assert codec.payload_nbytes(65) == header_nbytes(1, 2) + 16 + 8


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_onebit_all_zero_decodes_to_zero(dtype):
    for codec in pair("onebit"):
        for x in (np.zeros(13, dtype), -np.zeros(13, dtype)):
            p, y = roundtrip(codec, x)
            assert p.sections[1].tolist() == [0.0, 0.0]
            assert p.sections[0].tolist() == [0, 0]  # zero and -0.0 are non-negative
            assert f64(y).tolist() == [0.0] * 13


def test_onebit_one_sided():
    for codec in pair("onebit"):
        _, y = roundtrip(codec, np.array([-1.0, -3.0], np.float64))
        assert y.tolist() == [-2.0, -2.0]
        _, y = roundtrip(codec, np.array([0.0, 3.0, 6.0], np.float32))
        assert y.tolist() == [3.0, 3.0, 3.0]


def test_lane_sums_follow_the_documented_order():
    rng = np.random.default_rng(5)
    n = 16 * 37 + 5
    v = rng.standard_normal(n) * 10.0 ** rng.integers(-10, 16, n)  # order-sensitive sums
    lanes = [0.0] * 16
    for i, val in enumerate(v.tolist()):
        lanes[i % 16] += val
    assert kq.lane_sums(v).tolist() == lanes
    total = 0.0
    for s in lanes:
        total += s
    assert kq.combine_lanes(kq.lane_sums(v)) == total


# ---------------------------------------------------------------------------- tbq
def test_tbq_exact_values():
    g = np.array([1.0, -1.0, 0.99, -0.99, 2.5, -3.0, 0.0, 1e-9, 1.0], np.float32)
    for codec in pair("tbq", threshold=1.0):
        p, y = roundtrip(codec, g)
        codes, tau = p.sections
        # codes 1 2 0 0 | 1 2 0 0 | 1 -> 0b01100000, 0b01100000, 0b01000000
        assert codes.tolist() == [0b01100000, 0b01100000, 0b01000000]
        assert tau.dtype == np.float32 and tau.tolist() == [1.0]
        assert y.tolist() == [1.0, -1.0, 0, 0, 1.0, -1.0, 0, 0, 1.0]


def test_tbq_compares_against_float32_tau():
    # float32(0.1) = 0.100000001490116...: a float32 0.1 reaches it, a float64 0.1 does not.
    for codec in pair("tbq", threshold=0.1):
        _, y32 = roundtrip(codec, np.array([0.1, -0.1], np.float32))
        assert y32.tolist() == [np.float32(0.1), -np.float32(0.1)]
        _, y64 = roundtrip(codec, np.array([0.1, -0.1], np.float64))
        assert y64.tolist() == [0.0, 0.0]


@pytest.mark.parametrize("bad", [0, -1.0, np.nan, np.inf, 1e-50, 1e39, "abc", None])
def test_tbq_threshold_validation(bad):
    with pytest.raises(CodecError, match="threshold"):
        get_codec("tbq", threshold=bad)


def test_tbq_params():
    c = get_codec("tbq", threshold=0.25)
    assert c.params() == {"threshold": 0.25} and c.tau == np.float32(0.25)


# ------------------------------------------------------------------------ terngrad
def test_terngrad_unbiased_and_exact_extremes():
    g = np.array([0.5, -1.0, 0.25, 0.0], np.float32)
    codec = get_codec("terngrad", seed=1)
    draws = np.empty((10_000, 4))
    for i in range(draws.shape[0]):
        p = codec.encode(g, "fc.weight")
        assert p.sections[1].tolist() == [1.0]  # s = max|g|
        draws[i] = codec.decode(p)
    assert np.abs(draws.mean(axis=0) - g).max() < 0.02
    assert (draws[:, 1] == -1.0).all()
    assert (draws[:, 3] == 0.0).all()
    assert set(np.unique(draws[:, 0])) == {0.0, 1.0}
    assert codec.state_dict() == {"steps": {"fc.weight": 10_000}}


def test_terngrad_stream_contract():
    g = np.random.default_rng(2).standard_normal(101).astype(np.float32)

    def payload(seed=0, rank=0, step=0, name="w"):
        c = get_codec("terngrad", seed=seed)
        c.rank = rank
        c.load_state_dict({"steps": {name: step}})
        return c.encode(g, name).to_bytes()

    assert get_codec("terngrad").rank == 0
    bound = get_codec("terngrad")
    bound.bind(1, 2)
    assert bound.rank == 1 and bound.encode(g, "w").to_bytes() == payload(rank=1)
    with pytest.raises(CodecError):
        bound.bind(2, 2)
    assert payload() == payload()
    assert payload() != payload(rank=1)
    assert payload() != payload(seed=1)
    assert payload() != payload(step=1)
    assert payload() != payload(name="v")
    # state_dict / load_state_dict resume the stream
    a = get_codec("terngrad", seed=3)
    a.encode(g, "w")
    saved = a.state_dict()
    want = a.encode(g, "w").to_bytes()
    b = get_codec("terngrad", seed=3)
    b.load_state_dict(saved)
    assert b.encode(g, "w").to_bytes() == want


@pytest.mark.parametrize("state", [{"step": {}}, {"steps": {"w": -1}}, {"steps": {"w": 1.5}}])
def test_stream_state_validation(state):
    with pytest.raises(CodecError):
        get_codec("terngrad").load_state_dict(state)


@pytest.mark.parametrize("bad", [-1, 2**32, 1.5, "0", True])
def test_seed_validation(bad):
    for name in ("terngrad", "qsgd"):
        with pytest.raises(CodecError, match="seed"):
            get_codec(name, seed=bad)


def test_terngrad_zero_gradient():
    for codec in pair("terngrad"):
        p, y = roundtrip(codec, np.zeros(10, np.float32))
        assert p.sections[1].tolist() == [0.0] and f64(y).tolist() == [0.0] * 10


def test_terngrad_float64_scale_rounds_up():
    # float32(0.7) = 0.69999998...: s must be the float32 just above, so |g| / s <= 1.
    codec = get_codec("terngrad")
    p = codec.encode(np.array([0.7, -0.05]), "g")
    s = float(p.sections[1][0])
    assert s > 0.7 and np.float32(s) == np.nextafter(np.float32(0.7), np.float32(1))
    assert kq.round_up_float32(0.1) == np.float32(0.1)  # float32(0.1) is already above
    assert kq.round_up_float32(1e39) == np.inf and kq.round_down_float32(-1e39) == -np.inf


def run_stages(codecs, grads, name="g", prescale=1.0):
    """Drive one reduce_stages generator per simulated rank, reducing by hand."""
    gens = [c.reduce_stages(x, name, len(codecs), prescale) for c, x in zip(codecs, grads)]
    sent = [next(g) for g in gens]
    results = []
    while True:
        arrays, ops = zip(*sent)
        assert len(set(ops)) == 1
        red = np.max(arrays, axis=0) if ops[0] == "max" else np.sum(arrays, axis=0).astype(
            arrays[0].dtype)
        nxt = []
        for g in gens:
            try:
                nxt.append(g.send(red))
            except StopIteration as stop:
                results.append(stop.value)
        if results:
            assert len(results) == len(gens)
            return results, sent
        sent = nxt


def test_terngrad_summable_two_ranks():
    g0 = np.array([1.0, -0.5], np.float32)
    g1 = np.array([0.2, 0.1], np.float32)
    total = np.zeros(2)
    n = 4000
    for seed in range(n):
        c0, c1 = get_codec("terngrad", seed=seed), get_codec("terngrad", seed=seed)
        c1.rank = 1
        gens = [c0.reduce_stages(g0, "w", 2), c1.reduce_stages(g1, "w", 2)]
        (m0, op0), (m1, op1) = next(gens[0]), next(gens[1])
        assert op0 == op1 == "max" and m0.dtype == np.float32 and m0.shape == (1,)
        shared = np.maximum(m0, m1)
        assert shared.tolist() == [1.0]
        (t0, s0), (t1, s1) = gens[0].send(shared), gens[1].send(shared)
        assert s0 == s1 == "sum" and t0.dtype == t1.dtype == np.int8
        assert set(t0.tolist()) <= {-1, 0, 1} and set(t1.tolist()) <= {-1, 0, 1}
        assert t0[0] == 1  # |g| = s is always kept
        summed = t0 + t1
        outs = []
        for gen in gens:
            with pytest.raises(StopIteration) as stop:
                gen.send(summed)
            outs.append(stop.value.value)
        (r0, fb0), (r1, fb1) = outs
        assert fb0 is None and fb1 is None
        assert r0.dtype == np.float32 and r0.tobytes() == r1.tobytes()
        total += r0 / 2
    assert np.abs(total / n - [0.6, -0.2]).max() < 0.03


def test_terngrad_summable_exact_and_dtypes():
    # Elements with |g| in {0, s} are deterministic: t0 = [1, -1, 0], t1 = [-1, 0, 0].
    for dtype in DTYPES:
        g0 = np.array([1.0, -1.0, 0.0], dtype)
        g1 = np.array([-1.0, 0.0, 0.0], dtype)
        res, _ = run_stages([get_codec("terngrad"), get_codec("terngrad")], [g0, g1],
                            prescale=0.5)
        for r, fb in res:
            assert r.dtype == np.dtype(dtype) and fb is None
            assert f64(r).tolist() == [0.0, -0.5, 0.0]
    # shape kept, and int16 codes beyond 127 ranks
    gen = get_codec("terngrad").reduce_stages(np.ones((2, 3), np.float64), "w", 200)
    next(gen)
    t, op = gen.send(np.array([1.0], np.float32))
    assert t.dtype == np.int16 and t.shape == (6,) and t.tolist() == [1] * 6
    with pytest.raises(StopIteration) as stop:
        gen.send(t * 200)
    r, _ = stop.value.value
    assert r.shape == (2, 3) and r.dtype == np.float64 and (r == 200.0).all()


def test_terngrad_summable_non_finite_fails_on_every_rank():
    g0 = np.array([1.0, np.nan], np.float32)
    g1 = np.array([0.5, 0.5], np.float32)
    gens = [get_codec("terngrad").reduce_stages(g, "w", 2) for g in (g0, g1)]
    firsts = [next(g) for g in gens]
    assert firsts[0][0].tolist() == [np.inf]
    shared = np.maximum(firsts[0][0], firsts[1][0])
    for gen in gens:
        with pytest.raises(NonFiniteGradientError, match="'w'"):
            gen.send(shared)


def test_terngrad_summable_fast_equals_reference():
    x = np.random.default_rng(9).standard_normal(1001).astype(np.float32)
    for world in (3, 300):
        fast, ref = pair("terngrad", seed=4)
        fast.rank = ref.rank = 2
        outs = []
        for c in (fast, ref):
            gen = c.reduce_stages(x, "w", world)
            m, _ = next(gen)
            t, _ = gen.send(m)
            outs.append((m.tobytes(), t.dtype, t.tobytes()))
        assert outs[0] == outs[1]


# ---------------------------------------------------------------------------- qsgd
def test_qsgd_exact_when_levels_hit_integers():
    g = np.array([3.0, -4.0], np.float32)  # ||g|| = 5; with s = 5, r = [3, 4] exactly
    for fast in (True, False):
        codec = get_codec("qsgd", levels=5)
        codec.use_fast_path = fast
        p, y = roundtrip(codec, g)
        norm, signs, levels = p.sections
        assert norm.tolist() == [5.0] and signs.tolist() == [0b01000000]
        assert levels.tolist() == [3, 4]
        assert y.tolist() == [3.0, -4.0]


def test_qsgd_unbiased():
    g = np.array([0.5, -1.0, 0.25, 0.0], np.float32)
    codec = get_codec("qsgd", levels=2, seed=3)
    draws = np.array([codec.decode(codec.encode(g, "g")) for _ in range(6000)])
    assert np.abs(draws.mean(axis=0) - g).max() < 0.03
    assert (draws[:, 3] == 0).all()
    norm = np.float32(np.sqrt(1.3125))
    # each decoded element is norm / s times an integer level in [0, s]
    assert np.allclose(np.unique(np.abs(draws[:, 1])), [0.5 * norm, norm], rtol=1e-6)


def test_qsgd_8_elements_one_sign_byte_and_levels_bound():
    codec = get_codec("qsgd", levels=255)
    x = np.random.default_rng(1).standard_normal(8).astype(np.float32)
    p = codec.encode(x, "g")
    assert p.sections[1].size == 1 and p.sections[2].size == 8
    assert int(p.sections[2].max()) <= 255
    one = get_codec("qsgd", levels=1).encode(np.array([7.0, 0, 0]), "g")
    assert one.sections[2].tolist() == [1, 0, 0]  # |g| = ||g||: the top level, always


@pytest.mark.parametrize("bad", [0, 256, -3, 1.5, "3", True, None])
def test_qsgd_levels_validation(bad):
    with pytest.raises(CodecError, match="levels"):
        get_codec("qsgd", levels=bad)


def test_qsgd_state_and_float64_overflow_safe_norm():
    codec = get_codec("qsgd", levels=4)
    codec.encode(np.ones(3), "a")
    codec.encode(np.ones(3), "a")
    assert codec.state_dict() == {"steps": {"a": 2}}
    # squares overflow float64 but the values are finite: the norm is rescaled, and the
    # float32 norm then overflows -> refused as non-finite on the wire
    with pytest.raises(NonFiniteGradientError, match="float32"):
        codec.encode(np.array([1e200, 1e200]), "big")


# -------------------------------------------------------------------- signsgd family
def test_signsgd_exact_values():
    g = np.array([1, -2, 0, -0.0, 3], np.float32)
    for codec in pair("signsgd"):
        p, y = roundtrip(codec, g)
        assert len(p.sections) == 1 and p.sections[0].tolist() == [0b01000000]
        assert y.tolist() == [1, -1, 1, 1, 1]  # zero -> +1


def test_efsignsgd_exact_values():
    for codec in pair("efsignsgd"):
        p, y = roundtrip(codec, np.array([1, -2, 0, 3], np.float32))
        assert p.sections[1].tolist() == [1.5]  # mean |g| = 6 / 4
        assert y.tolist() == [1.5, -1.5, 1.5, 1.5]
        _, z = roundtrip(codec, np.zeros(9, np.float16))
        assert f64(z).tolist() == [0.0] * 9


# ------------------------------------------------------------------------- minmax8
def test_minmax8_exact_codes():
    g = np.array([0.0, 1.0, 0.5, 0.25], np.float32)
    p, y = roundtrip(get_codec("minmax8"), g)
    bounds, codes = p.sections
    assert bounds.tolist() == [0.0, 1.0]
    # 0.5 * 255 = 127.5 rounds to even (128); 0.25 * 255 = 63.75 -> 64
    assert codes.tolist() == [0, 255, 128, 64]
    np.testing.assert_allclose(y, [0, 1, 128 / 255, 64 / 255], rtol=0, atol=1e-7)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_minmax8_constant_is_exact(dtype):
    x = np.full((2, 3), 3.7, dtype)
    p, y = roundtrip(get_codec("minmax8"), x)
    assert p.sections[1].tolist() == [0] * 6
    if dtype == np.float64:  # bounds travel as float32
        assert y.tolist() == [[float(np.float32(3.7))] * 3] * 2
    else:
        assert y.tobytes() == x.tobytes()


def test_minmax8_error_bound():
    x = np.random.default_rng(4).standard_normal(5000).astype(np.float32) * 3
    _, y = roundtrip(get_codec("minmax8"), x)
    step = (float(x.max()) - float(x.min())) / 255
    assert np.abs(f64(y) - f64(x)).max() <= step / 2 * (1 + 1e-4)


# ------------------------------------------------------------ error-feedback tracking
def ef_run(codec, memory, steps=50, n=257):
    """Run ``steps`` steps of g_t = mu + noise through memory + codec; return sums."""
    rng = np.random.default_rng(11)
    mu = rng.standard_normal(n).astype(np.float32) * 0.1
    sum_g, sum_dec = np.zeros(n), np.zeros(n)
    for _ in range(steps):
        g = mu + 0.1 * rng.standard_normal(n).astype(np.float32)
        c = memory.compensate("w", g)
        d = codec.decode(codec.encode(c, "w"))
        memory.update("w", c, d)
        sum_g += g
        sum_dec += d
    return sum_g, sum_dec


@pytest.mark.parametrize("name,kw", [("onebit", {}), ("tbq", {"threshold": 0.3}),
                                     ("efsignsgd", {})])
def test_error_feedback_tracks_sum(name, kw):
    from hipress.memory.base import NoMemory

    codec, mem = get_codec(name, **kw), ResidualMemory()
    assert codec.error_feedback
    sum_g, sum_dec = ef_run(codec, mem)
    e = f64(mem.get("w"))
    np.testing.assert_allclose(sum_dec + e, sum_g, rtol=0, atol=1e-4)  # telescoping sum
    rel = np.linalg.norm(sum_dec - sum_g) / np.linalg.norm(sum_g)
    assert rel < 0.15  # the one residual left is small against 50 steps of gradient
    sum_g0, sum_dec0 = ef_run(get_codec(name, **kw), NoMemory())
    rel_without = np.linalg.norm(sum_dec0 - sum_g0) / np.linalg.norm(sum_g0)
    assert rel < 0.5 * rel_without  # and error feedback is what makes it small


# ------------------------------------------------------------- fast path vs reference
@pytest.mark.parametrize("name,kw", FAST)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_fast_path_bit_identical(name, kw, dtype):
    rng = np.random.default_rng(len(name) * 1000 + len(DTYPES))
    fast, ref = pair(name, **kw)
    sizes = list(range(1, 40)) + [1000, 4099]
    for n in sizes:
        x = rng.standard_normal(n)
        if n > 30:
            span = 6 if np.dtype(dtype).itemsize >= 4 else 3
            x *= 10.0 ** rng.integers(-span, span, n)  # wide range: summation order matters
            x[::7] = 0.0
        x = x.astype(dtype)
        pf, pr = fast.encode(x, "w"), ref.encode(x, "w")
        assert pf.to_bytes() == pr.to_bytes(), n
        yf, yr = fast.decode(pf), ref.decode(pf)
        assert yf.dtype == yr.dtype == np.dtype(dtype) and yf.tobytes() == yr.tobytes(), n


def test_without_numba_codecs_fall_back(monkeypatch):
    x = np.random.default_rng(0).standard_normal(100).astype(np.float32)
    want = {n: get_codec(n, **kw).encode(x, "w").to_bytes() for n, kw in FAST}
    monkeypatch.setattr(kq, "fast_kernels", lambda: None)
    assert kq.fast_input(x)[0] is None
    for n, kw in FAST:
        codec = get_codec(n, **kw)
        p = codec.encode(x, "w")
        assert p.to_bytes() == want[n]
        codec.decode(p)


def test_uniform_stream_is_uniform_and_keyed():
    k = kq.stream_key(0, "w", 0, 0)
    assert k == kq.stream_key(0, "w", 0, 0) != kq.stream_key(0, "w", 0, 1)
    u = kq.uniform_u24(np, 200_001, k)
    assert u.dtype == np.uint64 and u.shape == (200_001,) and int(u.max()) < 2**24
    counts = np.bincount((u >> np.uint64(20)).astype(np.int64), minlength=16)
    assert np.abs(counts / u.size * 16 - 1).max() < 0.03
    other = kq.uniform_u24(np, 200_001, kq.stream_key(0, "w", 0, 1)).astype(np.float64)
    assert abs(np.corrcoef(u.astype(np.float64), other)[0, 1]) < 0.01
    assert kq.uniform_u24(np, 7, k).tolist() == u[:7].tolist()  # prefix-stable


def test_layout_nbytes_matches_hand_count():
    # terngrad, 9 elements: 3 bytes of codes (pad 8) + 1 float32 (pad 8)
    assert get_codec("terngrad").payload_nbytes(9) == layout_nbytes(
        1, [(np.uint8, 3), (np.float32, 1)]) == header_nbytes(1, 2) + 16


# ---------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("name,kw", ALL)
def test_cupy_matches_numpy(name, kw):
    cp = pytest.importorskip("cupy")
    x = np.random.default_rng(6).standard_normal(1003).astype(np.float32)
    pc = get_codec(name, **kw).encode(cp.asarray(x), "w")
    pn = get_codec(name, **kw).encode(x, "w")
    if name in ("onebit", "efsignsgd"):  # float64 sums on the GPU run in another order
        assert pc.sections[0].get().tobytes() == pn.sections[0].tobytes()
        np.testing.assert_allclose(pc.sections[1].get(), pn.sections[1], rtol=1e-6)
    elif name == "qsgd":  # the norm's sum runs in another order: levels may differ by one
        np.testing.assert_allclose(pc.sections[0].get(), pn.sections[0], rtol=1e-6)
        assert pc.sections[1].get().tobytes() == pn.sections[1].tobytes()
        lv = pc.sections[2].get().astype(int) - pn.sections[2].astype(int)
        assert np.abs(lv).max() <= 1 and (lv == 0).mean() > 0.99
    else:
        assert pc.to_bytes() == pn.to_bytes()
    y = get_codec(name, **kw).decode(Payload.from_bytes(pc.to_bytes(), xp=cp))
    assert isinstance(y, cp.ndarray) and y.dtype == np.float32 and y.shape == x.shape


@pytest.mark.gpu
def test_cupy_terngrad_reduce_stages_matches_numpy():
    cp = pytest.importorskip("cupy")
    x = np.random.default_rng(8).standard_normal((31, 3)).astype(np.float32)
    outs = []
    for arr in (x, cp.asarray(x)):
        gen = get_codec("terngrad", seed=2).reduce_stages(arr, "w", 1, 0.5)
        m, _ = next(gen)
        t, _ = gen.send(m)
        with pytest.raises(StopIteration) as stop:
            gen.send(t)
        r, fb = stop.value.value
        assert fb is None and r.shape == x.shape and r.dtype == np.float32
        outs.append((cp.asnumpy(m).tobytes(), cp.asnumpy(t).tobytes(), cp.asnumpy(r).tobytes()))
    assert outs[0] == outs[1]


# ------------------------------------------- fused error-feedback and decode kernels
def _three_step_reference(codec, x, e):
    """The error-feedback step as three separate operations (the definition)."""
    c = np.add(x, e, dtype=e.dtype)
    payload = codec.encode(c, "w")
    decoded = codec.decode(payload)
    return payload, c - decoded.astype(e.dtype)


@pytest.mark.parametrize("name", ["onebit", "tbq"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("n", [1, 7, 8, 9, 16, 17, 33, 1000, 65_537])
def test_fused_error_feedback_equals_three_steps(name, dtype, n):
    rng = np.random.default_rng(n)
    codec = get_codec(name, **({"threshold": 0.5} if name == "tbq" else {}))
    x = rng.standard_normal(n).astype(dtype)
    e0 = (0.3 * rng.standard_normal(n)).astype(dtype)
    ref_payload, ref_e = _three_step_reference(codec, x, e0)
    mem = ResidualMemory()
    mem.load_state_dict({"w": e0})
    payload, decoded = mem.encode(codec, "w", x)
    assert payload.to_bytes() == ref_payload.to_bytes()
    assert np.array_equal(mem.get("w"), ref_e)
    if decoded is not None:  # codecs without a fused kernel hand back their decode
        assert np.array_equal(decoded, codec.decode(ref_payload))
    # decode_add / decode_into equal decode followed by the add / the scaled store
    acc = rng.standard_normal(n).astype(dtype)
    want = acc + codec.decode(ref_payload)
    codec.decode_add(payload, acc)
    assert np.array_equal(acc, want)
    for divisor in (1, 3, 4):
        out = np.empty(n, dtype)
        codec.decode_into(payload, out, divisor)
        assert np.array_equal(out, (codec.decode(ref_payload) / dtype(divisor)).astype(dtype))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("n", [1, 7, 8, 9, 15, 16, 17, 33, 1000, 65_537])
def test_deferred_onebit_equals_three_steps_over_steps(dtype, n):
    """finite=True keeps c and the sent bits; every payload and every residual read (get,
    state_dict, the three-step path taking over) equals the three separate steps."""
    rng = np.random.default_rng(n)
    codec = get_codec("onebit")
    e = (0.3 * rng.standard_normal(n)).astype(dtype)
    mem = ResidualMemory()
    mem.load_state_dict({"w": e})
    for step in range(5):
        x = rng.standard_normal(n).astype(dtype)
        ref_payload, e = _three_step_reference(codec, x, e)
        payload, decoded = mem.encode(codec, "w", x, finite=step != 3)
        assert decoded is None
        assert payload.to_bytes() == ref_payload.to_bytes(), step
        if step == 1:  # a checkpoint between steps settles copies, not the state
            assert np.array_equal(mem.state_dict()["w"], e)
        if step == 2:
            assert np.array_equal(mem.get("w"), e)
    assert np.array_equal(mem.state_dict()["w"], e)
    assert np.array_equal(mem.get("w"), e)


def test_deferred_onebit_state_follows_resets_and_loads():
    codec = get_codec("onebit")
    x = np.linspace(-1, 2, 50, dtype=np.float32)
    mem = ResidualMemory()
    mem.encode(codec, "a#p0", x, finite=True)
    mem.encode(codec, "b#p0", x, finite=True)
    assert mem.reset_prefix("a#") == 1
    mem.reset("b#p0")
    # nothing deferred survives: a fresh residual of zeros encodes as the first step did
    ref_payload, ref_e = _three_step_reference(codec, x, np.zeros(50, np.float32))
    payload, _ = mem.encode(codec, "a#p0", x, finite=True)
    assert payload.to_bytes() == ref_payload.to_bytes()
    assert np.array_equal(mem.get("a#p0"), ref_e)
    mem.encode(codec, "a#p0", x, finite=True)
    e1 = np.full(50, 0.25, np.float32)
    mem.load_state_dict({"a#p0": e1})
    ref_payload, ref_e = _three_step_reference(codec, x, e1)
    payload, _ = mem.encode(codec, "a#p0", x, finite=True)
    assert payload.to_bytes() == ref_payload.to_bytes()
    assert np.array_equal(mem.get("a#p0"), ref_e)


def test_deferred_onebit_resets_residual_on_overflow():
    """x + e beyond float32 cannot be undone in one pass: the error says the residual was
    reset, and it is zero."""
    mem = ResidualMemory()
    mem.load_state_dict({"w": np.array([3e38, 1.0, -1.0], np.float32)})
    with pytest.raises(NonFiniteGradientError, match="'w'.*reset to zero"):
        mem.encode(get_codec("onebit"), "w", np.array([3e38, 1.0, 2.0], np.float32),
                   finite=True)
    assert np.array_equal(mem.get("w"), np.zeros(3, np.float32))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("n", [1, 8, 9, 17, 1000, 65_537])
@pytest.mark.parametrize("parts", [1, 2, 3, 4, 5, 7])
def test_merge_encode_equals_decode_sum_then_encode(dtype, n, parts):
    """The aggregator's fused pass: same bytes and residuals as decoding the payloads,
    adding them in order and encoding the sum with error feedback, step after step."""
    rng = np.random.default_rng(n + parts)
    codec = get_codec("onebit")
    fused, ref = ResidualMemory(), ResidualMemory()
    for step in range(3):
        payloads = [codec.encode(rng.standard_normal(n).astype(dtype), "w")
                    for _ in range(parts)]
        acc = codec.decode(payloads[0]).astype(dtype)
        for p in payloads[1:]:
            acc += codec.decode(p)
        want, _ = ref.encode(codec, "w@agg", acc)
        got = fused.merge_encode(codec, "w@agg", payloads)
        assert got.to_bytes() == want.to_bytes(), step
        assert np.array_equal(fused.state_dict()["w@agg"], ref.get("w@agg"))
    assert np.array_equal(fused.get("w@agg"), ref.get("w@agg"))


_CACHE_PROBE = """
import types
import numpy as np
from hipress.codecs import get_codec
from hipress.codecs import _kernels_quant as kq
from hipress.memory.base import ResidualMemory

x = np.random.default_rng(0).standard_normal(1000).astype(np.float32)
for name in ("onebit", "terngrad", "tbq"):
    codec = get_codec(name)
    codec.decode(codec.encode(x, "w"))
    mem = ResidualMemory()
    mem.encode(codec, "w", x)
    mem.encode(codec, "w", x)
onebit = get_codec("onebit")
state = np.zeros_like(x)
payload, pending = onebit.encode_residual_deferred(x, state, None)
onebit.encode_residual_deferred(x, state, pending)
payloads = [onebit.encode(x * s, "w") for s in (1, -2, 3, 5, 7)]
ResidualMemory().merge_encode(onebit, "w", payloads[:4])
ResidualMemory().merge_encode(onebit, "w", payloads)
out = np.zeros_like(x)
onebit.decode_into(payloads[0], out, 2)
onebit.decode_add(payloads[0], out)
kernels = []
for v in vars(kq.fast_kernels()).values():
    kernels += list(v.values()) if isinstance(v, dict) else [v]
kernels = [k for k in kernels if hasattr(k, "stats")]
print(sum(sum(k.stats.cache_hits.values()) for k in kernels),
      sum(sum(k.stats.cache_misses.values()) for k in kernels))
"""


def test_kernels_load_from_the_disk_cache_in_a_new_process(tmp_path):
    """Every kernel closes over dispatchers, which pickled with a random UUID per process,
    so Numba's cache key changed in each process: every worker compiled all its kernels
    again (about 5 s for onebit, TernGrad and TBQ here) and ``__pycache__`` grew."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path))
    runs = [subprocess.run([sys.executable, "-c", _CACHE_PROBE], env=env, check=True,
                           capture_output=True, text=True, timeout=300).stdout.split()
            for _ in range(2)]
    (hits0, misses0), (hits1, misses1) = [tuple(map(int, r)) for r in runs]
    assert hits0 == 0 and misses0 >= 10  # a cold cache compiles each kernel it calls
    assert (hits1, misses1) == (misses0, 0)  # a new process loads every one of them
    # the second process wrote no new cache entries
    first = sorted(p.name for p in tmp_path.rglob("*.nbc"))
    subprocess.run([sys.executable, "-c", _CACHE_PROBE], env=env, check=True,
                   capture_output=True, timeout=300)
    assert sorted(p.name for p in tmp_path.rglob("*.nbc")) == first


def test_merge_encode_compiles_once_whatever_mix_of_received_and_own_payloads():
    """Received payloads are read-only, the aggregator's own is writable, at the rank's
    position: each mix compiled the kernel anew (3-5 s each, mid-training). One now."""
    codec = get_codec("onebit")
    mem = ResidualMemory()
    kernel = kq.fast_kernels().onebit_merge_encoders[4, False]
    own = [codec.encode(np.full(40, v, np.float32), "w") for v in (1.0, -2.0, 3.0, 0.5)]
    got = [Payload.from_bytes(bytes(p.to_bytes()), numel=40) for p in own]
    mem.merge_encode(codec, "w", got)
    compiled = len(kernel.signatures)
    for mix in ([own[0]] + got[1:], got[:3] + [own[3]], own, got[:1] + own[1:2] + got[2:3]):
        mem.merge_encode(codec, "w", mix)
    assert len(kernel.signatures) == compiled


def test_merge_encode_declines_what_it_cannot_fuse():
    codec = get_codec("onebit")
    mem = ResidualMemory()
    p32 = codec.encode(np.ones(16, np.float32), "w")
    p64 = codec.encode(np.ones(16, np.float64), "w")
    assert mem.merge_encode(codec, "w", [p32, p64]) is None  # mixed dtypes
    assert mem.merge_encode(codec, "v", [p32, codec.encode(np.ones(8, np.float32))]) is None
    assert mem.merge_encode(get_codec("terngrad"), "u", [p32]) is None  # no fused kernel
    assert ResidualMemory(beta=0.5).merge_encode(codec, "w", [p32]) is None


def test_fused_onebit_leaves_residual_on_non_finite():
    x = np.array([1.0, np.inf, -2.0], np.float32)
    e0 = np.array([0.5, 0.25, -0.5], np.float32)
    mem = ResidualMemory()
    mem.load_state_dict({"w": e0})
    with pytest.raises(NonFiniteGradientError, match="'w'"):
        mem.encode(get_codec("onebit"), "w", x)
    assert np.array_equal(mem.get("w"), e0)


def test_fused_onebit_skips_mixed_dtypes():
    """float16 gradients with a float32 residual take the three-step path (same bytes)."""
    codec = get_codec("onebit")
    x = np.linspace(-1, 1, 37, dtype=np.float16)
    assert codec.encode_residual(x, np.zeros(37, np.float32), "w") is None
    ref_payload, ref_e = _three_step_reference(codec, x, np.zeros(37, np.float32))
    mem = ResidualMemory()
    payload, decoded = mem.encode(codec, "w", x)
    assert decoded is not None
    assert payload.to_bytes() == ref_payload.to_bytes()
    assert np.array_equal(mem.get("w"), ref_e)
