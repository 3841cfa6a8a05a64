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
