"""The codec foundation itself: wire header, registry, operator library, residual memory."""

from __future__ import annotations

import pickle
import struct

import numpy as np
import pytest

from hipress.backend import bfloat16
from hipress.codecs import codec_names, get_codec, ops
from hipress.codecs.base import (
    Codec,
    Payload,
    codec_class,
    header_nbytes,
    layout_nbytes,
    register_codec,
)
from hipress.errors import CodecError, NonFiniteGradientError, PayloadError
from hipress.memory import NoMemory, ResidualMemory, get_memory, memory_names


# ------------------------------------------------------------------------ wire header
def test_header_layout_bytes_of_a_known_payload():
    p = get_codec("fp16").encode(np.array([0.1, 0.2, 0.3], dtype=np.float32), "v")
    wire = p.to_bytes()
    want = (
        b"HP"  # magic
        + bytes([1, 0])  # version 1, flags 0
        + struct.pack("<H", 2)  # codec id of fp16
        + bytes([3, 1])  # dtype code of float32, ndim 1
        + struct.pack("<Q", 3)  # shape
        + bytes([1])  # one section
        + bytes([1]) + struct.pack("<Q", 3)  # float16, 3 elements
        + bytes(6)  # padding of the 26-byte header to 32
        + np.array([0.1, 0.2, 0.3], dtype=np.float16).tobytes()
        + bytes(2)  # section padded to 8 bytes
    )
    assert wire == want
    assert len(wire) == p.nbytes == 40
    assert header_nbytes(1, 1) == 32
    assert header_nbytes(0, 0) == 16  # 8 + 1 -> 16
    assert layout_nbytes(1, [(np.float16, 3)]) == 40
    assert layout_nbytes(2, [(np.float32, 64), (np.float32, 64)]) == 48 + 512


def test_payload_round_trip_keeps_everything():
    p = Payload(2, np.dtype(np.float64), (2, 3),
                (np.arange(6, dtype=np.float16), np.arange(3, dtype=np.int64)))
    q = Payload.from_bytes(p.to_bytes())
    assert q.codec_id == 2 and q.dtype == np.float64 and q.shape == (2, 3)
    assert [s.dtype for s in q.sections] == [np.float16, np.int64]
    np.testing.assert_array_equal(q.sections[0], np.arange(6))
    np.testing.assert_array_equal(q.sections[1], np.arange(3))
    assert q.numel == 6


@pytest.mark.parametrize(
    "buf, match",
    [
        (b"HP\x01", "truncated"),
        (b"XX\x01\x00\x01\x00\x03\x00\x00", "magic"),
        (b"HP\x07\x00\x01\x00\x03\x00\x00", "version 7"),
        (b"HP\x01\x00\x01\x00\x77\x00\x00", "dtype code 119"),
        (b"HP\x01\x00\x01\x00\x03\x21\x00", "ndim 33"),
        (b"HP\x01\x00\x01\x00\x03\x01\x00", "inside its shape"),
    ],
)
def test_from_bytes_errors(buf, match):
    with pytest.raises(PayloadError, match=match):
        Payload.from_bytes(buf)


def test_from_bytes_rejects_impossible_shapes():
    for shape in [(2**49,), (2**32, 2**32), (2**25, 2**24)]:
        head = struct.pack("<2sBBHBB", b"HP", 1, 0, 1, 3, len(shape))
        head += b"".join(struct.pack("<Q", d) for d in shape) + b"\0"
        buf = head.ljust(header_nbytes(len(shape), 0), b"\0")
        with pytest.raises(PayloadError, match="impossible shape"):
            Payload.from_bytes(buf)


def test_decode_rejects_integer_gradient_dtype():
    p = Payload(1, np.dtype(np.int32), (3,), (np.arange(3, dtype=np.int32),))
    with pytest.raises(PayloadError, match="int32"):
        get_codec("none").decode(Payload.from_bytes(p.to_bytes()))


def test_encode_rejects_integer_gradients():
    with pytest.raises(TypeError, match="float16, bfloat16, float32 or float64"):
        get_codec("none").encode(np.arange(3), "ints")


# ---------------------------------------------------------------------------- registry
def test_registry_errors_list_valid_names():
    with pytest.raises(CodecError) as info:
        get_codec("no-such-codec")
    for name in codec_names():
        assert name in str(info.value)
    with pytest.raises(CodecError, match="valid codecs"):
        codec_class("nope")


def test_get_codec_bad_params_and_instance():
    with pytest.raises(CodecError, match="bad parameters for codec 'none'"):
        get_codec("none", ratio=0.1)
    c = get_codec("fp16")
    assert get_codec(c) is c
    with pytest.raises(CodecError, match="instance"):
        get_codec(c, ratio=0.1)


class _Dummy(Codec):
    def _encode(self, flat, shape, name):
        return [flat.copy()]

    def _decode(self, sections, shape, dtype):
        return sections[0].copy()

    def _layout(self, shape, dtype):
        return [(dtype, int(np.prod(shape)))]


def test_register_duplicate_name_or_id_rejected():
    before = dict(zip(codec_names(), [codec_class(n) for n in codec_names()]))
    with pytest.raises(CodecError, match="name 'none' is already registered"):
        register_codec("none", codec_id=64999)(type("A", (_Dummy,), {}))
    with pytest.raises(CodecError, match="id 1 is already registered"):
        register_codec("zz-test-unused", codec_id=1)(type("B", (_Dummy,), {}))
    # the registry is unchanged, and re-registering the same class is harmless
    after = dict(zip(codec_names(), [codec_class(n) for n in codec_names()]))
    assert after == before
    cls = codec_class("none")
    assert register_codec("none", cls.codec_id)(cls) is cls


def test_codec_ids_unique_and_stable():
    ids = {n: codec_class(n).codec_id for n in codec_names()}
    assert len(set(ids.values())) == len(ids)
    assert ids["none"] == 1 and ids["fp16"] == 2 and ids["bf16"] == 3 and ids["powersgd"] == 30


def test_state_dict_default_rejects_keys():
    c = get_codec("none")
    assert c.state_dict() == {}
    c.load_state_dict({})
    with pytest.raises(CodecError, match="no state"):
        c.load_state_dict({"x": 1})


# ------------------------------------------------------------------------------- ops
def test_k_for_ratio():
    assert ops.k_for_ratio(0.1, 100) == 10
    assert ops.k_for_ratio(0.1, 5) == 1
    assert ops.k_for_ratio(0.1, 0) == 0
    assert ops.k_for_ratio(1.0, 7) == 7
    assert ops.k_for_ratio(0.999, 10) == 9
    assert ops.k_for_ratio(0.001, 1_000_000) == 1000


def test_check_ratio():
    assert ops.check_ratio(0.5) == 0.5
    assert ops.check_ratio(1) == 1.0
    for bad in (0, -0.1, 1.5, float("nan"), float("inf")):
        with pytest.raises(CodecError, match=r"must be in \(0, 1\]"):
            ops.check_ratio(bad)
    with pytest.raises(CodecError, match=r"compress_ratio must be a number in \(0, 1\], got 'x'"):
        ops.check_ratio("x", "compress_ratio")
    with pytest.raises(CodecError, match="got None"):
        ops.check_ratio(None)


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("n", [0, 1, 3, 7, 8, 9, 17, 100])
def test_pack_codes_round_trip(bits, n):
    codes = np.random.default_rng(n * 10 + bits).integers(0, 2**bits, n, dtype=np.uint8)
    packed = ops.pack_codes(codes, bits)
    assert packed.dtype == np.uint8 and packed.size == -(-n * bits // 8)
    np.testing.assert_array_equal(ops.unpack_codes(packed, bits, n), codes)
    if bits == 1:
        np.testing.assert_array_equal(packed, ops.pack_bits(codes.astype(bool)))
        np.testing.assert_array_equal(ops.unpack_bits(packed, n), codes.astype(bool))


def test_pack_codes_bit_order():
    assert ops.pack_codes(np.array([1, 2, 3], np.uint8), 2).tolist() == [0b01101100]
    assert ops.pack_codes(np.array([0xA, 0x5, 0xF], np.uint8), 4).tolist() == [0xA5, 0xF0]
    assert ops.pack_codes(np.array([1, 0, 0, 0, 0, 0, 0, 1, 1], np.uint8), 1).tolist() == [
        0x81, 0x80]
    with pytest.raises(CodecError, match="1, 2, 4 or 8"):
        ops.pack_codes(np.zeros(3, np.uint8), 3)
    with pytest.raises(CodecError, match="1, 2, 4 or 8"):
        ops.unpack_codes(np.zeros(3, np.uint8), 5, 3)


def test_rng_for_is_a_function_of_its_arguments():
    a = ops.rng_for(np, 1, "w", 3).random(5)
    np.testing.assert_array_equal(a, ops.rng_for(np, 1, "w", 3).random(5))
    for other in [(2, "w", 3, 0), (1, "v", 3, 0), (1, "w", 4, 0), (1, "w", 3, 1)]:
        assert not np.array_equal(a, ops.rng_for(np, *other).random(5))
    assert ops.name_key("fc.weight") == ops.name_key("fc.weight")


def test_check_finite():
    ops.check_finite(1.0, "g")
    for v in (float("nan"), float("inf"), np.float32("-inf")):
        with pytest.raises(NonFiniteGradientError, match="'layer1.weight'"):
            ops.check_finite(v, "layer1.weight")


def test_sampled_threshold_and_sparsify():
    x = np.array([0.5, -3.0, 2.0, 0.1, -1.0], np.float32)
    absx = np.abs(x)
    rng = ops.rng_for(np, 0, "t", 0)
    assert ops.sampled_threshold(absx, 2, 100, rng) == 2.0  # exact when sample >= n
    big = np.abs(np.random.default_rng(0).standard_normal(100_000))
    t = ops.sampled_threshold(big, 1000, 10_000, ops.rng_for(np, 0, "t", 0))
    assert 800 < np.count_nonzero(big >= t) < 1250
    idx, vals = ops.sparsify(x, np.array([1, 2]))
    assert idx.dtype == np.int32
    np.testing.assert_array_equal(vals, [-3.0, 2.0])
    np.testing.assert_array_equal(ops.desparsify(idx, vals, 5, np.float64), [0, -3, 2, 0, 0])
    with pytest.raises(PayloadError, match="outside"):
        ops.desparsify(np.array([5], np.int32), np.ones(1, np.float32), 5, np.float32)
    with pytest.raises(PayloadError, match="outside"):
        ops.desparsify(np.array([-1], np.int32), np.ones(1, np.float32), 5, np.float32)


# ------------------------------------------------------------------------- memory
def test_residual_memory_float16_grad_kept_in_float32():
    mem = ResidualMemory()
    g = np.array([1.0, 2.0, 3.0], np.float16)
    c = mem.compensate("w", g)
    assert c.dtype == np.float32
    np.testing.assert_array_equal(c, [1, 2, 3])
    mem.update("w", c, np.array([0.9995, 2.0, 3.0], np.float16))
    e = mem.get("w")
    assert e.dtype == np.float32
    assert e[0] == np.float32(1.0) - np.float32(np.float16(0.9995))
    c2 = mem.compensate("w", g)
    assert c2.dtype == np.float32 and c2[0] == np.float32(1.0) + e[0]
    assert g.tolist() == [1.0, 2.0, 3.0]  # the gradient is never modified
    # bfloat16 too; float64 residuals stay float64
    assert mem.compensate("b", np.ones(2, bfloat16)).dtype == np.float32
    assert mem.compensate("d", np.ones(2, np.float64)).dtype == np.float64


def test_residual_memory_beta():
    mem = ResidualMemory(beta=0.5)
    c = mem.compensate("w", np.ones(2, np.float32))
    mem.update("w", c, np.zeros(2, np.float32))
    np.testing.assert_array_equal(mem.compensate("w", np.ones(2, np.float32)), [1.5, 1.5])
    for bad in (-0.1, 1.1, float("nan")):
        with pytest.raises(CodecError, match="beta"):
            ResidualMemory(beta=bad)


def test_memory_state_dict_and_pickle_round_trip():
    mem = ResidualMemory(beta=0.9)
    for name, g in [("a", np.arange(4, dtype=np.float32)), ("b", np.ones((2, 3), np.float16))]:
        c = mem.compensate(name, g)
        mem.update(name, c, np.zeros_like(c) + 0.25)
    sd = mem.state_dict()
    assert set(sd) == {"a", "b"} and sd["b"].dtype == np.float32
    sd["a"][:] = 99  # a copy
    assert mem.get("a")[0] != 99
    clone = pickle.loads(pickle.dumps(mem))
    assert isinstance(clone, ResidualMemory) and clone.beta == 0.9
    for k, v in mem.state_dict().items():
        assert clone.get(k).tobytes() == v.tobytes()
    fresh = ResidualMemory()
    fresh.load_state_dict(mem.state_dict())
    assert fresh.state_dict().keys() == {"a", "b"}
    with pytest.raises(CodecError, match="expect float"):
        fresh.load_state_dict({"x": np.arange(3)})
    assert "a" in fresh
    fresh.reset("a")
    assert "a" not in fresh and "b" in fresh
    fresh.reset()
    assert fresh.state_dict() == {}


def test_memory_shape_mismatch():
    mem = ResidualMemory()
    mem.compensate("w", np.ones(4, np.float32))
    with pytest.raises(CodecError, match="share a name"):
        mem.compensate("w", np.ones(5, np.float32))


def test_memory_registry():
    assert {"none", "residual"} <= set(memory_names())
    assert isinstance(get_memory(None), NoMemory)
    assert isinstance(get_memory("residual", beta=0.5), ResidualMemory)
    m = ResidualMemory()
    assert get_memory(m) is m
    with pytest.raises(CodecError, match="valid memories: .*residual"):
        get_memory("nope")
    g = np.ones(3, np.float32)
    assert NoMemory().compensate("w", g) is g
