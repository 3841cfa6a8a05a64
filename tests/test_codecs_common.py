"""The generic codec contract, checked on every registered codec.

Parametrized over ``hipress.codecs.codec_names()``, so a codec that lands later is covered
with no change here. Codecs are built with their default parameters; a codec whose
constructor needs a parameter without default gets one from ``PARAMS``.
"""

from __future__ import annotations

import pickle
import struct
import tracemalloc

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hipress.backend import bfloat16, dtype_code
from hipress.codecs import codec_names, get_codec
from hipress.codecs.base import Payload, codec_class, header_nbytes
from hipress.errors import CodecError, PayloadError
from hipress.memory import ResidualMemory

#: Constructor parameters for codecs that have no usable defaults (inputs here are N(0, 1)).
PARAMS: dict = {"tbq": {"threshold": 0.5}}

CODECS = codec_names()
FLOAT_DTYPES = [np.dtype(np.float16), bfloat16, np.dtype(np.float32), np.dtype(np.float64)]
DTYPE_IDS = [str(d) for d in FLOAT_DTYPES]
FUZZ_MAX_NUMEL = 1 << 20
FUZZ = settings(max_examples=80, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def make(name):
    try:
        return get_codec(name, **PARAMS.get(name, {}))
    except CodecError as exc:  # pragma: no cover - tells the author of a new codec what to do
        pytest.fail(f"codec {name!r} cannot be built with defaults ({exc}); add it to PARAMS")


def sample(shape, dtype, seed=0):
    x = np.random.default_rng(seed).standard_normal(shape)
    return np.asarray(x).astype(dtype)


def parse_decode(codec, buf):
    return codec.decode(Payload.from_bytes(buf))


def check_payload_size(codec, p, shape, dtype):
    wire = p.to_bytes()
    assert p.nbytes == len(wire)
    if codec.variable_size:
        assert p.nbytes <= codec.payload_nbytes(shape, dtype)
    else:
        assert p.nbytes == codec.payload_nbytes(shape, dtype)
    return wire


def test_builtin_codecs_present():
    assert {"none", "fp16", "bf16", "powersgd"} <= set(CODECS)


# ------------------------------------------------------------------ empty arrays
@pytest.mark.parametrize("name", CODECS)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", [(0,), (0, 3)])
def test_empty_is_a_noop(name, dtype, shape):
    codec = make(name)
    x = np.zeros(shape, dtype=dtype)
    p = codec.encode(x, "empty")
    assert p.sections == () and p.shape == shape and p.dtype == dtype
    assert p.codec_id == codec.codec_id
    wire = check_payload_size(codec, p, shape, dtype)
    for q in (p, Payload.from_bytes(wire)):
        y = codec.decode(q)
        assert y.shape == shape and y.dtype == dtype and y.size == 0


# ------------------------------------------------------------- shapes and dtypes
@pytest.mark.parametrize("name", CODECS)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", [(1,), (7,), (8,), (9,), (33,), (3, 5)])
def test_shape_dtype_size_and_wire_round_trip(name, dtype, shape):
    codec = make(name)
    x = sample(shape, dtype, seed=len(shape) * 100 + shape[0])
    x_before = x.copy()
    p = codec.encode(x, "g")
    assert x.tobytes() == x_before.tobytes(), "encode modified its input"
    assert p.codec_id == codec.codec_id and p.dtype == dtype and p.shape == shape
    for s in p.sections:
        assert s.ndim == 1 and s.flags.c_contiguous
    wire = check_payload_size(codec, p, shape, dtype)
    y = codec.decode(p)
    assert y.shape == shape and y.dtype == dtype
    assert np.all(np.isfinite(y.astype(np.float64))), "finite input decoded to NaN/Inf"
    q = Payload.from_bytes(wire)
    assert q.codec_id == p.codec_id and q.dtype == p.dtype and q.shape == p.shape
    assert q.to_bytes() == wire
    y2 = codec.decode(q)
    assert y2.shape == shape and y2.dtype == dtype
    assert y2.tobytes() == y.tobytes(), "the wire round trip decodes differently"
    # a bytearray and a uint8 array parse the same
    assert codec.decode(Payload.from_bytes(bytearray(wire))).tobytes() == y.tobytes()
    assert codec.decode(Payload.from_bytes(np.frombuffer(wire, np.uint8))).tobytes() \
        == y.tobytes()


@pytest.mark.parametrize("name", CODECS)
def test_zero_d_array(name):
    codec = make(name)
    x = np.array(1.5, dtype=np.float32)
    y = codec.decode(Payload.from_bytes(codec.encode(x, "scalar").to_bytes()))
    assert y.shape == () and y.dtype == np.float32


@pytest.mark.parametrize("name", CODECS)
@given(
    shape=st.lists(st.integers(0, 6), min_size=0, max_size=4).map(tuple),
    dtype=st.sampled_from(FLOAT_DTYPES),
    seed=st.integers(0, 2**16),
)
@FUZZ
def test_round_trip_property(name, shape, dtype, seed):
    codec = make(name)
    x = sample(shape, dtype, seed)
    p = codec.encode(x, "prop")
    wire = check_payload_size(codec, p, shape, dtype)
    y = codec.decode(Payload.from_bytes(wire))
    assert y.shape == shape and y.dtype == dtype
    assert y.tobytes() == codec.decode(p).tobytes()


@pytest.mark.parametrize("name", [n for n in CODECS if codec_class(n).lossless])
@given(
    n=st.integers(0, 200),
    dtype=st.sampled_from(FLOAT_DTYPES),
    raw=st.binary(min_size=1600, max_size=1600),
)
@FUZZ
def test_lossless_decode_exactly(name, n, dtype, raw):
    codec = make(name)
    # arbitrary bit patterns: NaNs, infinities, subnormals and signed zeros included
    x = np.frombuffer(raw[: n * dtype.itemsize], dtype=dtype).reshape(-1)
    y = codec.decode(Payload.from_bytes(codec.encode(x, "exact").to_bytes()))
    assert y.dtype == dtype and y.tobytes() == x.tobytes()


# -------------------------------------------------------------- corrupted input
def valid_wire(codec, shape=(33,), dtype=np.float32):
    return codec.encode(sample(shape, dtype, seed=5), "w").to_bytes()


@pytest.mark.parametrize("name", CODECS)
def test_corrupted_payloads_raise_payload_error(name):
    codec = make(name)
    wire = valid_wire(codec)
    bad = {
        "empty": b"",
        "fixed header only half": wire[:4],
        "truncated by one byte": wire[:-1],
        "truncated by eight bytes": wire[:-8],
        "one byte too long": wire + b"\0",
        "flipped magic": bytes([wire[0] ^ 0xFF]) + wire[1:],
        "wrong version": wire[:2] + bytes([2]) + wire[3:],
        "unknown dtype code": wire[:6] + bytes([99]) + wire[7:],
        "integer gradient dtype": wire[:6] + bytes([9]) + wire[7:],
        "ndim too large": wire[:7] + bytes([200]) + wire[8:],
    }
    for why, buf in bad.items():
        with pytest.raises(PayloadError):
            parse_decode(codec, buf)
            pytest.fail(f"{why}: no error")
    # payloads of every other codec, and of an id nobody registered
    for other in CODECS:
        if other == name:
            continue
        foreign = valid_wire(make(other))
        with pytest.raises(PayloadError, match="codec id"):
            parse_decode(codec, foreign)
    unregistered = wire[:4] + struct.pack("<H", 65000) + wire[6:]
    with pytest.raises(PayloadError, match="codec id"):
        parse_decode(codec, unregistered)


@pytest.mark.parametrize("name", CODECS)
def test_garbage_bytes_raise_value_error(name):
    codec = make(name)
    rng = np.random.default_rng(11)
    for size in (1, 7, 8, 64, 200, 4096):
        garbage = rng.integers(0, 256, size=size, dtype=np.uint8).tobytes()
        with pytest.raises(ValueError):
            parse_decode(codec, garbage)
    # a well-formed header that declares sections this codec does not make
    p = Payload(codec.codec_id, np.dtype(np.float32), (33,),
                (np.zeros(5, np.uint16), np.zeros(3, np.int64), np.zeros(2, np.float64)))
    with pytest.raises(PayloadError):
        parse_decode(codec, p.to_bytes())
    with pytest.raises(PayloadError):
        parse_decode(codec, Payload(codec.codec_id, np.dtype(np.float32), (33,), ()).to_bytes())


def _decode_or_value_error(codec, buf):
    """Return the decoded array, or None if a ValueError was raised (anything else fails)."""
    with np.errstate(all="ignore"):
        try:
            payload = Payload.from_bytes(buf)
        except ValueError:
            return None
        if payload.numel > FUZZ_MAX_NUMEL:
            # a mutated shape may be legal for a variable-size (sparse) payload, which can
            # decode to any size up to its shape: a decompression bomb the engine never sees
            # from a trusted peer. Keep the test's memory small.
            return None
        try:
            y = codec.decode(payload)
        except ValueError:
            return None
    assert y.shape == payload.shape and y.dtype == payload.dtype
    return y


@pytest.mark.parametrize("name", CODECS)
@given(buf=st.binary(min_size=0, max_size=512))
@FUZZ
def test_fuzz_random_bytes(name, buf):
    _decode_or_value_error(make(name), buf)


@pytest.mark.parametrize("name", CODECS)
@given(buf=st.binary(min_size=0, max_size=256), shape=st.sampled_from([(33,), (16, 24), (2, 3)]))
@FUZZ
def test_fuzz_random_body_after_valid_header(name, buf, shape):
    codec = make(name)
    wire = valid_wire(codec, shape)
    p = Payload.from_bytes(wire)
    head = header_nbytes(len(p.shape), len(p.sections))
    _decode_or_value_error(codec, wire[:head] + buf)
    # same length as the real body: the parse succeeds and the codec sees random sections
    body = (buf * (len(wire) // max(1, len(buf)) + 1))[: len(wire) - head] if buf else b""
    _decode_or_value_error(codec, wire[:head] + body.ljust(len(wire) - head, b"\xff"))


@pytest.mark.parametrize("name", CODECS)
@given(
    shape=st.sampled_from([(33,), (16, 24), (3, 5)]),
    dtype=st.sampled_from(FLOAT_DTYPES),
    edits=st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), min_size=1,
                   max_size=6),
    cut=st.one_of(st.none(), st.integers(0, 10**6)),
)
@FUZZ
def test_fuzz_mutated_valid_payloads(name, shape, dtype, edits, cut):
    codec = make(name)
    wire = bytearray(valid_wire(codec, shape, dtype))
    for pos, val in edits:
        wire[pos % len(wire)] = val
    if cut is not None:
        wire = wire[: cut % (len(wire) + 1)]
    _decode_or_value_error(codec, bytes(wire))


# ------------------------------------------------------- expected element counts
def with_shape(wire, shape):
    """Return ``wire`` with the shape in its header replaced by ``shape`` (same ndim)."""
    ndim = wire[7]
    assert len(shape) == ndim
    return wire[:8] + b"".join(struct.pack("<Q", d) for d in shape) + wire[8 + 8 * ndim:]


def traced_peak(fn):
    """Run ``fn`` under tracemalloc (NumPy reports its buffers there); return (result, peak)."""
    tracemalloc.start()
    try:
        out = fn()
        return out, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("name", CODECS)
def test_wrong_element_count_is_refused_before_allocating(name):
    """A header claiming 2**24 elements where 33 are expected never reaches the decoder.

    For variable-size codecs (DGC, GradDrop, top-k, ...) the forged header is otherwise
    valid (33 entries fit in the layout of 2**24) and an unchecked decode allocates
    64 MiB or more; for fixed-size codecs the layout check would catch it, later.
    """
    codec = make(name)
    x = sample((33,), np.float32, seed=8)
    wire = codec.encode(x, "w").to_bytes()
    bomb = with_shape(wire, (2**24,))
    msg = r"declares 16777216 elements \(shape \(16777216,\)\) but the receiver expects 33"

    def attempts():
        errors = []
        for call in (lambda: Payload.from_bytes(bomb, numel=33),
                     lambda: codec.decode(Payload.from_bytes(bomb), numel=33),
                     lambda: codec.decode_add(Payload.from_bytes(bomb), np.zeros(33, np.float32)),
                     lambda: codec.decode_into(Payload.from_bytes(bomb), np.zeros(33, np.float32))):
            with pytest.raises(PayloadError, match=msg) as info:
                call()
            errors.append(info.value)
        return errors

    errors, peak = traced_peak(attempts)
    assert len(errors) == 4
    assert peak < 1 << 20, f"{peak} bytes allocated before the count was checked"
    # the genuine payload still decodes, to the same values with or without the check
    want = codec.decode(Payload.from_bytes(wire))
    got = codec.decode(Payload.from_bytes(wire, numel=33), numel=33)
    np.testing.assert_array_equal(got, want)
    acc = np.ones(33, np.float32)
    codec.decode_add(Payload.from_bytes(wire), acc)
    np.testing.assert_array_equal(acc, 1 + want)


@pytest.mark.parametrize("name", CODECS)
def test_short_payload_is_never_broadcast_into_the_sum(name):
    """A peer's payload of shape (1,) merged into 33 elements raises; nothing is written."""
    codec = make(name)
    short = Payload.from_bytes(codec.encode(np.array([3.0], np.float32), "w").to_bytes())
    msg = "declares 1 elements .* expects 33"
    acc = np.full(33, 2.0, np.float32)
    with pytest.raises(PayloadError, match=msg):
        codec.decode_add(short, acc)
    np.testing.assert_array_equal(acc, np.full(33, 2.0, np.float32))
    out = np.full(33, 5.0, np.float32)
    with pytest.raises(PayloadError, match=msg):
        codec.decode_into(short, out, 2)
    np.testing.assert_array_equal(out, np.full(33, 5.0, np.float32))
    with pytest.raises(PayloadError, match=msg):
        codec.decode(short, numel=33)
    # without an expected count the header is trusted (the public API stays compatible)
    assert codec.decode(short).shape == (1,)


def test_forty_byte_dgc_payload_claiming_2_to_the_30_elements():
    """The audit's case: 40 bytes, shape (2**30,), no entries; decoding it took 4 GiB."""
    head = struct.pack("<2sBBHBB", b"HP", 1, 0, get_codec("dgc").codec_id, 3, 1)
    head += struct.pack("<Q", 2**30) + b"\x02"
    head += struct.pack("<BQ", dtype_code(np.int32), 0)  # no indices
    head += struct.pack("<BQ", dtype_code(np.float32), 0)  # no values
    bomb = head.ljust(header_nbytes(1, 2), b"\0")
    assert len(bomb) == 40
    assert Payload.from_bytes(bomb).numel == 2**30  # a well-formed header, on its own
    codec = get_codec("dgc")
    msg = "declares 1073741824 elements .* expects 1000"

    def attempts():
        with pytest.raises(PayloadError, match=msg):
            Payload.from_bytes(bomb, numel=1000)
        with pytest.raises(PayloadError, match=msg):
            codec.decode(Payload.from_bytes(bomb), numel=1000)
        with pytest.raises(PayloadError, match=msg):
            codec.decode_add(Payload.from_bytes(bomb), np.zeros(1000, np.float32))

    _, peak = traced_peak(attempts)
    assert peak < 1 << 20, peak


# ------------------------------------------------------------------- summability
@pytest.mark.parametrize("name", CODECS)
@pytest.mark.parametrize("shape", [(33,), (16, 24)])
def test_reduce_stages_contract(name, shape):
    codec = make(name)
    x = sample(shape, np.float32, seed=3)
    if not codec.summable:
        with pytest.raises(CodecError):
            next(iter(codec.reduce_stages(x, "g", 1, 1.0)))
        return
    gen = codec.reduce_stages(x, "g", 1, 1.0)
    arr, op = next(gen)
    rounds = 0
    while True:
        rounds += 1
        assert op in ("sum", "max") and rounds < 10
        try:
            arr, op = gen.send(np.array(arr, copy=True))
        except StopIteration as stop:
            result, feedback = stop.value
            break
    assert result.shape == shape and result.dtype == np.float32
    assert feedback is None or feedback.shape == shape
    assert np.all(np.isfinite(result))


# ---------------------------------------------------------------- error feedback
@pytest.mark.parametrize("name", [n for n in CODECS if codec_class(n).error_feedback])
def test_error_feedback_tracks_the_sum_of_inputs(name):
    codec, mem = make(name), ResidualMemory()
    rng = np.random.default_rng(21)
    shape, steps = (16, 24), 30
    drift = rng.standard_normal(shape)  # a common direction: sending nothing would pile up
    sum_in = np.zeros(shape)
    sum_out = np.zeros(shape)
    scale = 0.0
    for _ in range(steps):
        g = (drift + rng.standard_normal(shape)).astype(np.float32)
        c = mem.compensate("w", g)
        assert c.dtype == np.float32
        d = codec.decode(codec.encode(c, "w"))
        mem.update("w", c, d)
        e = mem.get("w")
        # the residual is what the codec left out of c; it never exceeds c itself
        assert np.linalg.norm(e) <= np.linalg.norm(c) * (1 + 1e-5) + 1e-6
        sum_in += g
        sum_out += d
        scale = max(scale, float(np.abs(c).max()))
    e = mem.get("w").astype(np.float64)
    # sum(decoded) = sum(inputs) - e_T, up to float32 rounding of each step
    np.testing.assert_allclose(sum_in - sum_out, e, rtol=0, atol=steps * 4e-7 * scale * 4)
    assert np.linalg.norm(e) <= 0.99 * np.linalg.norm(sum_in), "the codec sent nothing"


# ------------------------------------------------------ step counters of stochastic codecs
@pytest.mark.parametrize("name,state", [
    ("randomk", {"w": 2}), ("dgc", {"w": 2}), ("graddrop", {"w": 2}),
    ("terngrad", {"steps": {"w": 2}}), ("qsgd", {"steps": {"w": 2}}),
])
def test_step_counters_checkpoint_and_pickle(name, state):
    x = np.random.default_rng(0).standard_normal(20_000).astype(np.float32)
    a = make(name)
    first = a.encode(x, "w").to_bytes()
    a.encode(x, "w")
    assert a.state_dict() == state
    clone = pickle.loads(pickle.dumps(a))  # the counters' lock is dropped and recreated
    resumed = make(name)
    resumed.load_state_dict(pickle.loads(pickle.dumps(a.state_dict())))
    want = a.encode(x, "w").to_bytes()
    assert clone.encode(x, "w").to_bytes() == want == resumed.encode(x, "w").to_bytes()
    assert want != first  # the stream moved on
    with pytest.raises(CodecError, match="non-negative integer"):
        make(name).load_state_dict({"w": -1} if "w" in state else {"steps": {"w": -1}})


# ------------------------------------------------------------- casting specifics
def test_fp16_exact_values():
    codec = get_codec("fp16")
    x = np.array([0.1, 0.2, 0.3], dtype=np.float32)
    p = Payload.from_bytes(codec.encode(x, "v").to_bytes())
    assert len(p.sections) == 1
    assert p.sections[0].dtype == np.float16 and p.sections[0].nbytes == 6
    y = codec.decode(p)
    assert y.dtype == np.float32
    np.testing.assert_array_equal(
        y, np.array([0.0999755859375, 0.199951171875, 0.300048828125], dtype=np.float32))
    y64 = codec.decode(codec.encode(x.astype(np.float64), "v"))
    assert y64.dtype == np.float64
    np.testing.assert_array_equal(y64, [0.0999755859375, 0.199951171875, 0.300048828125])
