"""Built-in codec names on device arrays run CompLL's generated kernels, bit for bit.

``Codec._device_codec`` sends the encode and decode of CuPy arrays to the generated codec
``compll.<device_kernels>``. No GPU runs here, so these tests route NumPy arrays the same
way (``_routes_to_device`` patched to say yes) and check what the routing owes the
hand-written codec on any device: the same payload bytes and codec id, the same decoded
values, one set of step counters (random streams and checkpoints), the rank from
``bind``, and the hand-written code wherever the kernels do not apply. The generated
kernels' GPU side is checked by ``bench/gpu_check.py`` on a CUDA machine.
"""

from __future__ import annotations

import logging
import pickle

import numpy as np
import pytest

from hipress.backend import GRADIENT_DTYPES
from hipress.codecs import base, get_codec

BF16 = next(d for d in GRADIENT_DTYPES if d.name == "bfloat16")
DTYPES = [np.dtype(np.float32), np.dtype(np.float16), BF16]
CASES = [
    ("onebit", {}),
    ("tbq", {"threshold": 0.5}),
    ("terngrad", {"seed": 7}),
    ("dgc", {"ratio": 0.01, "sample_ratio": 0.05, "momentum": 0.8}),
    ("graddrop", {"drop_ratio": 0.9, "sample_ratio": 0.01, "seed": 3}),
]


@pytest.fixture
def routed(monkeypatch):
    """Route NumPy arrays to the device kernels, as CuPy arrays are."""
    monkeypatch.setattr(base, "_routes_to_device", lambda xp: True)


def encode_twice(codec, x, name):
    """Two encodes of one gradient (stochastic codecs advance their step counter)."""
    return [codec.encode(x, name) for _ in range(2)]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("name,params", CASES, ids=[c[0] for c in CASES])
def test_routed_codec_matches_the_hand_written_one_bit_for_bit(monkeypatch, name, params,
                                                                dtype):
    rng = np.random.default_rng(5)
    x = (rng.standard_normal(30011) * 3).astype(dtype)
    ref = get_codec(name, **params)
    fast = get_codec(name, **params)
    for c in (ref, fast):
        c.bind(1, 4)
    want = encode_twice(ref, x, "layer.weight")
    monkeypatch.setattr(base, "_routes_to_device", lambda xp: True)
    got = encode_twice(fast, x, "layer.weight")
    kernels = base._DEVICE_CODECS.get(fast)
    if dtype.name in type(ref).device_dtypes:
        assert type(kernels).__name__ == f"CompLL_{name}"
    else:  # the sparsifiers' values travel in half precision, the kernels' in float32
        assert name in ("dgc", "graddrop") and kernels is None
    for p, q in zip(got, want):
        assert p.codec_id == q.codec_id == type(ref).codec_id
        assert p.to_bytes() == q.to_bytes()
        out = fast.decode(p)
        assert out.dtype == dtype and out.tobytes() == ref.decode(q).tobytes()
    assert fast.state_dict() == ref.state_dict()


def test_float64_and_numpy_arrays_stay_on_the_hand_written_code(monkeypatch):
    codec = get_codec("onebit")
    x = np.linspace(-1, 1, 1001)
    codec.encode(x.astype(np.float32), "g")  # not routed: NumPy
    assert codec not in base._DEVICE_CODECS
    monkeypatch.setattr(base, "_routes_to_device", lambda xp: True)
    codec.encode(x, "g")  # float64: the kernels read float32, so no
    assert codec not in base._DEVICE_CODECS
    assert get_codec("fp16")._device_codec(np, np.float32) is None  # no kernels declared


def test_step_counters_are_the_codecs_after_a_checkpoint_restore(routed):
    codec = get_codec("terngrad", seed=2)
    x = np.random.default_rng(0).standard_normal(5000).astype(np.float32)
    codec.encode(x, "g")
    state = codec.state_dict()
    assert state == {"steps": {"g": 1}}
    codec.encode(x, "g")
    codec.load_state_dict(state)  # back to step 1: the next encode repeats the second one
    again = codec.encode(x, "g")
    twin = get_codec("terngrad", seed=2)
    twin.load_state_dict(state)
    assert again.to_bytes() == twin.encode(x, "g").to_bytes()
    assert codec.state_dict() == {"steps": {"g": 2}}


def test_a_routed_codec_pickles_without_its_kernels(routed):
    codec = get_codec("onebit")
    codec.encode(np.ones(100, np.float32), "g")
    assert codec in base._DEVICE_CODECS
    copy = pickle.loads(pickle.dumps(codec))
    assert copy not in base._DEVICE_CODECS
    assert copy.encode(np.ones(100, np.float32), "g").to_bytes() == codec.encode(
        np.ones(100, np.float32), "g").to_bytes()


def test_kernels_that_fail_to_load_leave_the_hand_written_code_and_say_so(routed, caplog,
                                                                          monkeypatch):
    monkeypatch.setattr(base, "_DEVICE_FAILED", {})

    class Broken(type(get_codec("tbq"))):
        device_kernels = "no_such_spec"

    codec = Broken(threshold=0.5)
    x = np.random.default_rng(1).standard_normal(999).astype(np.float32)
    with caplog.at_level(logging.WARNING, logger="hipress.codecs.base"):
        p = codec.encode(x, "g")
        codec.encode(x, "g")
    assert p.to_bytes() == get_codec("tbq", threshold=0.5).encode(x, "g").to_bytes()
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "compll.no_such_spec" in warnings[0], warnings


@pytest.mark.gpu
@pytest.mark.parametrize("name,params", CASES, ids=[c[0] for c in CASES])
def test_cupy_arrays_run_the_generated_kernels(name, params):
    cp = pytest.importorskip("cupy")
    x = np.random.default_rng(9).standard_normal(1 << 20).astype(np.float32)
    codec, ref = get_codec(name, **params), get_codec(name, **params)
    pc, pn = codec.encode(cp.asarray(x), "w"), ref.encode(x, "w")
    assert type(base._DEVICE_CODECS.get(codec)).__name__ == f"CompLL_{name}"
    assert pc.codec_id == pn.codec_id
    assert all(isinstance(a, cp.ndarray) for a in pc.sections)
    if name in ("dgc", "graddrop"):  # sampled thresholds: the GPU samples its own way
        idx, vals = (a.get() for a in pc.sections)
        assert np.all(np.diff(idx) > 0) and np.array_equal(vals, x[idx])
        chosen = np.zeros(x.size, bool)
        chosen[idx] = True
        assert np.abs(x[chosen]).min() >= np.abs(x[~chosen]).max()
    for i, (a, b) in enumerate(zip(pc.sections, pn.sections)):
        if name == "onebit" and i == 1:  # the means' sums run in another order on the GPU
            np.testing.assert_allclose(a.get(), b, rtol=1e-6)
        elif name in ("onebit", "tbq", "terngrad"):
            assert a.get().tobytes() == b.tobytes(), (name, i)
    y = codec.decode(pc)
    assert isinstance(y, cp.ndarray) and y.dtype == np.float32 and y.shape == x.shape


def test_the_kernels_do_not_keep_their_codec_alive(routed):
    import gc

    codec = get_codec("terngrad", seed=1)
    codec.encode(np.ones(64, np.float32), "g")
    assert len([c for c in base._DEVICE_CODECS if c is codec]) == 1
    del codec
    gc.collect()
    assert not any(type(c).__name__ == "TernGradCodec" and c.seed == 1
                   for c in base._DEVICE_CODECS)
