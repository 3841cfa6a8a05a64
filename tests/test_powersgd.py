"""PowerSGD codec: the compress rule, the matrix view, the two-round reduction, state."""

from __future__ import annotations

import pickle
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from hipress.backend import bfloat16
from hipress.codecs import get_codec, ops
from hipress.codecs.base import Payload
from hipress.codecs.powersgd import PowerSGDCodec, low_rank_product, matrix_view, orthogonalize
from hipress.errors import CodecError, NonFiniteGradientError
from hipress.memory import ResidualMemory


def drive(gen, reduce=None):
    """Run a reduce_stages generator; ``reduce`` maps the yielded array to the reduced one."""
    arr, op = next(gen)
    ops_seen = [op]
    while True:
        assert op == "sum"
        try:
            arr, op = gen.send(reduce(arr) if reduce else np.array(arr, copy=True))
            ops_seen.append(op)
        except StopIteration as stop:
            return stop.value, ops_seen


def drive_ranks(gens):
    """Drive one generator per simulated rank together; the reduction is a plain sum."""
    yielded = [next(g) for g in gens]
    rounds = []
    while True:
        assert all(op == "sum" for _, op in yielded)
        total = yielded[0][0].copy()
        for arr, _ in yielded[1:]:
            total = total + arr
        rounds.append([a.copy() for a, _ in yielded])
        outs = []
        for g in gens:
            try:
                outs.append(("y", g.send(total.copy())))
            except StopIteration as stop:
                outs.append(("r", stop.value))
        kinds = {k for k, _ in outs}
        assert len(kinds) == 1, "ranks disagree on the number of rounds"
        if kinds == {"r"}:
            return [v for _, v in outs], rounds
        yielded = [v for _, v in outs]


def gram_schmidt64(a):
    a = np.array(a, dtype=np.float64, copy=True)
    for i in range(a.shape[1]):
        a[:, i] /= np.linalg.norm(a[:, i])
        for j in range(i + 1, a.shape[1]):
            a[:, j] -= (a[:, i] @ a[:, j]) * a[:, i]
    return a


def initial_q64(seed, name, n, r):
    g = ops.rng_for(np, seed, name, 0, rank=0).standard_normal((n, r))
    return gram_schmidt64(g)


# ---------------------------------------------------------------------- the rule
@pytest.mark.parametrize(
    "shape, rank, rate, compressed",
    [
        ((2, 2), 1, 2.0, False),
        ((64, 64), 1, 2.0, True),
        ((4, 4), 1, 2.0, False),  # (4 + 4) * 1 * 2 = 16, not < 16: equality stays raw
        ((4, 5), 1, 2.0, True),  # 18 < 20
        ((3, 6), 1, 2.0, False),  # 18 == 18
        ((64, 64), 16, 2.0, False),  # 128 * 16 * 2 = 4096, not < 4096
        ((64, 64), 15, 2.0, True),  # 3840 < 4096
        ((64, 64), 1, 32.0, False),  # 128 * 32 = 4096
        ((64, 64), 1, 31.9, True),
        ((4096,), 1, 2.0, False),  # 1-D never
        ((1_000_000,), 1, 0.001, False),
        ((), 1, 2.0, False),
        ((2, 3, 100), 1, 2.0, False),  # viewed as (2, 300): 302 * 2 = 604, not < 600
        ((8, 4, 4, 2), 1, 2.0, True),  # viewed as (8, 32): 80 < 256
    ],
)
def test_compress_rule(shape, rank, rate, compressed):
    c = PowerSGDCodec(rank=rank, min_compression_rate=rate)
    dims = c.compressed_dims(shape)
    assert (dims is not None) is compressed
    layout = c.payload_layout(shape, np.float32)
    if compressed:
        m, n = matrix_view(shape)
        assert dims == (m, n)
        assert layout == [(np.dtype(np.float32), m * rank), (np.dtype(np.float32), n * rank)]
    else:
        assert layout == [(np.dtype(np.float32), int(np.prod(shape)))]


def test_payload_sizes_exact():
    c = PowerSGDCodec()
    # header: pad8(8 + 2 * 8 + 1 + 2 * 9) = 48, then P and Q: 64 float32 each (256 B).
    assert c.payload_nbytes((64, 64)) == 48 + 256 + 256
    assert c.payload_nbytes((2, 2)) == 40 + 16  # pad8(8 + 16 + 1 + 9) = 40, raw 16 B
    assert c.compression_ratio((64, 64)) == pytest.approx(64 * 64 * 4 / 560)
    x = np.ones((64, 64), np.float32)
    p = c.encode(x, "w")
    assert p.nbytes == len(p.to_bytes()) == 560


def test_matrix_view():
    assert matrix_view((5,)) is None
    assert matrix_view(()) is None
    assert matrix_view((3, 4)) == (3, 4)
    assert matrix_view((8, 4, 4, 2)) == (8, 32)
    assert matrix_view((2, 3, 100)) == (2, 300)


def test_ndim_gt2_is_the_shape0_rest_matrix():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((8, 4, 4, 2)).astype(np.float32)
    a = PowerSGDCodec(rank=2)
    b = PowerSGDCodec(rank=2)
    pa = a.encode(x, "conv")
    pb = b.encode(x.reshape(8, 32), "conv")
    assert pa.shape == (8, 4, 4, 2)
    assert [s.size for s in pa.sections] == [8 * 2, 32 * 2]
    for sa, sb in zip(pa.sections, pb.sections):
        np.testing.assert_array_equal(sa, sb)
    da = a.decode(pa)
    assert da.shape == x.shape and da.dtype == np.float32
    np.testing.assert_array_equal(da.reshape(8, 32), b.decode(pb))


# ------------------------------------------------------------------ the maths
def test_rank1_matrix_is_recovered():
    rng = np.random.default_rng(2)
    u = rng.standard_normal(40)
    v = rng.standard_normal(30)
    x = np.outer(u, v)
    c = PowerSGDCodec(rank=1)
    y = c.decode(c.encode(x, "w"))  # P and Q travel as float32
    np.testing.assert_allclose(y, x, rtol=0, atol=1e-6 * np.abs(x).max())
    (result, _), _ = drive(PowerSGDCodec(rank=1).reduce_stages(x, "w", 1, 1.0))
    np.testing.assert_allclose(result, x, rtol=0, atol=1e-12 * np.abs(x).max())


def test_payload_p_has_orthonormal_columns():
    x = np.random.default_rng(3).standard_normal((50, 20)).astype(np.float32)
    p = PowerSGDCodec(rank=3).encode(x, "w")
    pm = p.sections[0].reshape(50, 3).astype(np.float64)
    np.testing.assert_allclose(pm.T @ pm, np.eye(3), atol=1e-5)


def test_orthogonalize_zero_column_stays_zero():
    p = np.zeros((6, 2), np.float32)
    p[:, 1] = np.arange(6)
    out = orthogonalize(p)
    np.testing.assert_array_equal(out[:, 0], 0)
    assert np.linalg.norm(out[:, 1]) == pytest.approx(1.0, rel=1e-6)


def test_orthogonalize_epsilon():
    p = np.array([[3.0], [4.0]])
    np.testing.assert_allclose(orthogonalize(p.copy(), 1.0)[:, 0], [0.5, 4 / 6])


def test_low_rank_product_matches_matmul():
    rng = np.random.default_rng(4)
    p = rng.standard_normal((7, 3))
    q = rng.standard_normal((5, 3))
    np.testing.assert_allclose(low_rank_product(p, q), p @ q.T, rtol=1e-13, atol=1e-13)


def test_zero_gradient_gives_zeros():
    c = PowerSGDCodec(rank=2)
    x = np.zeros((32, 32), np.float32)
    np.testing.assert_array_equal(c.decode(c.encode(x, "z")), 0)
    (res, fb), _ = drive(c.reduce_stages(x, "z2", 1, 1.0))
    np.testing.assert_array_equal(res, 0)
    np.testing.assert_array_equal(fb, 0)


def test_nonfinite_is_refused():
    x = np.ones((32, 32), np.float32)
    x[3, 4] = np.nan
    c = PowerSGDCodec()
    with pytest.raises(NonFiniteGradientError, match="'bad'"):
        c.encode(x, "bad")
    with pytest.raises(NonFiniteGradientError):
        next(c.reduce_stages(x, "bad", 2, 0.5))


def test_encode_equals_single_rank_reduction():
    x = np.random.default_rng(5).standard_normal((24, 40)).astype(np.float32)
    a, b = PowerSGDCodec(rank=2, seed=9), PowerSGDCodec(rank=2, seed=9)
    for _ in range(3):
        y = a.decode(a.encode(x, "w"))
        (res, fb), rounds = drive(b.reduce_stages(x, "w", 1, 1.0))
        assert rounds == ["sum", "sum"]
        np.testing.assert_array_equal(y, res)
        assert fb is res
    np.testing.assert_array_equal(a.state_dict()["w"], b.state_dict()["w"])


def test_two_rank_reduction_matches_hand_computation():
    rng = np.random.default_rng(6)
    m, n, r = 20, 12, 2
    xs = [rng.standard_normal((m, n)) for _ in range(2)]  # float64: tight comparison
    codecs = [PowerSGDCodec(rank=r, seed=7) for _ in range(2)]
    q = initial_q64(7, "fc.weight", n, r)
    for _step in range(3):
        gens = [c.reduce_stages(x, "fc.weight", 2, 0.5) for c, x in zip(codecs, xs)]
        results, rounds = drive_ranks(gens)
        # hand computation
        p_parts = [0.5 * (x @ q) for x in xs]
        np.testing.assert_allclose(rounds[0][0], p_parts[0], rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(rounds[0][1], p_parts[1], rtol=1e-12, atol=1e-12)
        p_hat = gram_schmidt64(p_parts[0] + p_parts[1])
        q_parts = [0.5 * (x.T @ p_hat) for x in xs]
        np.testing.assert_allclose(rounds[1][0], q_parts[0], rtol=1e-10, atol=1e-12)
        q = q_parts[0] + q_parts[1]
        want = p_hat @ q.T
        for res, fb in results:
            assert res.dtype == np.float64 and res.shape == (m, n)
            np.testing.assert_allclose(res, want, rtol=1e-10, atol=1e-12)
            assert fb is res  # prescale * world_size == 1: the average approximation
        # every rank ends bit-identical, and so does its warm-start Q
        np.testing.assert_array_equal(results[0][0], results[1][0])
        np.testing.assert_array_equal(codecs[0].state_dict()["fc.weight"],
                                      codecs[1].state_dict()["fc.weight"])
        np.testing.assert_allclose(codecs[0].state_dict()["fc.weight"], q, rtol=1e-10, atol=1e-12)
        # the projection onto the reduced P is the best this P allows
        avg = 0.5 * (xs[0] + xs[1])
        np.testing.assert_allclose(want, p_hat @ p_hat.T @ avg, rtol=1e-9, atol=1e-12)
        xs = [x + 0.1 * rng.standard_normal((m, n)) for x in xs]


def test_sum_prescale_feedback_is_average_approximation():
    rng = np.random.default_rng(8)
    xs = [rng.standard_normal((16, 24)).astype(np.float32) for _ in range(3)]
    gens = [PowerSGDCodec().reduce_stages(x, "w", 3, 1.0) for x in xs]
    results, _ = drive_ranks(gens)
    for res, fb in results:
        np.testing.assert_allclose(fb, res / 3, rtol=1e-6, atol=1e-7)
    for res, _ in results[1:]:
        np.testing.assert_array_equal(res, results[0][0])


@pytest.mark.parametrize("dtype", [np.float16, bfloat16, np.float32, np.float64])
def test_uncompressed_path_single_sum(dtype):
    x = np.arange(1, 8, dtype=np.float32).astype(dtype)
    gens = [PowerSGDCodec().reduce_stages(x, "b", 2, 0.5) for _ in range(2)]
    first = next(gens[0])
    assert first[1] == "sum" and first[0].dtype == np.dtype(dtype)
    np.testing.assert_array_equal(first[0].astype(np.float64), np.arange(1, 8) * 0.5)
    results, rounds = drive_ranks([PowerSGDCodec().reduce_stages(x, "b", 2, 0.5)
                                   for _ in range(2)])
    assert len(rounds) == 1
    for res, fb in results:
        assert fb is None and res.dtype == np.dtype(dtype)
        np.testing.assert_array_equal(res.astype(np.float64), np.arange(1, 8, dtype=np.float64))


@pytest.mark.parametrize("dtype", [np.float16, bfloat16, np.float32, np.float64])
def test_dtypes_kept_on_compressed_path(dtype):
    x = np.random.default_rng(9).standard_normal((16, 16)).astype(dtype)
    (res, fb), _ = drive(PowerSGDCodec().reduce_stages(x, "w", 1, 1.0))
    assert res.dtype == np.dtype(dtype) and res.shape == (16, 16)
    c = PowerSGDCodec()
    p = c.encode(x, "w")
    assert [s.dtype for s in p.sections] == [np.dtype(np.float32)] * 2
    y = c.decode(Payload.from_bytes(p.to_bytes()))
    assert y.dtype == np.dtype(dtype) and y.shape == (16, 16)


def test_deterministic_bit_identical():
    x = np.random.default_rng(10).standard_normal((30, 50)).astype(np.float32)
    runs = []
    for _ in range(2):
        c = PowerSGDCodec(rank=3, seed=123)
        runs.append([c.encode(x * (k + 1), "w").to_bytes() for k in range(3)])
    assert runs[0] == runs[1]
    other = PowerSGDCodec(rank=3, seed=124).encode(x, "w").to_bytes()
    assert other != runs[0][0]
    other_name = PowerSGDCodec(rank=3, seed=123).encode(x, "v").to_bytes()
    assert other_name != runs[0][0]


def test_warm_start_improves_fixed_matrix():
    # power iteration: repeated steps on the same matrix converge to its top singular pair
    rng = np.random.default_rng(11)
    x = rng.standard_normal((40, 40)) + 5 * np.outer(rng.standard_normal(40),
                                                      rng.standard_normal(40))
    c = PowerSGDCodec(rank=1)
    errs = [np.linalg.norm(x - c.decode(c.encode(x, "w"))) for _ in range(6)]
    u, s, vt = np.linalg.svd(x)
    best = np.sqrt(np.sum(s[1:] ** 2))
    assert errs[-1] <= errs[0]
    assert errs[-1] == pytest.approx(best, rel=1e-3)


# ------------------------------------------------------------------- params and state
@pytest.mark.parametrize(
    "kwargs",
    [
        {"rank": 0},
        {"rank": 1.5},
        {"rank": True},
        {"min_compression_rate": 0},
        {"min_compression_rate": float("nan")},
        {"min_compression_rate": "x"},
        {"orthogonalization_epsilon": -1e-3},
        {"seed": 1.5},
    ],
)
def test_bad_params(kwargs):
    with pytest.raises(CodecError):
        PowerSGDCodec(**kwargs)
    with pytest.raises(CodecError):
        get_codec("powersgd", **kwargs)


def test_registry_entry():
    c = get_codec("powersgd", rank=2)
    assert isinstance(c, PowerSGDCodec) and c.codec_id == 30 and c.rank == 2
    assert c.summable and c.error_feedback and not c.variable_size
    assert not c.mergeable and not c.stochastic and not c.lossless
    assert c.params() == {"rank": 2, "min_compression_rate": 2.0, "seed": 0,
                          "orthogonalization_epsilon": 0.0}


def test_state_errors():
    c = PowerSGDCodec(rank=2)
    c.encode(np.ones((16, 16), np.float32), "w")
    with pytest.raises(CodecError, match="share a name"):
        c.encode(np.ones((16, 20), np.float32), "w")
    with pytest.raises(CodecError, match="rank"):
        c.load_state_dict({"w": np.zeros((16, 3), np.float32)})
    with pytest.raises(CodecError):
        c.load_state_dict({"w": np.zeros(16, np.int32)})


def test_state_dict_is_a_copy():
    c = PowerSGDCodec()
    c.encode(np.ones((16, 16), np.float32), "w")
    sd = c.state_dict()
    sd["w"][:] = 0
    assert np.any(c.state_dict()["w"] != 0)
    assert pickle.loads(pickle.dumps(sd)).keys() == {"w"}


def _single_rank_step(codec, mem, g, name):
    c = mem.compensate(name, g)
    (result, fb), _ = drive(codec.reduce_stages(c, name, 1, 1.0))
    if fb is not None:
        mem.update(name, c, fb)
    return result


_CHILD = textwrap.dedent(
    """
    import pickle, sys
    import numpy as np
    from hipress.codecs.powersgd import PowerSGDCodec
    from hipress.memory import ResidualMemory
    sys.path.insert(0, sys.argv[3])
    from test_powersgd import _single_rank_step

    with open(sys.argv[1], "rb") as f:
        saved = pickle.load(f)
    codec = PowerSGDCodec(**saved["params"])
    codec.load_state_dict(saved["codec"])
    mem = ResidualMemory()
    mem.load_state_dict(saved["memory"])
    reloaded = {"codec": codec.state_dict(), "memory": mem.state_dict()}
    out = {name: _single_rank_step(codec, mem, g, name) for name, g in saved["grads"].items()}
    with open(sys.argv[2], "wb") as f:
        pickle.dump({"reloaded": reloaded, "out": out, "codec": codec.state_dict(),
                     "memory": mem.state_dict()}, f)
    """
)


def test_checkpoint_in_fresh_process_resumes_bit_identical(tmp_path):
    rng = np.random.default_rng(12)
    shapes = {"fc.weight": (32, 48), "conv.weight": (8, 3, 3, 3), "fc.bias": (32,)}
    steps = [{k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
             for _ in range(3)]
    params = {"rank": 2, "seed": 5}
    codec, mem = PowerSGDCodec(**params), ResidualMemory()
    for k, g in steps[0].items():
        _single_rank_step(codec, mem, g, k)
    for k, g in steps[1].items():
        _single_rank_step(codec, mem, g, k)
    saved = {"params": params, "codec": codec.state_dict(), "memory": mem.state_dict(),
             "grads": steps[2]}
    assert set(saved["codec"]) == {"fc.weight", "conv.weight"}  # the bias is never compressed
    src, dst = tmp_path / "ckpt.pkl", tmp_path / "out.pkl"
    with open(src, "wb") as f:
        pickle.dump(saved, f)
    import pathlib

    tests_dir = str(pathlib.Path(__file__).resolve().parent)
    subprocess.run([sys.executable, "-c", _CHILD, str(src), str(dst), tests_dir], check=True,
                   timeout=120)
    with open(dst, "rb") as f:
        child = pickle.load(f)
    # state comes back bit-identical
    for part in ("codec", "memory"):
        assert child["reloaded"][part].keys() == saved[part].keys()
        for k, v in saved[part].items():
            got = child["reloaded"][part][k]
            assert got.dtype == v.dtype and got.tobytes() == v.tobytes()
    # the next step equals the uninterrupted run's, bit for bit
    for k, g in steps[2].items():
        want = _single_rank_step(codec, mem, g, k)
        assert child["out"][k].tobytes() == want.tobytes(), k
    for k, v in codec.state_dict().items():
        assert child["codec"][k].tobytes() == v.tobytes()
    for k, v in mem.state_dict().items():
        assert child["memory"][k].tobytes() == v.tobytes()


def test_error_feedback_tracks_the_sum():
    rng = np.random.default_rng(13)
    codec, mem = PowerSGDCodec(rank=1), ResidualMemory()
    total_in = np.zeros((16, 24))
    total_out = np.zeros((16, 24))
    for _ in range(20):
        g = rng.standard_normal((16, 24)).astype(np.float32)
        total_in += g
        total_out += _single_rank_step(codec, mem, g, "w")
    np.testing.assert_allclose(total_in - total_out, mem.get("w"), atol=1e-4)
