"""MPI worker for tests/test_engine.py: runs named cases, prints ``PASS <case>`` for each.

Usage: mpirun -np N python tests/workers/engine_cases.py CASE [CASE ...]
A failing case raises (the rank exits non-zero and mpirun fails the job).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time

import numpy as np

# Re-exec with a per-rank hash seed so set/dict order differs between ranks.
_rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("RANK", "0")))
if os.environ.get("PYTHONHASHSEED") != str(_rank):
    os.environ["PYTHONHASHSEED"] = str(_rank)
    os.execv(sys.executable, [sys.executable] + sys.argv)

import hipress as hp  # noqa: E402
from hipress.codecs import codec_names  # noqa: E402

CASES = {}


def case(fn):
    CASES[fn.__name__] = fn
    return fn


def same_everywhere(value: bytes, tag: str) -> None:
    """Assert every rank holds identical bytes (compares SHA-1 digests from all ranks)."""
    digest = hashlib.sha1(value).hexdigest()
    digests = [hp.broadcast_object(digest, root=r, name=f"hash-{tag}-{r}")
               for r in range(hp.size())]
    assert len(set(digests)) == 1, f"{tag}: results differ across ranks: {digests}"


class _TorchReference:
    """``Allreduce`` (sum) through torch.distributed, for jobs on the torch transport."""

    def Allreduce(self, a, out):  # noqa: N802 - mpi4py's spelling
        import torch
        import torch.distributed as dist

        if not dist.is_initialized():
            dist.init_process_group("gloo")
        t = torch.from_numpy(np.array(a, copy=True))
        dist.all_reduce(t)
        out[...] = t.numpy()


def mpi_world():
    """The job's own reference allreduce: MPI's, or torch.distributed's under torchrun."""
    if hp.api._engine().world.tx.name == "torch":
        return _TorchReference()
    from mpi4py import MPI

    return MPI.COMM_WORLD


@case
def identity_exact():
    """Identity codec on integer-valued floats equals MPI's own allreduce exactly."""
    r, n = hp.rank(), hp.size()
    rng = np.random.default_rng(100 + r)
    shapes = {"w0": (3, 5), "w1": (1,), "w2": (1000, 7), "w3": (257,), "w4": (2, 3, 4)}
    arrays = {k: rng.integers(-50, 50, size=s).astype(np.float32) for k, s in shapes.items()}
    arrays["w5"] = rng.integers(-50, 50, size=64).astype(np.float64)
    handles = {k: hp.allreduce_async(a, k, op="sum", codec="none") for k, a in arrays.items()}
    comm = mpi_world()
    for k, h in handles.items():
        got = hp.synchronize(h)
        ref = np.empty_like(arrays[k])
        comm.Allreduce(arrays[k], ref)
        assert got.dtype == arrays[k].dtype and got.shape == arrays[k].shape
        assert np.array_equal(got, ref), (k, got, ref)
    # average = sum / n exactly as NumPy computes it
    a = arrays["w2"]
    got = hp.allreduce(a, "avg", op="average")
    ref = np.empty_like(a)
    comm.Allreduce(a, ref)
    assert np.array_equal(got, (ref.astype(np.float32) / n).astype(np.float32))


@case
def order_by_name():
    """Ranks submit the same names in different orders: results are correct per name."""
    r, n = hp.rank(), hp.size()
    names = ["fc.weight", "conv.bias", "conv.weight"]
    order = names if r % 2 == 0 else ["conv.weight", "fc.weight", "conv.bias"]
    order = order + sorted({f"set.{i}" for i in range(20)})  # hash-order dependent set
    if r % 2:
        order = order[:3] + order[3:][::-1]
    value = {nm: float(i + 1) for i, nm in enumerate(names + [f"set.{i}" for i in range(20)])}
    hs = {nm: hp.allreduce_async(np.full(7, value[nm] * (r + 1), np.float32), nm, op="sum")
          for nm in order}
    for nm, h in hs.items():
        got = hp.synchronize(h)
        assert np.array_equal(got, np.full(7, value[nm] * n * (n + 1) / 2, np.float32)), nm


@case
def gather_topk():
    """World 2, n=6, k=2: decoded payloads are summed, never value arrays element-wise."""
    r = hp.rank()
    g = np.array([5, 0, 0, 0, 0, -4] if r == 0 else [0, 0, 3, 0, 2, 0], np.float32)
    out = hp.allreduce(g, "sparse", op="average", codec=hp_codec("topk", ratio=2 / 6))
    assert np.array_equal(out, np.array([2.5, 0, 1.5, 0, 1.0, -2.0], np.float32)), out
    assert hp.stats()["sparse"]["strategy"] == "gather"


def hp_codec(name, **params):
    from hipress.codecs import get_codec

    return get_codec(name, **{**PARAMS.get(name, {}), **params})


#: parameters for codecs that have required ones
PARAMS = {"tbq": {"threshold": 0.5}}

#: (codec name, strategy, shape) for every engine path: the direct uncompressed path
#: (3 MiB, several partitions, rank-ordered sums), fused small gradients, PS, Ring,
#: gather (topk) and the compressed allreduce (TernGrad, PowerSGD)
EVERY_PATH = [("none", None, (3 << 18,)), ("none", None, (1000,)),
              ("onebit", "ps", (3 << 18,)), ("onebit", "ring", (3 << 18,)),
              ("topk", None, (5000,)), ("powersgd", None, (64, 64)),
              ("terngrad", "allreduce", (3000,))]


def path_codec(name):
    """The ``codec`` argument for an :data:`EVERY_PATH` entry (topk at ratio 0.1)."""
    if name == "none":
        return "none"
    return hp_codec(name, **({"ratio": 0.1} if name == "topk" else {}))


@case
def fp16_no_overflow():
    """fp16 average of [30000, -30000, 1] on every rank stays finite (scaled before sum)."""
    g = np.array([30000.0, -30000.0, 1.0], np.float32)
    out = hp.allreduce(g, "big", op="average", codec="fp16")
    assert np.all(np.isfinite(out)), out
    assert np.allclose(out, g, rtol=2 ** -10, atol=2 ** -10), out
    assert hp.stats()["big"]["strategy"] == expect_path("allreduce")


def expect_path(path):
    """The path a gradient takes: at world size 1 nothing travels (the input comes back)."""
    return path if hp.size() > 1 else "local"


@case
def inplace_matches_new_array():
    """inplace=True writes into the input on every path, bit-identical to a new array.

    Covers the direct uncompressed path (3 MiB, several partitions, rank-ordered sums
    with the owner's chunk overwritten last), fused small gradients, PS, Ring, gather
    and compressed allreduce.
    """
    r = hp.rank()
    rng = np.random.default_rng(40 + r)
    big = rng.standard_normal(3 << 18).astype(np.float32)
    for i, (codec, strategy, shape) in enumerate(EVERY_PATH):
        g = big[:int(np.prod(shape))].reshape(shape)
        c = path_codec(codec)
        ref = hp.allreduce(g, f"ip{i}/new", codec=c, strategy=strategy)
        buf = g.copy()
        out = hp.allreduce(buf, f"ip{i}/in", codec=c, strategy=strategy, inplace=True)
        assert out is buf, (codec, strategy)
        if codec not in ("terngrad", "powersgd"):  # their random streams depend on the name
            assert np.array_equal(out, ref), (codec, strategy)
        else:
            assert np.all(np.isfinite(out)) and out.shape == ref.shape
        same_everywhere(out.tobytes(), f"ip{i}")
    exact = np.empty_like(big)
    mpi_world().Allreduce(big, exact)
    got = hp.allreduce(big.copy(), "ip/exact", op="sum", codec="none", inplace=True)
    assert np.allclose(got, exact, rtol=1e-5, atol=1e-4)
    assert hp.stats()["ip/exact"]["strategy"] == expect_path("direct")


@case
def finished_tasks_release_their_arrays():
    """Once a result is in, the engine holds no reference to the input or result arrays.

    Reference counting alone must free them (the cyclic GC is disabled here): a reference
    cycle between a finished task and its primitives once kept the gradients' memory alive
    until the GC ran, so PyTorch could not reuse it and faulted in fresh pages every step.
    Every path of :data:`EVERY_PATH`, in place and into a new array.
    """
    import gc
    import weakref

    r = hp.rank()
    gc.collect()
    gc.disable()
    try:
        for i, (codec, strategy, shape) in enumerate(EVERY_PATH):
            c = path_codec(codec)
            for inplace in (True, False):
                g = np.random.default_rng(i + r).standard_normal(shape).astype(np.float32)
                refs = [weakref.ref(g)]
                out = hp.allreduce(g, f"rel{i}/{inplace}", codec=c, strategy=strategy,
                                   inplace=inplace)
                assert (out is g) == inplace, (codec, strategy, inplace)
                refs.append(weakref.ref(out))
                del g, out
                deadline = time.monotonic() + 5.0  # the engine thread leaves the task
                while any(ref() is not None for ref in refs) and time.monotonic() < deadline:
                    time.sleep(0.01)
                alive = [k for k, ref in enumerate(refs) if ref() is not None]
                assert not alive, (f"{codec}/{strategy} inplace={inplace}: arrays "
                                   f"{alive} (0 input, 1 result) still referenced 5 s later")
    finally:
        gc.enable()


@case
def world1_passthrough():
    """World size 1: every codec returns the input exactly and leaves no residual."""
    if hp.size() != 1:
        return
    g = np.random.default_rng(3).standard_normal((64, 33)).astype(np.float32)
    for codec in ("onebit", "dgc", "powersgd", "terngrad"):
        out = hp.allreduce(g, f"w1/{codec}", codec=hp_codec(codec))
        assert np.array_equal(out, g) and out is not g, codec
        assert hp.stats()[f"w1/{codec}"]["strategy"] == "local"
    buf = g.copy()
    assert hp.allreduce(buf, "w1/inplace", codec="onebit", inplace=True) is buf
    assert not any(hp.state_dict()["memories"].values())


@case
def terngrad_shared_scale():
    """World 2: shared scale 1.0; the decoded average is unbiased for [0.6, -0.2]."""
    r = hp.rank()
    g = np.array([1.0, -0.5] if r == 0 else [0.2, 0.1], np.float32)
    runs = 400
    outs = np.stack([hp.allreduce(g, "tern", codec="terngrad", strategy="allreduce")
                     for _ in range(runs)])
    # Every output is scale * (sum of codes) / 2 with the shared scale s = 1.0:
    assert np.all(np.isin(outs, [-1.0, -0.5, 0.0, 0.5, 1.0])), np.unique(outs)
    assert np.any(outs[:, 0] == 1.0)  # both ranks code +1 -> s = 1 reached
    mean = outs.mean(axis=0)
    # per element, var <= (s^2/4) * (p0(1-p0) + p1(1-p1)) <= 0.125; 4 sigma over 400 runs
    assert np.allclose(mean, [0.6, -0.2], atol=4 * np.sqrt(0.125 / runs)), mean
    same_everywhere(outs.tobytes(), "tern")


@case
def all_codecs_bit_identical():
    """Every codec under every strategy ends bit-identical on every rank, within bounds."""
    r, n = hp.rank(), hp.size()
    rng = np.random.default_rng(7 + r)
    grads = {f"g{i}": rng.standard_normal(s).astype(np.float32)
             for i, s in enumerate([(64, 33), (1000,), (5,)])}
    exact = {}
    comm = mpi_world()
    for k, g in grads.items():
        ref = np.empty_like(g)
        comm.Allreduce(g, ref)
        exact[k] = ref / n
    for codec in codec_names():
        if codec.startswith("compll."):
            continue
        for strategy in (None, "ps", "ring"):
            for k, g in grads.items():
                name = f"{codec}/{strategy}/{k}"
                out = hp.allreduce(g, name, codec=hp_codec(codec), strategy=strategy)
                assert out.shape == g.shape and out.dtype == g.dtype
                assert np.all(np.isfinite(out)), name
                same_everywhere(out.tobytes(), name)
                if codec in ("none", "fp16", "bf16"):
                    tol = {"none": 1e-6, "fp16": 2e-3, "bf16": 1.6e-2}[codec]
                    assert np.allclose(out, exact[k], rtol=tol, atol=tol * 4), name
                else:
                    # lossy: the error is no larger than the sum of what was there
                    err = np.linalg.norm(out - exact[k])
                    bound = 3.0 * np.sqrt(n) * max(np.linalg.norm(g) for g in [grads[k]])
                    assert err <= bound, (name, err, bound)


@case
def error_feedback_tracks_sum():
    """With error feedback the running sum of synchronized gradients tracks the exact one.

    Every encode's error stays in some rank's residual, so after T steps
    N * sum_t(out_t - exact_t) == -(sum of every residual on every rank) exactly (up to
    float rounding): the drift is one bounded residual, not T steps of error.
    """
    r, n = hp.rank(), hp.size()
    comm = mpi_world()
    # sparsifiers keep 10% here: with 1% the residual needs ~100 steps to drain
    # DGC with momentum 0: its memory's velocity is then exactly the residual (with momentum
    # correction the output sums momentum-accumulated gradients, by design)
    sparse = {"topk": {"ratio": 0.1}, "dgc": {"ratio": 0.1, "momentum": 0.0}}
    for codec, strategy in (("onebit", "ps"), ("onebit", "ring"), ("topk", None),
                            ("tbq", "ps"), ("dgc", None)):
        if codec not in codec_names():
            continue
        name = f"ef/{codec}/{strategy}"
        rng = np.random.default_rng(11 + r)
        drift = np.zeros(300, np.float64)
        step_norm = []
        for _ in range(30):
            g = (rng.standard_normal(300) + 0.3).astype(np.float32)
            out = hp.allreduce(g, name, codec=hp_codec(codec, **sparse.get(codec, {})),
                               strategy=strategy)
            ref = np.empty_like(g)
            comm.Allreduce(g, ref)
            drift += out.astype(np.float64) - ref.astype(np.float64) / n
            step_norm.append(np.linalg.norm(ref / n))
        mem = hp.state_dict()["memories"]
        local = sum(float(v.astype(np.float64).sum()) for m in mem.values()
                    for k, v in m.items()
                    if (k == name or k.startswith((name + "#", name + "/")))
                    and not k.endswith("/u"))
        total = sum(hp.broadcast_object(local, root=i, name=f"{name}/res{i}") for i in range(n))
        assert abs(drift.sum() * n + total) <= 1e-3 * (1 + abs(total)), (
                name, drift.sum() * n, total)
        # and the drift is small against the 30 steps it spans
        assert np.linalg.norm(drift) <= 0.5 * sum(step_norm), (name, np.linalg.norm(drift),
                                                               sum(step_norm))


@case
def partitions_and_fusion():
    """Partitioned PS/ring and fused small gradients give the right values."""
    r, n = hp.rank(), hp.size()
    big = np.arange(10_001, dtype=np.float32) * (r + 1)
    out = hp.allreduce(big, "big.none", op="sum", codec="none")
    assert np.array_equal(out, np.arange(10_001, dtype=np.float32) * n * (n + 1) / 2)
    for strategy in ("ps", "ring"):
        out = hp.allreduce(big / (r + 1), f"big.fp16.{strategy}", codec="fp16", strategy=strategy)
        assert np.allclose(out, np.arange(10_001, dtype=np.float32), rtol=1e-3)
        assert hp.stats()[f"big.fp16.{strategy}"]["strategy"] == expect_path(strategy)
    hs = [hp.allreduce_async(np.full(3, float(i + r), np.float32), f"small.{i}", op="sum",
                             codec="none") for i in range(50)]
    for i, h in enumerate(hs):
        assert np.array_equal(hp.synchronize(h), np.full(3, float(i * n + n * (n - 1) / 2)))


@case
def powersgd_compresses_matrices():
    """PowerSGD gets the gradient's matrix shape: payload ~ (m + n) * r, not m * n."""
    r, n = hp.rank(), hp.size()
    rng = np.random.default_rng(5 + r)
    u = rng.standard_normal((256, 1)).astype(np.float32)
    g = u @ np.ones((1, 128), np.float32)  # rank 1: PowerSGD r=1 recovers it closely
    out = hp.allreduce(g, "psgd.w", codec=hp_codec("powersgd", rank=1))
    st = hp.stats()["psgd.w"]
    if n > 1:
        assert st["strategy"] == "allreduce" and st["compression_ratio"] > 50, st
    else:
        assert st["strategy"] == "local" and np.array_equal(out, g), st
    comm = mpi_world()
    ref = np.empty_like(g)
    comm.Allreduce(g, ref)
    ref /= n
    assert np.linalg.norm(out - ref) <= 0.35 * np.linalg.norm(ref), (
        np.linalg.norm(out - ref), np.linalg.norm(ref))
    same_everywhere(out.tobytes(), "psgd")


@case
def powersgd_feedback_matches_reference():
    """PowerSGD with error feedback through the engine (compensated in the residual's
    buffer, P Q^T written into the output) is bit for bit the textbook flow: a fresh
    compensated array, the codec's stages summed in rank order, e = c - feedback; three
    steps, so the residual reaches the later results. New result arrays and in place,
    a matrix (compressed) and a vector (sent whole, its residual stays zero)."""
    from hipress.codecs import get_codec
    from hipress.memory.base import ResidualMemory

    r, n = hp.rank(), hp.size()
    if n == 1:
        return
    comm = mpi_world()
    for inplace in (False, True):
        tag = f"psgd.ef.{int(inplace)}"
        ref_codec, ref_mem = get_codec("powersgd", rank=1), ResidualMemory()
        codec = get_codec("powersgd", rank=1)
        for step in range(3):
            rng = np.random.default_rng(100 * step + r)
            grads = {f"{tag}.w": rng.standard_normal((96, 40)).astype(np.float32),
                     f"{tag}.b": rng.standard_normal(40).astype(np.float32)}
            work = {k: g.copy() for k, g in grads.items()}
            hs = {k: hp.allreduce_async(g, k, codec=codec, inplace=inplace)
                  for k, g in work.items()}
            for k, g in grads.items():
                out = hp.synchronize(hs[k])
                assert hp.stats()[k]["strategy"] == "allreduce", hp.stats()[k]
                c = ref_mem.compensate(k, g)
                gen = ref_codec.reduce_stages(c, k, n, 1.0 / n)
                value = None
                while True:
                    try:
                        arr, op = gen.send(value)
                    except StopIteration as stop:
                        ref, fb = stop.value
                        break
                    assert op == "sum"
                    parts = comm.allgather(np.ascontiguousarray(arr).copy())
                    value = parts[0] + parts[1]
                    for part in parts[2:]:
                        value += part
                if fb is not None:
                    ref_mem.update(k, c, fb)
                assert out.dtype == ref.dtype and np.array_equal(out, ref), (k, step, inplace)
                if inplace:
                    assert out is work[k], k
                same_everywhere(out.tobytes(), f"{k}.{step}")
                # the engine's residual itself, not only what it changed in later results
                held = [m[k] for m in hp.state_dict()["memories"].values() if k in m]
                assert len(held) == 1 and np.array_equal(held[0], ref_mem.get(k)), (k, step)
        assert not np.any(hp.state_dict()["memories"]["residual"][f"{tag}.b"]), (
            "a vector sent whole keeps a zero residual")


@case
def plan_auto_followed():
    """sync.plan: auto profiles at init; big gradients get compressed, tiny ones do not."""
    hp.shutdown()
    hp.init({"compression": {"algorithm": "onebit"},
             "sync": {"plan": "auto", "plan_observe_steps": 0},
             "logging": {"level": "WARNING"}})
    r = hp.rank()
    rng = np.random.default_rng(r)
    grads = {"plan.big": rng.standard_normal((1024, 1024)).astype(np.float32),
             "plan.tiny": rng.standard_normal(16).astype(np.float32)}
    hs = {k: hp.allreduce_async(v, k, codec="auto") for k, v in grads.items()}
    for k, h in hs.items():
        out = hp.synchronize(h)
        same_everywhere(out.tobytes(), k)
    st = hp.stats()
    # what the plan decides depends on the costs measured just now; the engine must follow it
    from hipress.api import _engine
    from hipress.codecs import get_codec as _get

    plan = _engine()._plan
    assert plan.active
    for k, g in grads.items():
        compress, parts, strategy = plan.decide(k, g, _get("onebit"), None)
        assert st[k]["codec"] == ("onebit" if compress else "none"), (k, st[k], compress)
        if compress and strategy in ("ps", "ring"):
            assert st[k]["strategy"] == strategy, (k, st[k], strategy)
    assert st["plan.big"]["numel"] == 1024 * 1024
    # a codec passed explicitly is honoured where the plan says uncompressed (the engine
    # warns once, on rank 0): a 16-element gradient is never worth compressing
    t = rng.standard_normal(16).astype(np.float32)
    assert not plan.decide("plan.tiny.explicit", t, _get("onebit"), None)[0]
    hp.allreduce(t, "plan.tiny.explicit", codec="onebit")
    assert hp.stats()["plan.tiny.explicit"]["codec"] == "onebit", hp.stats()


@case
def plan_auto_observes_then_plans():
    """sync.plan: auto with 2 observed steps: the fixed policy until then, one plan made
    from them (identical on every rank, written to sync.plan_save), followed after."""
    hp.shutdown()
    save = os.environ["PLAN_SAVE"]
    hp.init({"compression": {"algorithm": "onebit"},
             "sync": {"plan": "auto", "plan_observe_steps": 2, "plan_save": save,
                      "plan_verify_steps": 0},
             "logging": {"level": "INFO"}})
    from hipress.api import _engine

    eng = _engine()
    follower = eng._plan
    r = hp.rank()
    rng = np.random.default_rng(r)
    shapes = {"obs.fc": (512, 1024), "obs.conv": (64, 64, 3, 3), "obs.bias": (16,)}
    for step in range(5):
        hs = {}
        for name, shape in shapes.items():  # the backward pass: last layer first
            time.sleep(0.01)
            hs[name] = hp.allreduce_async(rng.standard_normal(shape).astype(np.float32),
                                          name, codec="auto")
        for name, h in hs.items():
            same_everywhere(hp.synchronize(h).tobytes(), f"{name}.{step}")
        st = hp.stats()
        if step < 3:  # step 0 is left out, 1-2 observed: the fixed policy (64 KiB)
            assert follower.plan is None, step
            assert st["obs.fc"]["codec"] == "onebit" and st["obs.bias"]["codec"] == "none", st
            assert eng.timeline.enabled == (step >= 1), (step, eng.timeline.enabled)
        else:  # planned at the end of step 2: followed from step 3 on
            p = follower.plan
            assert p is not None and {g.name for g in p.gradients} == set(shapes), p
            for g in p.gradients:
                assert g.numel == int(np.prod(shapes[g.name])), g
                assert st[g.name]["codec"] == ("onebit" if g.compress else "none"), (g, st)
            # the recording stopped and its events were dropped (no timeline file)
            assert not eng.timeline.enabled and eng.timeline.events() == []
        hp.step()
    same_everywhere(follower.plan.to_json().encode(), "auto-plan")
    if r == 0:
        with open(save, encoding="utf-8") as f:
            assert f.read().strip() == follower.plan.to_json().strip()


def _obs_fc_step(eng, rng, shapes, step):
    """One step of random gradients of ``shapes`` (compressed by the policy), each result
    checked bit-identical across ranks; returns obs.fc's residual keys after it."""
    from hipress.memory import ResidualMemory

    hs = {n: hp.allreduce_async(rng.standard_normal(s).astype(np.float32), n, codec="auto")
          for n, s in shapes.items()}
    for name, h in hs.items():
        same_everywhere(hp.synchronize(h).tobytes(), f"{name}.{step}")
    mem = next(m for m in eng._memories.values() if isinstance(m, ResidualMemory))
    return sorted(k for k in mem.keys() if k.startswith("obs.fc#p") and "@" not in k)


@case
def plan_auto_regroups_residuals():
    """A run-time plan that cuts a gradient into 3 PS partitions where the fixed policy
    had 1: at its next job its residual is re-split (the log counts the elements carried;
    the values are checked in test_engine_local) and the steps run bit-identical."""
    hp.shutdown()
    from hipress.secopa import runtime

    real = _forced_plan(3)  # obs.fc in 3 PS partitions, obs.conv as the fixed policy had it
    try:
        hp.init({"compression": {"algorithm": "onebit"},
                 "sync": {"plan": "auto", "plan_observe_steps": 1},
                 "logging": {"level": "INFO"}})
        from hipress.api import _engine

        eng = _engine()
        rng = np.random.default_rng(hp.rank())
        shapes = {"obs.fc": (512, 1024), "obs.conv": (64, 64, 3, 3)}
        for step in range(4):
            fc = _obs_fc_step(eng, rng, shapes, step)
            # the fixed policy's one partition (2 MiB < 4 MiB) in steps 0-1, then the plan's
            assert fc == (["obs.fc#p0"] if step < 2 else
                          ["obs.fc#p0", "obs.fc#p1", "obs.fc#p2"]), (step, fc)
            hp.step()
        assert hp.stats()["obs.fc"]["codec"] == "onebit"
    finally:
        runtime.plan = real


@case
def plan_auto_drops_a_slower_plan():
    """A run-time plan (obs.fc in 3 PS partitions, the fixed policy's 1) whose timed steps
    rank 1's clock makes 5 s longer than its observed fixed-policy step: every rank (rank
    1 configured with another plan_verify_steps) drops the plan after the same step,
    goes back to the fixed policy (its residual re-split to one partition again) and
    every result stays bit-identical."""
    hp.shutdown()
    from hipress.api import _engine
    from hipress.secopa import runtime

    real_plan, real_clock = _forced_plan(3), runtime._clock
    slow = [0.0]

    def clock():
        eng = _engine()
        if eng.rank == 1 and eng._plan.plan is not None:  # a step under the plan: 5 s more
            slow[0] += 5.0
        return real_clock() + slow[0]

    runtime._clock = clock
    try:
        from hipress.api import env_rank

        # rank 0's plan_verify_steps applies on every rank (it goes with the plan)
        hp.init({"compression": {"algorithm": "onebit"},
                 "sync": {"plan": "auto", "plan_observe_steps": 1,
                          "plan_verify_steps": 2 if env_rank() == 0 else 5},
                 "logging": {"level": "INFO"}})
        eng = _engine()
        follower = eng._plan
        rng = np.random.default_rng(hp.rank())
        shapes = {"obs.fc": (512, 1024), "obs.conv": (64, 64, 3, 3)}
        for step in range(7):
            fc = _obs_fc_step(eng, rng, shapes, step)
            # step 0 left out, step 1 observed, the plan followed in steps 2-4 (2 settles
            # it, 3-4 timed), dropped at the end of step 4: the fixed policy from step 5
            planned = 2 <= step <= 4
            assert fc == (["obs.fc#p0", "obs.fc#p1", "obs.fc#p2"] if planned
                          else ["obs.fc#p0"]), (step, fc)
            assert (follower.plan is not None) == planned, step
            hp.step()
        assert follower.reverted and follower.verified["kept"] == 0.0, follower.verified
        assert follower.verified["plan_step_s"] >= 5.0, follower.verified  # rank 1's, maxed
        assert follower.verified["fixed_step_s"] < 5.0, follower.verified
        assert follower.verified["steps"] == 2.0
        same_everywhere(json.dumps(follower.verified, sort_keys=True).encode(), "verified")
        assert hp.stats()["obs.fc"]["codec"] == "onebit"
    finally:
        runtime.plan, runtime._clock = real_plan, real_clock


@case
def plan_gather_keeps_the_engines_partitions():
    """A plan's gather entry (priced as one unit, partitions 1) runs in the engine's own
    partitions, as the fixed policy does: a 2 MiB DGC gradient with 1 MiB partitions keeps
    its two partitions (and their residuals) after the plan, and the steps stay identical."""
    hp.shutdown()
    from hipress.secopa import runtime

    real = _forced_plan(1, "gather")
    try:
        hp.init({"compression": {"algorithm": "dgc", "params": {"ratio": 0.01}},
                 "sync": {"plan": "auto", "plan_observe_steps": 1,
                          "partition_bytes": 1 << 20},
                 "logging": {"level": "WARNING"}})
        from hipress.api import _engine

        eng = _engine()
        rng = np.random.default_rng(hp.rank())
        for step in range(4):
            h = hp.allreduce_async(rng.standard_normal((512, 1024)).astype(np.float32),
                                   "obs.fc", codec="auto")
            same_everywhere(hp.synchronize(h).tobytes(), f"obs.fc.{step}")
            keys = sorted(k for m in eng._memories.values() for k in m.keys()
                          if k.startswith("obs.fc"))
            # the plan (gather, 1 partition) applies from step 2 on: the same two
            # partitions, each with DGC's momentum (u) and accumulation (v)
            assert keys == ["obs.fc#p0/u", "obs.fc#p0/v", "obs.fc#p1/u", "obs.fc#p1/v"], (
                step, keys)
            hp.step()
        plan = eng._plan.plan
        assert plan is not None and plan.entry("obs.fc").partitions == 1, plan
        assert plan.entry("obs.fc").strategy == "gather"
        assert hp.stats()["obs.fc"]["strategy"] == "gather", hp.stats()
    finally:
        runtime.plan = real


def _forced_plan(parts, strategy="ps"):
    """Patch SeCoPa's planner: every gradient compressed on ``strategy``, obs.fc in
    ``parts`` partitions, the others in 1. Returns the real planner, to restore."""
    from hipress.secopa import runtime

    real = runtime.plan

    def forced(*a, **kw):
        p = real(*a, **kw)
        for g in p.gradients:
            g.compress, g.strategy = True, strategy
            g.partitions = parts if g.name == "obs.fc" else 1
        p.basis = "search"  # not the fixed policy (sync.plan_verify_steps times it)
        return p

    runtime.plan = forced
    return real


@case
def plan_auto_resume_on_rank0():
    """A checkpoint saved under a run-time plan (obs.fc in 3 partitions), loaded by rank 0
    only into a new job (its step count then differs from rank 1's): the residuals are
    re-split to the fixed policy's partitions, every rank plans at the same step again,
    and the values stay bit-identical."""
    from hipress.secopa import runtime

    shapes = {"obs.fc": (512, 1024), "obs.conv": (64, 64, 3, 3)}
    rng = np.random.default_rng(hp.rank())

    def train(steps, tag):
        for step in range(steps):
            hs = {n: hp.allreduce_async(rng.standard_normal(s).astype(np.float32), n,
                                        codec="auto") for n, s in shapes.items()}
            for name, h in hs.items():
                same_everywhere(hp.synchronize(h).tobytes(), f"{tag}.{name}.{step}")
            hp.step()

    cfg = {"compression": {"algorithm": "onebit"},
           "sync": {"plan": "auto", "plan_observe_steps": 1}, "logging": {"level": "WARNING"}}
    real = _forced_plan(3)
    try:
        hp.shutdown()
        hp.init(cfg)
        train(4, "first")
        state = hp.state_dict()
        mem = state["memories"]
        assert any("obs.fc#p2" in m for m in mem.values()), list(mem)
        hp.shutdown()
        runtime.plan = real
        _forced_plan(2)
        hp.init(cfg)
        if hp.rank() == 0:
            hp.load_state_dict(state)  # rank 0 only: its step count is now 4, rank 1's 0
        train(4, "resumed")
        from hipress.api import _engine

        p = _engine()._plan.plan
        assert p is not None and p.entry("obs.fc").partitions == 2, p
    finally:
        runtime.plan = real


@case
def plan_auto_join_early():
    """Rank 1 runs out of data (join) during the observed steps: rank 0's step raises a
    ConfigError naming the join and the fix, then both ranks end cleanly."""
    from hipress.errors import ConfigError

    hp.shutdown()
    hp.init({"compression": {"algorithm": "onebit"},
             "sync": {"plan": "auto", "plan_observe_steps": 2}, "logging": {"level": "WARNING"}})
    rng = np.random.default_rng(hp.rank())
    steps = 4 if hp.rank() == 0 else 2
    try:
        for _ in range(steps):
            hp.synchronize(hp.allreduce_async(
                rng.standard_normal((256, 256)).astype(np.float32), "obs.w", codec="auto"))
            hp.step()
        assert hp.rank() == 1, "rank 0 should have failed to plan"
    except ConfigError as exc:
        assert hp.rank() == 0, exc
        msg = str(exc)
        assert "observed steps 1-2" in msg and "join()" in msg and "[1]" in msg, msg
        assert "plan_observe_steps" in msg, msg
    assert hp.join() in (0, 1)


@case
def cycle_paces_rounds_and_waiting_flushes():
    """With a 5 s cycle: gradients submitted over ~40 ms start no round until a rank
    waits; the wait starts one at once (well under the cycle) and every value is exact."""
    hp.shutdown()
    hp.init({"sync": {"cycle_time_ms": 5000}, "logging": {"level": "WARNING"}})
    from hipress.api import _engine

    r, n = hp.rank(), hp.size()
    t0 = time.monotonic()
    for k in range(3):  # blocking calls: each flushes its own round
        out = hp.allreduce(np.full(4, float(r + k), np.float32), f"cyc.block{k}", op="sum")
        assert np.array_equal(out, np.full(4, float(sum(range(n)) + n * k), np.float32)), out
    assert time.monotonic() - t0 < 2.5, f"3 blocking allreduces took {time.monotonic() - t0:.2f} s"
    hp.barrier()  # every rank starts the next part together
    eng = _engine()
    before = eng._round
    hs = []
    for k in range(20):  # a backward pass: gradients ready one after another
        hs.append(hp.allreduce_async(np.full(8, float(r * 100 + k), np.float32),
                                     f"cyc.grad{k}", op="sum"))
        time.sleep(0.002)
    during = eng._round - before
    t1 = time.monotonic()
    outs = [hp.synchronize(h) for h in hs]
    waited = time.monotonic() - t1
    for k, out in enumerate(outs):
        want = float(100 * sum(range(n)) + n * k)
        assert np.array_equal(out, np.full(8, want, np.float32)), (k, out)
    assert during == 0, f"{during} rounds started while gradients arrived (cycle 5 s)"
    assert waited < 2.5, f"synchronize waited {waited:.2f} s (the cycle is 5 s)"
    assert eng._round - before <= 3, f"{eng._round - before} rounds for 20 gradients"
    hp.shutdown()


@case
def small_gradients_share_rounds_until_a_partition_is_queued():
    """A 5 ms cycle, a 2 s longest cycle and 64 KiB partitions: 20 small gradients
    submitted over ~100 ms start no round (less than a partition is queued); a 128 KiB
    gradient starts one within a second with no rank waiting, and every value is exact."""
    hp.shutdown()
    hp.init({"sync": {"cycle_time_ms": 5, "max_cycle_time_ms": 2000,
                      "partition_bytes": 64 * 1024}, "logging": {"level": "WARNING"}})
    from hipress.api import _engine

    r, n = hp.rank(), hp.size()
    hp.barrier()  # every rank starts the submissions together, right after a round
    eng = _engine()
    before = eng._round
    hs = []
    for k in range(20):  # the small gradients of a slow backward pass
        hs.append(hp.allreduce_async(np.full(8, float(r * 100 + k), np.float32),
                                     f"batch.small{k}", op="sum"))
        time.sleep(0.005)
    during = eng._round - before
    big = np.arange(32 * 1024, dtype=np.float32) + r  # 128 KiB: two partitions
    t0 = time.monotonic()
    hs.append(hp.allreduce_async(big, "batch.big", op="sum"))
    while eng._round == before + during and time.monotonic() - t0 < 5.0:
        time.sleep(0.001)  # no rank waits on a handle: no flush
    started = time.monotonic() - t0
    outs = [hp.synchronize(h) for h in hs]
    for k, out in enumerate(outs[:-1]):
        want = float(100 * sum(range(n)) + n * k)
        assert np.array_equal(out, np.full(8, want, np.float32)), (k, out)
    want_big = n * np.arange(32 * 1024, dtype=np.float32) + sum(range(n))
    assert np.array_equal(outs[-1], want_big), outs[-1][:4]
    assert during == 0, f"{during} rounds started for 20 small gradients (longest cycle 2 s)"
    assert started < 1.0, (f"the round for a partition's worth of bytes took {started:.2f} s "
                           "(the cycle is 5 ms, the longest cycle 2 s)")
    hp.shutdown()


@case
def duplicate_inflight_name():
    h = hp.allreduce_async(np.ones(3, np.float32), "dup")
    if hp.size() == 1:  # complete on return: nothing is in flight at world size 1
        assert hp.poll(h) and np.array_equal(hp.synchronize(h), np.ones(3, np.float32))
        return
    try:
        hp.allreduce_async(np.ones(3, np.float32), "dup")
    except ValueError as exc:
        assert "dup" in str(exc) and "in flight" in str(exc)
    else:
        raise AssertionError("duplicate in-flight name was accepted")
    hp.synchronize(h)


@case
def low_precision_dtypes():
    from hipress.backend import bfloat16

    n = hp.size()
    for dt in (np.float16, bfloat16, np.float64):
        g = np.array([1.5, 2.0, -3.0], dtype=dt)
        out = hp.allreduce(g, f"lp.{np.dtype(dt).name}", op="sum")
        assert out.dtype == np.dtype(dt)
        assert np.array_equal(out.astype(np.float32), np.array([1.5, 2.0, -3.0]) * n)


@case
def stall_names_missing_rank():
    """Rank 0 submits grad/a, the others grad/a_1: every rank fails naming both."""
    r = hp.rank()
    name = "grad/a" if r == 0 else "grad/a_1"
    t0 = time.monotonic()
    try:
        hp.allreduce(np.ones(4, np.float32), name)
    except Exception as exc:  # noqa: BLE001
        msg = str(exc)
        assert type(exc).__name__ == "StallError", repr(exc)
        assert "'grad/a'" in msg and "'grad/a_1'" in msg and "rank(s) [0]" in msg, msg
        assert time.monotonic() - t0 < 10, time.monotonic() - t0
        print(f"rank {r} STALL {msg}", flush=True)
    else:
        raise AssertionError("stall was not detected")


@case
def timeline_and_stats():
    path = os.environ["HIPRESS_TIMELINE"]
    g = np.random.default_rng(hp.rank()).standard_normal(5000).astype(np.float32)
    hp.allreduce(g, "tl.onebit", codec="onebit", strategy="ps")
    for h in hp.grouped_allreduce_async([g[:10], g[10:20]], ["tl.g0", "tl.g1"]):
        hp.synchronize(h)
    hp.step()  # one engine-cpu event per step: start-up, then the second step's own
    hp.allreduce(g, "tl.onebit", codec="onebit", strategy="ps")
    hp.step()
    st = hp.stats()["tl.onebit"]
    assert st["codec"] == "onebit" and st["strategy"] == "ps"
    assert st["compression_ratio"] > 20, st
    hp.shutdown()
    if hp_rank0():
        data = json.load(open(path))
        names = {e["name"] for e in data["traceEvents"]}
        assert {"encode", "decode", "merge+encode"} <= names, names
        assert {e["pid"] for e in data["traceEvents"]} == set(range(int(os.environ["NP"])))


@case
def dead_rank():
    """Rank 1 dies mid-run; the others must not hang (the test bounds the wall time)."""
    if hp.rank() == 1:
        time.sleep(0.5)
        os._exit(3)
    for i in range(1000):
        hp.allreduce(np.ones(10, np.float32), f"live.{i}")
        time.sleep(0.01)


@case
def failure_on_one_rank_fails_all():
    """A codec raising on rank 1 only: rank 1 raises that error, the others a PeerFailure
    (a SyncError) naming rank 1, all within seconds (not after a stall timeout)."""
    from hipress.codecs.onebit import OneBitCodec

    class Exploding(OneBitCodec):
        def encode(self, x, name=""):
            if _rank == 1:
                raise RuntimeError("boom on rank 1")
            return super().encode(x, name)

        def encode_residual(self, x, residual, name=""):
            return self.encode(x, name) if _rank == 1 else super().encode_residual(
                x, residual, name)

        def encode_residual_deferred(self, x, state, pending, name=""):
            return self.encode(x, name) if _rank == 1 else super().encode_residual_deferred(
                x, state, pending, name)

    t0 = time.monotonic()
    try:
        hp.allreduce(np.ones(64, np.float32), "boom.grad", codec=Exploding(), strategy="ps")
    except Exception as exc:  # noqa: BLE001
        if _rank == 1:
            assert "boom on rank 1" in str(exc), repr(exc)
        else:
            assert type(exc).__name__ == "PeerFailure", repr(exc)  # a SyncError
            assert "rank 1 failed" in str(exc) and "boom on rank 1" in str(exc), str(exc)
        assert time.monotonic() - t0 < 10
    else:
        raise AssertionError("the failure on rank 1 went unnoticed")


@case
def powersgd_stage_error_drops_residual():
    """PowerSGD compensates in the residual's own buffer, so while its stages run that
    buffer holds g + e, not e. When rank 1's stage raises (a finite gradient whose
    projection P = M Q overflows float32), rank 1 raises that error and the others a
    PeerFailure naming rank 1, within seconds; on every rank the gradient's residual is
    then gone (the failing rank's stage error, the others' tasks closed when their
    engines stopped), not left holding the compensated gradient."""
    from hipress.codecs import get_codec

    r = hp.rank()
    codec = get_codec("powersgd", rank=1)
    name = "psgd.err.w"
    hp.allreduce(np.random.default_rng(r).standard_normal((96, 40)).astype(np.float32),
                 name, codec=codec)
    before = _residuals(name)
    assert list(before) == [name] and np.any(before[name]), sorted(before)
    q = codec.state_dict()[name]  # the warm start the next step projects onto
    g = np.random.default_rng(10 + r).standard_normal((96, 40)).astype(np.float32)
    if r == 1:
        # every row +-2e37 * sign(Q): each P_i = +-2e37 * sum|Q_j| overflows float32, while
        # the rows' alternating signs keep the engine's finite check (a float32 sum of the
        # gradient) finite, so the gradient does go to the codec
        assert np.abs(q).sum() > 20, q.ravel()
        rows = np.where(np.arange(96) % 2 == 0, 1, -1).astype(np.float32)[:, None]
        g[...] = np.float32(2e37) * rows * np.where(q[:, 0] >= 0, 1, -1).astype(np.float32)
        assert np.isfinite(g.sum(dtype=np.float32))
    t0 = time.monotonic()
    try:
        hp.allreduce(g, name, codec=codec)
    except Exception as exc:  # noqa: BLE001
        if r == 1:
            assert type(exc).__name__ == "NonFiniteGradientError", repr(exc)
            assert "PowerSGD projection" in str(exc), str(exc)
        else:
            assert type(exc).__name__ == "PeerFailure", repr(exc)
            assert "rank 1 failed" in str(exc) and "NonFiniteGradientError" in str(exc), str(exc)
        assert time.monotonic() - t0 < 10
    else:
        raise AssertionError("rank 1's overflowing projection went unnoticed")
    assert _residuals(name) == {}, "the compensated gradient was kept as the residual"


def _residuals(name):
    out = {}
    for table in hp.state_dict()["memories"].values():
        for key, value in table.items():
            if key == name or key.startswith(name + "#"):
                out[key] = np.array(value, copy=True)
    return out


@case
def ps_bulk_matches_one_task_per_gradient():
    """Small PS gradients submitted together run in bulk tasks (several per task, mixed
    codecs and dtypes); results and residuals are bit-identical to the same gradients
    synchronized one at a time (one ps_task each)."""
    r = hp.rank()
    shapes = [(7,), (64,), (33, 5), (256,), (1000,), (4096, 3), (1,)] * 3
    codecs = ["onebit", "tbq", "onebit"]
    rng = np.random.default_rng(r)
    steps = [[rng.standard_normal(s).astype(np.float64 if i % 5 == 4 else np.float32)
              for i, s in enumerate(shapes)] for _ in range(3)]
    results = {}
    for mode in ("bulk", "one"):
        outs = []
        for grads in steps:
            if mode == "bulk":
                hs = [hp.allreduce_async(g, f"{mode}.{i}", codec=codecs[i % 3], strategy="ps")
                      for i, g in enumerate(grads)]
                outs.append([hp.synchronize(h) for h in hs])
            else:
                outs.append([hp.allreduce(g, f"{mode}.{i}", codec=codecs[i % 3], strategy="ps")
                             for i, g in enumerate(grads)])
        results[mode] = outs
    for step, (got, want) in enumerate(zip(results["bulk"], results["one"])):
        for i, (a, b) in enumerate(zip(got, want)):
            assert a.dtype == b.dtype and a.shape == b.shape, (step, i)
            assert np.array_equal(a, b), (step, i, float(np.abs(a - b).max()))
        same_everywhere(b"".join(a.tobytes() for a in got), f"bulk.{step}")
    # worker residuals live on every rank; a server residual (@agg) on the aggregator,
    # which the name picks: compare those over all ranks
    server = {}
    for i in range(len(shapes)):
        bulk = {k.replace("bulk.", "one.", 1): v for k, v in _residuals(f"bulk.{i}").items()}
        one = _residuals(f"one.{i}")
        for table, mode in ((bulk, "bulk"), (one, "one")):
            server.update({(mode, k): v.tolist() for k, v in table.items() if "@agg" in k})
        own = {k for k in one if "@agg" not in k}
        assert own and own == {k for k in bulk if "@agg" not in k}, (i, sorted(bulk), sorted(one))
        assert all(np.array_equal(bulk[k], one[k]) for k in own), (i, "residual")
    everywhere = {}
    for src in range(hp.size()):
        everywhere.update(hp.broadcast_object(server, root=src, name=f"bulk-agg-{src}"))
    assert {k for m, k in everywhere if m == "bulk"} == {k for m, k in everywhere if m == "one"}
    assert all(everywhere[("bulk", k)] == everywhere[("one", k)]
               for m, k in everywhere if m == "one")
    st = hp.stats()
    bulked = sum(st[f"bulk.{i}"].get("bulk_calls", 0) for i in range(len(shapes)))
    assert bulked >= len(shapes), bulked  # at least one step's worth ran in bulk
    assert all("bulk_calls" not in st[f"one.{i}"] for i in range(len(shapes)))
    assert all(st[f"bulk.{i}"]["strategy"] == "ps" for i in range(len(shapes)))


@case
def empty_compressed_gradients_complete():
    """Zero-element gradients on every compressed path complete with empty results (a
    zero-size PS gradient divided by zero partitions and stopped the engine)."""
    for codec, strategy in [("onebit", "ps"), ("onebit", "ring"), ("tbq", "ps"),
                            ("terngrad", "allreduce"), ("dgc", None), ("powersgd", None)]:
        for shape in [(0,), (0, 3)]:
            out = hp.allreduce(np.zeros(shape, np.float32),
                               f"empty.{codec}.{strategy}.{len(shape)}", codec=codec,
                               strategy=strategy)
            assert out.shape == shape and out.dtype == np.float32, (codec, out.shape)
    out = hp.allreduce(np.full(3, float(hp.rank() + 1), np.float32), "after.empty",
                       codec="onebit", strategy="ps")
    n = hp.size()
    assert np.allclose(out, (n + 1) / 2), out  # the engine goes on


@case
def nonfinite_passes_through():
    """inf/NaN on some ranks, with every codec path: every rank receives the gradient
    non-finite (bit-identical), residuals and codec state stay, the next call is normal."""
    r, n = hp.rank(), hp.size()
    paths = [("onebit", "ps"), ("onebit", "ring"), ("terngrad", "allreduce"),
             ("tbq", "ps"), ("dgc", None), ("powersgd", None), ("fp16", None)]
    for codec, strategy in paths:
        name = f"nf.{codec}.{strategy}"
        rng = np.random.default_rng(r)
        shape = (64, 48)
        hp.allreduce(rng.standard_normal(shape).astype(np.float32), name, codec=codec,
                     strategy=strategy)
        before = _residuals(name)
        state_before = json.dumps({k: {q: np.asarray(v).tolist() for q, v in c.items()}
                                   for k, c in hp.state_dict()["codecs"].items()})
        g = rng.standard_normal(shape).astype(np.float32)
        if r == 1:
            g[0, 5] = np.nan
        if r == n - 1:
            g[1, 9] = -np.inf
        out = hp.allreduce(g, name, codec=codec, strategy=strategy)
        assert np.isnan(out[0, 5]) and not np.isfinite(out[1, 9]), (codec, out[0, 5], out[1, 9])
        assert np.isfinite(np.delete(out.reshape(-1), [5, 48 + 9])).all(), codec
        same_everywhere(out.tobytes(), f"{name}.bad")
        assert hp.stats()[name]["nonfinite_steps"] == 1, hp.stats()[name]
        after = _residuals(name)
        assert after.keys() == before.keys(), (codec, sorted(before), sorted(after))
        assert all(np.array_equal(after[k], before[k]) for k in before), (codec, "residual")
        state_after = json.dumps({k: {q: np.asarray(v).tolist() for q, v in c.items()}
                                  for k, c in hp.state_dict()["codecs"].items()})
        assert state_after == state_before, (codec, "codec state moved")
        out = hp.allreduce(rng.standard_normal(shape).astype(np.float32), name, codec=codec,
                           strategy=strategy)
        assert np.isfinite(out).all(), codec
        same_everywhere(out.tobytes(), f"{name}.next")
        assert hp.stats()[name]["codec"] == codec and hp.stats()[name]["nonfinite_steps"] == 1


@case
def direct_calls_exact_under_policy():
    """A lossy policy (onebit, 4 KiB threshold) leaves hp.allreduce exact; codec="auto" and
    an explicit codec compress, whatever the size."""
    hp.shutdown()
    hp.init({"compression": {"algorithm": "onebit", "min_compress_bytes": 4096},
             "logging": {"level": "WARNING"}})
    r, n = hp.rank(), hp.size()
    metric = np.random.default_rng(r).integers(-999, 999, 2048).astype(np.float32) * n
    want = sum(np.random.default_rng(k).integers(-999, 999, 2048).astype(np.float32) * n
               for k in range(n)) / np.float32(n)
    out = hp.allreduce(metric, "metric")
    assert np.array_equal(out, want), float(np.abs(out - want).max())
    assert hp.stats()["metric"]["codec"] == "none"
    hp.allreduce(metric, "metric.auto", codec="auto")
    assert hp.stats()["metric.auto"]["codec"] == "onebit", hp.stats()["metric.auto"]
    hp.allreduce(np.ones(1000, np.float32), "w", codec="onebit", strategy="ps")
    st = hp.stats()["w"]
    assert st["codec"] == "onebit" and st["strategy"] == "ps", st
    small = np.ones(100, np.float32)
    hp.allreduce(small, "small.auto", codec="auto")  # below the threshold: uncompressed
    assert hp.stats()["small.auto"]["codec"] == "none"
    root = hp.broadcast(metric, root=n - 1, name="metric.bcast")
    assert np.array_equal(root, np.random.default_rng(n - 1).integers(
        -999, 999, 2048).astype(np.float32) * n)


@case
def peer_payload_wrong_size():
    """Rank 1's payloads claim shape (1,) for a 64-element gradient (gather path, fp16):
    every rank refuses them with an error naming both counts; none is broadcast into the
    sum (rank 0 used to return g0 + g1[0] without a word)."""
    from hipress.codecs import get_codec

    r = hp.rank()
    codec = get_codec("fp16")
    if r == 1:
        real = codec.encode
        codec.encode = lambda x, name="": real(x[:1], name=name)
    g = np.arange(64, dtype=np.float32) + r
    try:
        out = hp.allreduce(g, "short.grad", op="sum", codec=codec, strategy="gather")
    except Exception as exc:  # noqa: BLE001
        msg = str(exc)
        # rank r's own PayloadError, or the PeerFailure telling it that a peer's decode failed
        assert type(exc).__name__ in ("PayloadError", "PeerFailure"), repr(exc)
        assert "PayloadError" in msg or type(exc).__name__ == "PayloadError", msg
        assert "declares 1 elements (shape (1,)) but the receiver expects 64" in msg, msg
        print(f"rank {r} REFUSED {type(exc).__name__}: {msg}", flush=True)
    else:
        raise AssertionError(f"a payload of 1 element was merged into 64: {out[:4]}")


@case
def shape_mismatch_same_numel():
    """PowerSGD with (100, 200) on rank 0 and (200, 100) on rank 1 (same element count):
    every rank raises the negotiation's CollectiveArgumentError naming both shapes (it
    used to end in MPI_ERR_TRUNCATE), and the engine goes on."""
    r = hp.rank()
    shape = (100, 200) if r == 0 else (200, 100)
    g = np.ones(shape, np.float32)
    try:
        out = hp.allreduce(g, "psgd.shape", codec=hp_codec("powersgd", rank=1))
    except Exception as exc:  # noqa: BLE001
        msg = str(exc)
        assert type(exc).__name__ == "CollectiveArgumentError", repr(exc)
        assert "ranks disagree about allreduce 'psgd.shape'" in msg, msg
        assert "'shape': [100, 200]" in msg and "'shape': [200, 100]" in msg, msg
        print(f"rank {r} MISMATCH {msg}", flush=True)
    else:
        raise AssertionError(f"mismatched shapes were synchronized: {out.shape}")
    ok = hp.allreduce(np.full(3, r + 1.0, np.float32), "after.shape", op="sum")
    assert np.array_equal(ok, np.full(3, sum(q + 1.0 for q in range(hp.size())))), ok


@case
def grouped_allreduce_count_mismatch_fails_every_rank():
    """Rank r groups r+1 tensors under the same names: every rank's call fails with a
    CollectiveArgumentError naming the group sizes, no name is left waiting (a 5 s stall
    bound would end the job), and a later grouped allreduce is exact."""
    from hipress.errors import CollectiveArgumentError

    r, n = hp.rank(), hp.size()
    if n == 1:
        return
    names = [f"gm.{i}" for i in range(r + 1)]
    try:
        out = hp.grouped_allreduce([np.ones(2, np.float32)] * (r + 1), names, op="sum")
    except CollectiveArgumentError as exc:
        assert "disagree about the group of allreduce 'gm.0'" in str(exc), str(exc)
    else:
        raise AssertionError(f"grouped allreduces of different sizes ran: {out}")
    time.sleep(6.0)  # past the 5 s stall bound: a name left waiting would fail the job
    got = hp.grouped_allreduce([np.full(2, r + 1.0, np.float32)] * 2, ["gm.a", "gm.b"],
                               op="sum")
    want = np.full(2, n * (n + 1) / 2, np.float32)
    assert all(np.array_equal(g, want) for g in got), got


@case
def broadcast_mismatch_fails_every_rank():
    """A broadcast whose tensors differ in shape (same bytes) or dtype (same byte size)
    fails on every rank, naming both; a byte-object broadcast and a good one still work."""
    from hipress.errors import CollectiveArgumentError

    r, n = hp.rank(), hp.size()
    if n == 1:
        return
    cases = [("bm.shape", np.zeros((2, 3) if r == 0 else (3, 2), np.float32), "[2, 3]"),
             ("bm.dtype", np.zeros(4, np.float64) if r == 0 else np.zeros(4, np.int64),
              "'int64'")]
    for name, arr, want in cases:
        try:
            out = hp.broadcast(arr, 0, name)
        except CollectiveArgumentError as exc:
            assert f"broadcast {name!r}" in str(exc) and want in str(exc), str(exc)
        else:
            raise AssertionError(f"{name}: a mismatched broadcast ran: {out}")
    try:  # roots differ: the description names the byte count as such, not as a shape
        out = hp.broadcast(np.zeros(4, np.float32), r % 2, "bm.root")
    except CollectiveArgumentError as exc:
        msg = str(exc)
        assert "'root': 0" in msg and "'root': 1" in msg and "'nbytes': 16" in msg, msg
        assert "'shape'" not in msg, msg
    else:
        raise AssertionError(f"bm.root: broadcasts with different roots ran: {out}")
    assert hp.broadcast_object({"rank": r} if r == 1 else None, 1, "bm.obj") == {"rank": 1}
    got = hp.broadcast(np.full(3, float(r), np.float32), n - 1, "bm.ok")
    assert np.array_equal(got, np.full(3, n - 1.0, np.float32)), got


@case
def broadcast_pipelined_sizes_and_roots():
    """Broadcasts on both sides of the direct/pipelined switch, from every root, with
    segments small enough for many per chunk: every rank gets the root's bytes, and the
    root sends them once (each non-root forwards its chunk to the others) instead of once
    per rank."""
    from hipress.engine import tasks as T

    r, n = hp.rank(), hp.size()
    saved = T.BCAST_DIRECT_BYTES, T.BCAST_SEGMENT_BYTES
    T.BCAST_DIRECT_BYTES, T.BCAST_SEGMENT_BYTES = 1000, 700
    try:
        sizes = [0, 1, 999, 1000, 1001, 1002, 4099, 77777]
        for root in range(n):
            handles = []
            for size in sizes:
                data = np.random.default_rng(size + 7 * root).integers(
                    0, 256, size, dtype=np.uint8)
                mine = data if r == root else np.zeros(size, np.uint8)
                handles.append((size, data, hp.broadcast_async(mine, root, f"bp.{root}.{size}")))
            for size, data, h in handles:
                got = hp.synchronize(h)
                assert got.dtype == np.uint8 and np.array_equal(got, data), (root, size)
                sent = hp.stats().get(f"bp.{root}.{size}", {}).get("bytes_sent", 0)
                if n == 1:
                    want = 0
                elif n == 2 or size <= T.BCAST_DIRECT_BYTES:
                    want = (n - 1) * size if r == root else 0
                elif r == root:
                    want = size
                else:  # its chunk to each of the other n - 2 non-roots
                    i = [k for k in range(n) if k != root].index(r)
                    q, rem = divmod(size, n - 1)
                    want = (n - 2) * (q + (1 if i < rem else 0))
                assert sent == want, (root, size, sent, want)
        # a float tensor of several default-sized segments per chunk, and an object
        T.BCAST_DIRECT_BYTES, T.BCAST_SEGMENT_BYTES = saved
        big = np.arange(3_000_000, dtype=np.float32) * (1.0 if r == n - 1 else 0.0)
        got = hp.broadcast(big, n - 1, "bp.big")
        assert got.dtype == np.float32 and np.array_equal(
            got, np.arange(3_000_000, dtype=np.float32)), got[:4]
        for dt in (np.complex64, np.dtype(">f4")):  # bytes of any dtype travel
            want = (np.arange(70_000) * (1 + 2j if np.dtype(dt).kind == "c" else 1)).astype(dt)
            got = hp.broadcast((want * (r == 0)).astype(dt), 0, f"bp.{np.dtype(dt).str}")
            assert got.dtype == np.dtype(dt) and np.array_equal(got, want), (dt, got[:3])
        obj = {"blob": bytes(range(256)) * 5000, "rank": r}
        assert hp.broadcast_object(obj if r == 0 else None, 0, "bp.obj") == {
            "blob": bytes(range(256)) * 5000, "rank": 0}
    finally:
        T.BCAST_DIRECT_BYTES, T.BCAST_SEGMENT_BYTES = saved


@case
def broadcast_root_error_fails_every_rank():
    """The root's array shrinks after its broadcast was announced: the root's task fails
    at its first step, inside a negotiation round. The root raises that PayloadError and
    every other rank a PeerFailure naming rank 0, within seconds (they used to wait for
    the root's bytes forever)."""
    from hipress.errors import PayloadError, PeerFailure

    r = hp.rank()
    a = np.ones(1_000_000, np.uint8)
    if r == 0:
        h = hp.broadcast_async(a, 0, "rooterr")
        time.sleep(0.5)  # the round has announced 1,000,000 bytes
        a.resize(500_000, refcheck=False)
    else:
        time.sleep(2)  # the others submit later: the task starts after the resize
        h = hp.broadcast_async(np.zeros(1_000_000, np.uint8), 0, "rooterr")
    t0 = time.monotonic()
    try:
        hp.synchronize(h)
    except PayloadError as exc:
        assert r == 0 and "announced 1000000" in str(exc), repr(exc)
    except PeerFailure as exc:
        assert r != 0 and "rank 0 failed" in str(exc) and "PayloadError" in str(exc), repr(exc)
    else:
        raise AssertionError("the root's failure went unnoticed")
    assert time.monotonic() - t0 < 10, time.monotonic() - t0


@case
def shutdown_while_a_peer_waits_in_join():
    """Rank 0 runs one step more and shuts down; rank 1 runs out of data and waits in
    join(). Neither waits forever: rank 0's shutdown gives up on rank 1's goodbye at the
    stall limit and leaves MPI unfinalized (MPI_Finalize would wait for rank 1, which it
    used to, forever), and, rank 0 still alive, rank 1's join raises a StallError once
    its negotiation round has waited that long (the join's handle used to be left
    pending when the engine stopped)."""
    from hipress import comm
    from hipress.errors import StallError

    hp.shutdown()
    hp.init({"sync": {"stall_shutdown_s": 5, "stall_warning_s": 2},
             "logging": {"level": "WARNING"}})
    r = hp.rank()
    for _ in range(3 if r == 0 else 2):
        hp.synchronize(hp.allreduce_async(np.ones(1000, np.float32), "sj.w"))
        hp.step()
    t0 = time.monotonic()
    if r == 0:
        hp.shutdown()
        assert 4 < time.monotonic() - t0 < 15, time.monotonic() - t0
        assert not comm._CLEAN  # not finalized at exit: rank 1 still runs
        # said now: rank 1's exit (unfinalized) makes the launcher end this process
        print("rank 0 PASS shutdown_while_a_peer_waits_in_join", flush=True)
        time.sleep(12)  # still alive (say, evaluating) while rank 1's join gives up
        return
    try:
        hp.join()
    except StallError as exc:
        assert "did not complete" in str(exc), repr(exc)
    else:
        raise AssertionError("join() returned although rank 0 never joined")
    assert time.monotonic() - t0 < 20, time.monotonic() - t0


@case
def allreduce_mismatch_fails_every_rank_and_engine_goes_on():
    """Uncompressed allreduce: same element count but another shape, another dtype, and an
    integer average refused on one rank only: every rank's handle fails with a
    CollectiveArgumentError naming the difference; later allreduces are exact."""
    from hipress.errors import CollectiveArgumentError

    r, n = hp.rank(), hp.size()
    if n == 1:
        return  # nothing to disagree with
    last = n - 1
    attempts = [
        ("mm.shape", np.ones((2, 3) if r == 0 else (3, 2), np.float32), "sum",
         ["'shape': [2, 3]", "'shape': [3, 2]"]),
        ("mm.dtype", np.ones(4, np.float32 if r == 0 else np.float64), "sum",
         ["'dtype': 'float32'", "'dtype': 'float64'"]),
        ("mm.intavg", np.ones(4, np.int64 if r == last else np.float32), "average",
         [f"rank {last}: op='average' of int64 tensor 'mm.intavg'"]),
        # refused at the call on one rank (a dtype no collective takes; an op no codec
        # compresses): the others fail in the same round instead of stalling
        ("mm.complex", np.ones(4, np.complex64 if r == last else np.float32), "sum",
         [f"rank {last}:", "complex64"]),
    ]
    refused_at_call = {"mm.intavg", "mm.complex", "mm.maxcodec"}
    attempts.append(("mm.maxcodec", np.ones(8, np.float32), "max" if r == last else "sum",
                     [f"rank {last}:", "op='max' runs uncompressed only"]))
    for name, arr, op, wants in attempts:
        try:
            codec = ("onebit" if r == last else "none") if name == "mm.maxcodec" else "none"
            out = hp.allreduce(arr, name, op=op, codec=codec)
        except (CollectiveArgumentError, TypeError, ValueError) as exc:
            msg = str(exc)
            if not isinstance(exc, CollectiveArgumentError):  # the refusing rank's own
                assert r == last and name in refused_at_call, (name, msg)
                continue
            assert all(w in msg for w in wants), (name, msg)
        else:
            raise AssertionError(f"{name}: mismatched submissions were reduced: {out}")
    ok = hp.allreduce(np.full(5, r + 1.0, np.float32), "mm.after", op="sum")
    assert np.array_equal(ok, np.full(5, n * (n + 1) / 2, np.float32)), ok


@case
def many_in_flight_small_tag_space():
    """Run with TAG_BITS=14 (an MPI_TAG_UB of 16383): 4 task ids for 340 gradients in
    flight at once, over every path; every result exact and every tag within the bound."""
    from hipress.api import _engine

    eng = _engine()
    assert eng.world.tag_bits == 14
    tags = set()
    start = eng._sched._start

    def spy(req, task):
        if hasattr(req, "tag"):
            tags.add(req.tag)
        return start(req, task)

    eng._sched._start = spy
    r, n = hp.rank(), hp.size()
    paths = [("fp16", None), ("onebit", "ps"), ("onebit", "ring"),
             (hp_codec("topk", ratio=1.0), None), ("none", None)]
    handles = {}
    for i in range(340):
        codec, strategy = paths[i % len(paths)]
        g = np.full(16, float(i + r), np.float32)
        handles[i] = hp.allreduce_async(g, f"tags.{i}", op="sum", codec=codec,
                                        strategy=strategy)
    for i, h in handles.items():
        got = hp.synchronize(h)
        want = np.full(16, float(n * i + n * (n - 1) // 2), np.float32)
        assert np.array_equal(got, want), (i, paths[i % len(paths)], got[:4], want[:4])
    assert tags and max(tags) < 2**14, max(tags)
    assert len({t >> 12 for t in tags}) == 4, sorted({t >> 12 for t in tags})


@case
def negotiation_allgather_sizes():
    """The negotiation allgather returns every rank's bytes exactly, in rank order.

    Message lengths around the transport's one-collective slot (MPI: an int64 length and
    ``ALLGATHER_SLOT_BYTES - 8`` bytes): empty, short, exactly full, one byte over, long;
    rounds where only some ranks overflow take the second phase on every rank. Odd
    rounds are tested as the engine does while primitives are in flight: the current
    phase's ``request`` in the caller's own ``Testsome``, its outcome passed as
    ``known`` (the second phase's new request is then tested by the allgather itself).
    """
    from hipress import comm

    if hp.api._engine().world.tx.name != "mpi":
        return
    from mpi4py import MPI

    ctrl = MPI.COMM_WORLD.Dup()  # not the engine's: its thread negotiates meanwhile
    r, n = hp.rank(), hp.size()
    full = comm.ALLGATHER_SLOT_BYTES - 8
    lengths = [0, 1, full - 1, full, full + 1, 5 * full + 3]
    for k in range(len(lengths) * 2):
        def msg(q, k=k):
            size = lengths[(k + q) % len(lengths)]
            return bytes((q * 31 + k + i) % 256 for i in range(size))

        req = comm._MpiAllgather(ctrl, MPI, msg(r))
        assert req.test(known=False) is None  # not done: no test, no phase change
        got, polls = None, 0
        while got is None:
            if k % 2:
                rq = req.request
                done = 0 in (MPI.Request.Testsome([rq]) or [])
                got = req.test(known=done)
            else:
                got = req.test()
            polls += 1
            assert polls < 10_000_000, f"round {k} never completed"
        assert got == [msg(q) for q in range(n)], (k, [len(g) for g in got])
    ctrl.Free()


@case
def blas_threads_limited():
    """NumPy's BLAS runs 1 thread while the engine runs (sync.blas_threads default) and
    gets back the count it had (OPENBLAS_NUM_THREADS=2, set by the test; OpenBLAS caps it
    at the core count) at shutdown."""
    from hipress.engine.blas import numpy_blas_threads

    before = [min(2, os.cpu_count() or 1)]
    expect = [1] if hp.size() > 1 else before  # one rank: no engine thread, nothing changed
    assert numpy_blas_threads() == expect, numpy_blas_threads()
    a = np.arange(12 * 10, dtype=np.float32).reshape(12, 10) + hp.rank()
    got = hp.synchronize(hp.allreduce_async(a, "blas.w", op="average", codec="powersgd"))
    assert got.shape == a.shape and np.isfinite(got).all()
    hp.shutdown()
    assert numpy_blas_threads() == before, numpy_blas_threads()


def hp_rank0():
    return _rank == 0


def main():
    if os.environ.get("TAG_BITS"):  # simulate an MPI with a smaller MPI_TAG_UB
        from hipress import comm

        comm.world().tag_bits = int(os.environ["TAG_BITS"])
    hp.init({"compression": {"min_compress_bytes": 0},
             "sync": {"stall_timeout_s": float(os.environ.get("STALL", "30")),
                      "partition_bytes": 8192},
             "timeline": os.environ.get("HIPRESS_TIMELINE")})
    for name in sys.argv[1:]:
        CASES[name]()
        print(f"rank {_rank} PASS {name}", flush=True)
    if hp.is_initialized() and not {"stall_names_missing_rank", "failure_on_one_rank_fails_all",
                                    "broadcast_root_error_fails_every_rank",
                                    "peer_payload_wrong_size",
                                    "shutdown_while_a_peer_waits_in_join",
                                    "shape_mismatch_same_numel"} & set(sys.argv):
        hp.shutdown()


if __name__ == "__main__":
    main()
