"""Engine pieces checked in one process, without mpirun: startup checks and thread safety.

The engine is built on a stand-in :class:`hipress.comm.World` (no MPI is touched at world
size 1, and a refused startup raises before anything communicates).
"""

from __future__ import annotations

import sys
import threading
import time

import numpy as np
import pytest

from hipress.codecs import get_codec
from hipress.comm import World
from hipress.config import config_from_dict
from hipress.engine.engine import Engine
from hipress.errors import ConfigError, HiPressError
from hipress.memory import get_memory


def fake_world(size: int = 1, tag_bits: int = 30) -> World:
    return World(rank=0, size=size, local_rank=0, local_size=size, ctrl=None, data=None,
                 tag_bits=tag_bits, mpi=None)


def make_engine(**cfg) -> Engine:
    base = {"compression": {"min_compress_bytes": 0}, "logging": {"level": "WARNING"}}
    base.update(cfg)
    return Engine(config_from_dict(base), fake_world())


@pytest.fixture
def fast_switching():
    """Let threads switch every microsecond, so races show within a second."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(old)


def hammer(writer, reader, seconds: float = 3.0):
    """Run ``writer()`` in a thread while calling ``reader()`` in another until it ends.

    Returns:
        (reader errors, reader results): every exception the reader raised, and the
        results of its calls.
    """
    errors, results = [], []
    done = threading.Event()

    def read_loop():
        deadline = time.monotonic() + seconds
        while not done.is_set() and time.monotonic() < deadline:
            try:
                results.append(reader())
            except Exception as exc:  # noqa: BLE001 - collected for the assertion
                errors.append(exc)

    def write():
        try:
            writer()
        finally:
            done.set()

    threads = [threading.Thread(target=read_loop), threading.Thread(target=write)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(seconds + 30)
    return errors, results


# ----------------------------------------------------------------------- tag space
def test_refuses_an_mpi_whose_tag_space_cannot_hold_one_task():
    cfg = config_from_dict({"logging": {"level": "WARNING"}})
    with pytest.raises(HiPressError, match=r"only 11 bits .*MPI_TAG_UB < 4096.* 12 bits"):
        Engine(cfg, fake_world(size=2, tag_bits=11))


# ------------------------------------------------------------ state_dict vs. new names
N_NAMES = 3000


def test_memory_state_dict_while_names_are_added(fast_switching):
    """The engine's compute threads add residuals on a name's first encode."""
    mem = get_memory("residual")

    def add_names():
        for i in range(N_NAMES):
            g = np.full(4, float(i), np.float32)
            c = mem.compensate(f"g{i}", g)  # creates the zero residual of g{i}
            mem.update(f"g{i}", c, np.zeros(4, np.float32))  # residual = g

    errors, snaps = hammer(add_names, mem.state_dict)
    assert not errors, f"{len(errors)} of {len(errors) + len(snaps)} calls failed: {errors[0]!r}"
    assert any(0 < len(s) < N_NAMES for s in snaps), "the reader never overlapped the writer"
    final = mem.state_dict()
    assert sorted(final) == sorted(f"g{i}" for i in range(N_NAMES))
    for i in (0, 1, N_NAMES - 1):
        np.testing.assert_array_equal(final[f"g{i}"], np.full(4, float(i), np.float32))


def test_powersgd_state_dict_while_names_are_encoded(fast_switching):
    codec = get_codec("powersgd", rank=1)
    x = np.arange(64, dtype=np.float32).reshape(8, 8)
    n = 1500

    def encode_names():
        for i in range(n):
            codec.encode(x, f"w{i}")

    errors, snaps = hammer(encode_names, codec.state_dict)
    assert not errors, f"{len(errors)} of {len(errors) + len(snaps)} calls failed: {errors[0]!r}"
    assert any(0 < len(s) < n for s in snaps), "the reader never overlapped the writer"
    final = codec.state_dict()
    assert len(final) == n and final["w7"].shape == (8, 1)
    alone = get_codec("powersgd", rank=1)
    alone.encode(x, "w7")
    np.testing.assert_array_equal(final["w7"], alone.state_dict()["w7"])


def test_engine_state_dict_and_stats_while_another_thread_submits(fast_switching):
    """hp.state_dict()/hp.stats() from one thread while another submits new names."""
    eng = make_engine()
    try:
        eng.load_state_dict({"memories": {"residual": {}}})  # as a resumed job has
        mem = eng._memories["residual"]
        g = np.ones(3, np.float32)

        def submit_names():
            for i in range(N_NAMES):
                # a new codec key and a new name each time, and the residual the engine's
                # compute thread would create for it
                codec = get_codec("topk", ratio=1.0 / (i + 2))
                eng.submit(g, f"layer{i}.weight", codec=codec).wait(5)
                mem.compensate(f"layer{i}.weight", g)

        def read():
            return eng.state_dict(), eng.stats()

        errors, snaps = hammer(submit_names, read)
        assert not errors, (
            f"{len(errors)} of {len(errors) + len(snaps)} calls failed: {errors[0]!r}")
        assert any(0 < len(sd["codecs"]) < N_NAMES for sd, _ in snaps), "no overlap"
        sd, stats = read()
        assert len(sd["codecs"]) == N_NAMES and len(stats) == N_NAMES
        assert sorted(sd["memories"]["residual"]) == sorted(f"layer{i}.weight"
                                                            for i in range(N_NAMES))
        np.testing.assert_array_equal(sd["memories"]["residual"]["layer5.weight"],
                                      np.zeros(3, np.float32))
        assert stats["layer5.weight"] == {"calls": 1, "numel": 3, "codec": "none",
                                          "strategy": "local"}
    finally:
        eng.shutdown()


def test_stall_watch_warns_every_interval_and_turns_fatal_past_the_limit():
    from hipress.engine.engine import _StallWatch

    watch = _StallWatch(1.0, 3.0)
    waited = [0.5, 1.2, 1.5, 2.1, 2.5, 0.2, 1.1, 3.5]
    assert [watch.check(t) for t in waited] == [None, "warn", None, "warn", None, None,
                                                "warn", "fatal"]
    # a limit below the warning interval is still honoured (no warning needed first)
    assert _StallWatch(60.0, 2.0).check(2.5) == "fatal"
    never = _StallWatch(1.0, float("inf"))
    assert [never.check(t) for t in (5.0, 5.5, 6.1, 1e6)] == ["warn", None, "warn", "warn"]


@pytest.mark.parametrize("tag_ub,bits", [(32767, 15), (32768, 15), (65534, 15), (65535, 16),
                                         (2**31 - 1, 31)])
def test_tag_bits_use_the_whole_mpi_tag_range(tag_ub, bits):
    from hipress.comm import tag_bits_for

    assert tag_bits_for(tag_ub) == bits
    assert 2**bits - 1 <= tag_ub < 2**(bits + 1) - 1


def test_finite_flag_does_not_overflow_on_large_half_precision_gradients():
    """A float16 sum of 1M x 0.1 is inf; the check accumulates in float32, so a finite
    gradient stays compressible and only a real inf/NaN is flagged."""
    from types import SimpleNamespace

    from hipress.engine.engine import _finite_flag

    x = np.full(1_000_000, 0.1, np.float16)
    sub = SimpleNamespace(codec=object(), kind="allreduce", contributes=True, array=x)
    assert _finite_flag(sub) == 1
    x[123] = np.nan
    assert _finite_flag(sub) == 0
    x[123] = np.inf
    assert _finite_flag(sub) == 0


def test_engine_imports_no_secopa_and_refuses_a_plan_without_a_planner():
    import ast
    import pathlib

    from hipress.engine.planning import Decision, FixedPolicy

    engine_dir = pathlib.Path(__file__).resolve().parent.parent / "hipress" / "engine"
    for path in sorted(engine_dir.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                mods = [node.module or ""]
            elif isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            else:
                continue
            assert not any(m.startswith("hipress.secopa") for m in mods), (path.name, mods)
    with pytest.raises(ConfigError, match="needs SeCoPa's planner"):
        make_engine(sync={"plan": "auto"})
    cfg = config_from_dict({"compression": {"min_compress_bytes": 1024},
                            "sync": {"partition_bytes": 1000}})
    policy = FixedPolicy(cfg)
    onebit = get_codec("onebit")
    assert policy.decide("g", np.zeros(100, np.float32), onebit, None) == Decision(
        False, 1, "auto")
    assert policy.decide("g", np.zeros(1000, np.float32), onebit, "ps") == Decision(
        True, 4, "ps")
    assert policy.decide("g", np.zeros(1000, np.float32), None, "ps") == Decision(
        False, 1, "ps")


def test_limit_numpy_blas_sets_and_restores_the_count():
    from hipress.engine.blas import limit_numpy_blas, numpy_blas_threads

    before = numpy_blas_threads()
    assert before and all(n >= 1 for n in before)  # the wheel's OpenBLAS is found
    restore = limit_numpy_blas(1)
    assert numpy_blas_threads() == [1] * len(before)
    restore()
    assert numpy_blas_threads() == before
    limit_numpy_blas(0)()  # 0 changes nothing, and its restore does nothing
    assert numpy_blas_threads() == before
    with pytest.raises(ValueError, match="blas_threads must be >= 0"):
        limit_numpy_blas(-1)


def test_fit_state_re_splits_residuals_when_the_partitions_change():
    from hipress.codecs import get_codec

    eng = make_engine()
    mem = eng._memory_for(get_codec("onebit"))
    full = np.arange(10, dtype=np.float32)

    def stored(prefix):
        return sorted(k for k in mem.keys() if k.startswith(prefix))

    eng._fit_state(mem, "w", 10, "ps", 2)  # the first job: nothing stored, nothing done
    assert mem.keys() == []
    mem.put("w#p0", full[:5].copy())
    mem.put("w#p1", full[5:].copy())
    mem.put("w#p1@agg", np.ones(5, np.float32))  # this rank aggregated partition 1
    mem.put("w2#p0", np.full(3, 7.0, np.float32))  # another gradient: untouched
    eng._fit_state(mem, "w", 10, "ps", 2)  # the same layout: nothing moves
    assert stored("w#") == ["w#p0", "w#p1", "w#p1@agg"]
    # 2 -> 3 partitions: split as np.array_split does; the aggregator's residual goes
    eng._fit_state(mem, "w", 10, "ps", 3)
    assert stored("w#") == ["w#p0", "w#p1", "w#p2"]
    for i, part in enumerate(np.array_split(full, 3)):
        np.testing.assert_array_equal(mem.get(f"w#p{i}"), part)
    np.testing.assert_array_equal(mem.get("w2#p0"), np.full(3, 7.0, np.float32))
    # the gather path, one partition: the whole residual under the gradient's own name
    eng._fit_state(mem, "w", 10, "gather", 1)
    np.testing.assert_array_equal(mem.get("w"), full)
    assert stored("w#") == []
    # the ring path keeps residuals per chunk: they cannot be carried over
    eng._fit_state(mem, "w", 10, "ring", 2)
    assert "w" not in mem
    # after a checkpoint is loaded, the stored layout is checked at the next job
    mem.put("v#p0", full[:5].copy())
    mem.put("v#p1", full[5:].copy())
    eng.load_state_dict({"step": 7})
    eng._fit_state(mem, "v", 10, "ps", 2)  # it fits: kept as it is
    assert stored("v#") == ["v#p0", "v#p1"]
    eng.load_state_dict({"step": 7})
    eng._fit_state(mem, "v", 10, "ps", 1)  # saved under 2 partitions, now 1: re-split
    np.testing.assert_array_equal(mem.get("v#p0"), full)
    assert stored("v#") == ["v#p0"]
    # residuals that do not add up to the gradient (another model's) are dropped
    mem.put("u#p0", np.zeros(4, np.float32))
    eng.load_state_dict({"step": 7})
    eng._fit_state(mem, "u", 10, "ps", 2)
    assert stored("u#") == []


# ------------------------------------------------------------------ merge kernels
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("divisor", [1, 2, 3, 7])
def test_add_divide_matches_numpys_two_passes_bit_for_bit(dtype, divisor):
    from hipress.engine._kernels import add_divide

    rng = np.random.default_rng(divisor)
    a = (rng.standard_normal(10007) * 1e3).astype(dtype)
    b = rng.standard_normal(10007).astype(dtype)
    a[:6] = [np.inf, -np.inf, np.nan, 0.0, -0.0, np.finfo(dtype).max]
    b[:6] = [1.0, 1.0, 1.0, -0.0, -0.0, np.finfo(dtype).max]
    with np.errstate(over="ignore"):  # max + max overflows to inf, on purpose
        want = np.add(a, b)
    if divisor != 1:
        want = np.divide(want, want.dtype.type(divisor))
    out = np.empty_like(a)
    add_divide(a, b, out, divisor)
    bits = f"u{np.dtype(dtype).itemsize}"
    assert np.array_equal(out.view(bits), want.view(bits))
    assert np.isposinf(out[5]) and np.isnan(out[2]) and np.signbit(out[4])
    # in place, as the merge of three or more ranks runs it (a is the output)
    add_divide(a, b, a, divisor)
    assert np.array_equal(a.view(bits), want.view(bits))


def test_sum_into_merges_in_rank_order_and_averages_like_numpy():
    from hipress.engine.tasks import _sum_into
    from hipress.timeline import Timeline

    class Env:
        timeline = Timeline(None)

    rng = np.random.default_rng(5)
    parts = [rng.standard_normal(4099).astype(np.float32) for _ in range(4)]
    for n in (1, 2, 3, 4):
        for divisor in (1, n):
            want = parts[0].copy()
            for p in parts[1:n]:
                want += p
            if divisor != 1:
                want /= np.float32(divisor)
            out = np.empty(4099, np.float32)
            _sum_into(Env(), "g", "p0", parts[:n], out, divisor)
            assert np.array_equal(out.view(np.uint32), want.view(np.uint32)), (n, divisor)


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.int8, np.uint8, np.int32,
                                   np.bool_])
@pytest.mark.parametrize("op", ["sum", "product", "max"])
def test_combine_chunks_accumulates_wide_and_leaves_its_inputs_alone(dtype, op):
    from hipress.engine.tasks import combine_chunks

    rng = np.random.default_rng(1)
    parts = [(rng.standard_normal(257) * 40).astype(dtype) for _ in range(3)]
    before = [p.copy() for p in parts]
    wide = {np.float16: np.float32, np.float32: np.float32, np.uint8: np.uint64}.get(
        dtype, np.int64)
    if op == "max":
        want = np.maximum(np.maximum(parts[0], parts[1]), parts[2])
    else:
        acc = parts[0].astype(wide)
        for p in parts[1:]:
            acc = acc * p if op == "product" else acc + p
        with np.errstate(over="ignore"):
            want = acc.astype(dtype)
    with np.errstate(over="ignore"):  # int8 products wrap, as integer arithmetic does
        got = combine_chunks([p.view(np.uint8) for p in parts], np.dtype(dtype), op)
    assert got.dtype == np.dtype(dtype)
    assert np.array_equal(got.view(np.uint8), want.view(np.uint8))
    for p, b in zip(parts, before):
        assert np.array_equal(p.view(np.uint8), b.view(np.uint8))
    one = combine_chunks([parts[0].view(np.uint8)], np.dtype(dtype), op)
    assert np.array_equal(one.view(np.uint8), parts[0].view(np.uint8))
    assert not np.shares_memory(one, parts[0])


# ------------------------------------------------------------------ handles
def test_handle_completes_with_or_without_a_waiter(fast_switching):
    from hipress.engine.engine import Handle
    from hipress.errors import SyncError

    done_first = Handle("a")
    done_first._finish(result=41)
    assert done_first.done() and done_first.wait() == 41
    assert done_first._event is None  # nothing ever blocked on it

    h = Handle("b")
    with pytest.raises(SyncError, match="timed out after 0.05 s waiting for 'b'"):
        h.wait(0.05)
    failed = Handle("c")
    failed._finish(error=ValueError("boom"))
    with pytest.raises(ValueError, match="boom"):
        failed.wait()

    # a completion racing a waiter that is creating its event is never lost
    for i in range(300):
        h = Handle(f"r{i}")
        got = []
        t = threading.Thread(target=lambda h=h, got=got: got.append(h.wait(5.0)))
        t.start()
        h._finish(result=i)
        t.join(5.0)
        assert got == [i] and not t.is_alive()


def test_submission_mismatch_passes_identical_entries_and_names_every_difference():
    from hipress.engine.engine import _submission_mismatch

    # numel, dtype, codec, op, kind, root, strategy, partitions, shape, finite, extra, filler
    entry = [1000, 1, "onebit", "average", "allreduce", -1, "ps", 0, [10, 100], 1, None, 0]
    assert _submission_mismatch("w", [list(entry) for _ in range(3)]) is None
    refused = entry[:10] + [{"error": "bad dtype"}, 0]
    msg = _submission_mismatch("w", [list(refused) for _ in range(2)])
    assert msg == "allreduce 'w' was refused; rank 0: bad dtype; rank 1: bad dtype"
    other = list(entry)
    other[0], other[8] = 999, [9, 111]
    msg = _submission_mismatch("w", [entry, list(entry), other])
    assert msg.startswith("ranks disagree about allreduce 'w'")
    assert "2: {'numel': 999" in msg and "'shape': [9, 111]" in msg and "1: {" not in msg
    # the finiteness flag may differ (one rank's gradient overflowed): not a mismatch
    nonfinite = list(entry)
    nonfinite[9] = 0
    assert _submission_mismatch("w", [entry, nonfinite]) is None
