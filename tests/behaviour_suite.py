"""Adapter behaviours written once and run against every framework adapter.

The PyTorch adapter fixed how a distributed optimizer behaves; the TensorFlow and MXNet
adapters must behave the same. Each case here is framework-neutral: it talks to a small
per-framework *driver* (see :class:`Driver`) and to :mod:`hipress` itself (rank, size,
residuals, cross-rank comparisons), and raises ``AssertionError`` on a violation. The MPI
workers (``tests/workers/tf_adapter.py``, ``tests/workers/mxnet_adapter.py``) implement a
driver and run the cases with :func:`run_cases`, which prints ``PASS <case> rank <r>`` or
``FAIL <case> rank <r>`` plus the traceback; the pytest files read those lines.

A driver for PyTorch is about 40 lines (parameters = ``torch.nn.Parameter``, one
``backward()`` of ``sum(p * g)`` per pass, ``step()`` after the passes, ``p.grad`` as the
synchronized gradient, ``state_dict``/``load_state_dict`` as the checkpoint), so the torch
tests can run the same cases.

Cases (all with float32 parameters):

- ``identity_exact``: ``compression="none"`` gives exactly the average of every rank's
  integer gradients (any world size), twice in a row (names are reused).
- ``sum_op``: ``op="sum"`` gives exactly the sum.
- ``unused_zero_filled``: a parameter only rank 0 has a gradient for is zero-filled on
  the others (world 2: rank 0 ``b = [2, 4]`` -> ``[1, 2]`` on both), and with onebit the
  residual of that parameter is untouched on the ranks without it.
- ``accumulation``: ``backward_passes_per_step = 2`` sums the passes locally and averages
  the sums (rank r passes ``4r+1`` and ``4r+3``: world 2 -> 8), three steps in a row; a
  gradient present in only one pass is synchronized with that one pass.
- ``checkpoint``: onebit with momentum; a checkpoint restores the residuals
  bit-identically and the next step gives bit-identical parameters and residuals.
- ``identical_every_codec``: with each built-in lossy codec, parameters and synchronized
  gradients are bit-identical on every rank after three steps.
- ``direct_collectives_exact``: with a lossy policy configured (onebit, 4 KiB threshold),
  ``allreduce``/``broadcast`` called directly are exact; a per-call codec is used even on a
  tensor below the threshold.
- ``explicit_codec_every_tensor``: ``compression="onebit"`` in the optimizer compresses
  every gradient, a 4-element bias included, whatever ``min_compress_bytes`` says.
- ``warns_when_nothing_compressed``: under a onebit policy whose threshold exceeds every
  gradient, rank 0 logs one warning naming ``min_compress_bytes``, once per job.
- ``nonfinite_passthrough``: with error-feedback onebit and with PowerSGD, an inf on one
  rank reaches every rank as non-finite; residuals and codec state stay as they were, and
  the next step is finite and bit-identical on every rank.
- ``nonfinite_accumulated``: the same inside ``backward_passes_per_step = 2``; the step
  after the overflow holds no NaN.

Horovod's collectives (issue #14), through :meth:`Driver.collective` (the adapter's own
function of that name on framework tensors):

- ``allgather_rows``: rank r sends r+1 rows (float32 and int32) -> every rank gets the
  concatenation in rank order; ``allgather_object`` gives every rank's object.
- ``alltoall_splits``: per-rank splits; received rows and received splits in source-rank
  order; equal splits by default; splits that do not add up on the last rank raise
  ``CollectiveArgumentError`` naming that rank on every rank, and the next collective works.
- ``reducescatter_ops``: sum/average of float32 and min/max of int32 over 2·size+1 rows;
  each rank gets its block (lower ranks one row more).
- ``grouped_allreduce_order``: float32, float64 and int64 tensors in one group come back
  exact and in input order.
- ``ops_and_int_dtypes``: Min, Max, Product and Sum of int32/int64/uint8 (and bool where
  the framework has it) are exact; an int average raises TypeError before anything moves.
- ``join_uneven``: rank r runs r+1 optimizer steps, then ``join()``; every step's gradient
  is the exact average over the ranks still running; ``join()`` returns size-1 on every
  rank; a second round with onebit ends too (rank r runs size-r steps, join returns 0).
- ``host_layout``: ``cross_rank``/``cross_size``/``is_homogeneous`` on one host.
- ``horovod_args_refused``: ``process_set=``, ``prescale_factor=`` and ``op=Adasum`` raise
  ``UnsupportedArgumentError`` naming the argument, before anything moves.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import traceback
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence

import numpy as np

import hipress

CASES: Dict[str, Callable[[Driver], None]] = {}


def case(fn: Callable[[Driver], None]) -> Callable[[Driver], None]:
    """Register a behaviour case under its function name."""
    CASES[fn.__name__] = fn
    return fn


class Trainer:
    """What a driver builds: named float32 parameters plus a distributed optimizer.

    Keys are the short names the cases use (``"a"``, ``"w"``); the engine sees
    :meth:`engine_name` of each.
    """

    def engine_name(self, key: str) -> str:
        """Return the gradient name the engine uses for parameter ``key``."""
        raise NotImplementedError

    def step(self, passes: Sequence[Mapping[str, np.ndarray]]) -> None:
        """Run one optimizer step made of ``len(passes)`` backward passes.

        Each pass is ``{key: gradient}``: the driver builds a loss whose gradient w.r.t.
        parameter ``key`` is exactly that array (``sum(p * g)``); a key missing from a
        pass has no gradient on this rank in that pass (unused in the graph).
        """
        raise NotImplementedError

    def grads(self) -> Dict[str, np.ndarray]:
        """Return the synchronized gradients the last update used, by key."""
        raise NotImplementedError

    def params(self) -> Dict[str, np.ndarray]:
        """Return the current parameter values, by key."""
        raise NotImplementedError

    def save(self) -> Any:
        """Return a checkpoint of parameters, optimizer state and HiPress state."""
        raise NotImplementedError

    def load(self, checkpoint: Any) -> None:
        """Restore a checkpoint made by :meth:`save` (of a trainer with the same names)."""
        raise NotImplementedError

    def close(self) -> None:
        """Release the trainer (detach hooks); optional."""


class Driver:
    """Builds trainers of one framework adapter."""

    framework = "?"

    def build(
        self,
        prefix: str,
        init: Mapping[str, np.ndarray],
        compression: Any = "none",
        backward_passes_per_step: int = 1,
        op: str = "average",
        lr: float = 0.0,
        momentum: float = 0.0,
        **codec_params: Any,
    ) -> Trainer:
        """Return a trainer over parameters ``init`` (key -> initial float32 array).

        The optimizer is SGD with ``lr`` and ``momentum`` (no weight decay, gradients not
        rescaled), wrapped by the adapter's distributed optimizer with the given options;
        gradient names start with ``prefix`` so cases never share engine state.
        """
        raise NotImplementedError

    def allreduce(self, array: np.ndarray, name: str, op: str = "average",
                  compression: Any = None) -> np.ndarray:
        """Call the adapter's own ``allreduce`` on a framework tensor made from ``array``."""
        raise NotImplementedError

    def broadcast(self, array: np.ndarray, root: int, name: str) -> np.ndarray:
        """Call the adapter's own ``broadcast`` on a framework tensor made from ``array``."""
        raise NotImplementedError

    #: the adapter module (``hipress.torch``, ...), for :meth:`collective`
    module: Any = None
    #: dtypes the framework's tensors have (MXNet NDArrays have no bool)
    int_dtypes: Sequence[Any] = (np.int32, np.int64, np.uint8, np.bool_)

    def tensor(self, array: np.ndarray) -> Any:
        """Return a framework tensor of ``array``'s values, shape and dtype."""
        raise NotImplementedError

    def numpy(self, tensor: Any) -> np.ndarray:
        """Return a framework tensor's values as a NumPy array."""
        raise NotImplementedError

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """Return ``fn`` as the driver runs it (TF graph mode: inside ``tf.function``)."""
        return fn

    def collective(self, fn_name: str, *arrays: np.ndarray, group: bool = False,
                   **kwargs: Any) -> Any:
        """Call ``module.<fn_name>`` on tensors made from ``arrays``; NumPy results back.

        ``group``: pass the tensors as one list (``grouped_allreduce``). Tuples and lists
        of tensors come back as lists of arrays.
        """
        fn = getattr(self.module, fn_name)

        def call(*ts: Any) -> Any:
            return fn(list(ts), **kwargs) if group else fn(*ts, **kwargs)

        out = self.wrap(call)(*[self.tensor(a) for a in arrays])
        if isinstance(out, (list, tuple)):
            return [self.numpy(o) for o in out]
        return self.numpy(out)


# --------------------------------------------------------------------------- helpers
def residual(name: str) -> Optional[np.ndarray]:
    """Return this rank's worker-side residual of gradient ``name`` (all partitions), or None.

    The engine keys residuals ``name#p<partition>``; ``...@agg`` entries (the aggregator's
    own residual) are left out.
    """
    parts = []
    for table in hipress.state_dict()["memories"].values():
        for key in sorted(table):
            if (key == name or key.startswith(name + "#")) and "@" not in key:
                parts.append(np.array(table[key], copy=True).reshape(-1))
    return np.concatenate(parts) if parts else None


def same_on_every_rank(value: Any, what: str) -> None:
    """Assert that ``value`` (dict of arrays) is bit-identical to rank 0's."""
    root = hipress.broadcast_object(value if hipress.rank() == 0 else None, root=0,
                                    name=f"suite.same.{what}")
    assert set(root) == set(value), (what, sorted(root), sorted(value))
    for k in value:
        a, b = np.asarray(value[k]), np.asarray(root[k])
        assert a.dtype == b.dtype and a.shape == b.shape, (what, k, a.dtype, b.dtype)
        assert np.array_equal(a.view(np.uint8), b.view(np.uint8)), (what, k, a, b)


def _int_grads(seed: int, shapes: Mapping[str, tuple]) -> Dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {k: rng.integers(-4, 5, size=s).astype(np.float32) for k, s in shapes.items()}


def _zeros(shapes: Mapping[str, tuple]) -> Dict[str, np.ndarray]:
    return {k: np.zeros(s, np.float32) for k, s in shapes.items()}


# ----------------------------------------------------------------------------- cases
@case
def identity_exact(d: Driver) -> None:
    """compression='none': the synchronized gradient is exactly the average (twice)."""
    rank, size = hipress.rank(), hipress.size()
    shapes = {"w": (3, 4), "v": (5,)}
    tr = d.build("suite.exact", _zeros(shapes), compression="none")
    for it in range(2):
        per_rank = [_int_grads(100 * it + r, shapes) for r in range(size)]
        tr.step([per_rank[rank]])
        got = tr.grads()
        for k in shapes:
            want = sum(g[k] for g in per_rank) / np.float32(size)
            assert got[k].dtype == np.float32, got[k].dtype
            assert np.array_equal(got[k], want), (k, got[k], want)
    tr.close()


@case
def sum_op(d: Driver) -> None:
    """op='sum': the synchronized gradient is exactly the sum."""
    rank, size = hipress.rank(), hipress.size()
    shapes = {"w": (2, 3)}
    tr = d.build("suite.sum", _zeros(shapes), compression="none", op="sum")
    per_rank = [_int_grads(7 + r, shapes) for r in range(size)]
    tr.step([per_rank[rank]])
    want = sum(g["w"] for g in per_rank)
    assert np.array_equal(tr.grads()["w"], want), (tr.grads()["w"], want)
    tr.close()


@case
def unused_zero_filled(d: Driver) -> None:
    """Only rank 0 has b's gradient: others zero-fill, nobody hangs, their residual is kept."""
    rank, size = hipress.rank(), hipress.size()
    for compression in ("none", "onebit"):
        tr = d.build(f"suite.unused.{compression}", _zeros({"a": (2,), "b": (2,)}),
                     compression=compression)
        bname = tr.engine_name("b")
        ga = {r: np.full(2, 1.0 + 2 * r, np.float32) for r in range(size)}
        gb = np.array([2.0, 4.0], np.float32)
        # step 0: b used everywhere (creates onebit's residual on every rank)
        tr.step([{"a": ga[rank], "b": gb}])
        before = residual(bname)
        # step 1: only rank 0 uses b
        tr.step([{"a": ga[rank], "b": gb} if rank == 0 else {"a": ga[rank]}])
        after = residual(bname)
        got = tr.grads()
        if compression == "none":
            assert np.array_equal(got["b"], gb / np.float32(size)), got["b"]
            want_a = sum(ga.values()) / np.float32(size)
            assert np.array_equal(got["a"], want_a), (got["a"], want_a)
            if size == 2:
                assert np.array_equal(got["b"], [1.0, 2.0]), got["b"]
        else:
            assert before is not None, "onebit must keep a residual for b"
            if rank != 0:
                assert np.array_equal(after, before), (after, before)
            else:
                assert not np.array_equal(after, before), "rank 0's residual must move"
        same_on_every_rank(got, f"unused.{compression}")
        tr.close()


@case
def accumulation(d: Driver) -> None:
    """Two passes per step: summed locally, then averaged across ranks (world 2 -> 8)."""
    rank, size = hipress.rank(), hipress.size()
    tr = d.build("suite.bpps", _zeros({"w": (2,), "c": (3,)}), compression="none",
                 backward_passes_per_step=2)
    first, second = 4.0 * rank + 1.0, 4.0 * rank + 3.0
    want_w = np.float32(sum(8.0 * r + 4.0 for r in range(size)) / size)  # = 4 * size
    c_first = np.array([1.0, 2.0, 3.0], np.float32)
    for _step in range(3):  # the pass count resets after each step
        passes: List[Dict[str, np.ndarray]] = [
            {"w": np.full(2, first, np.float32)},
            {"w": np.full(2, second, np.float32)},
        ]
        if rank == 0:
            passes[0]["c"] = c_first  # c only in rank 0's first pass
        tr.step(passes)
        got = tr.grads()
        assert np.array_equal(got["w"], np.full(2, want_w, np.float32)), (got["w"], want_w)
        assert np.array_equal(got["c"], c_first / np.float32(size)), got["c"]
    if size == 2:
        assert np.array_equal(tr.grads()["w"], [8.0, 8.0]), tr.grads()["w"]
    tr.close()


def _rand_grads(step: int, rank: int, shapes: Mapping[str, tuple]) -> Dict[str, np.ndarray]:
    rng = np.random.default_rng(1000 * step + rank)
    return {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}


@case
def checkpoint(d: Driver) -> None:
    """A checkpoint restores onebit's residuals bit-identically; the next step matches."""
    rank = hipress.rank()
    shapes = {"w": (16, 20), "b": (16,)}
    init = {k: np.random.default_rng(5).standard_normal(s).astype(np.float32)
            for k, s in shapes.items()}

    def build() -> Trainer:
        return d.build("suite.ckpt", init, compression="onebit", lr=0.1, momentum=0.9)

    tr = build()
    names = {k: tr.engine_name(k) for k in shapes}
    for s in range(3):
        tr.step([_rand_grads(s, rank, shapes)])
    ckpt = tr.save()
    saved = {k: residual(n) for k, n in names.items()}
    assert all(r is not None for r in saved.values()), saved
    tr.step([_rand_grads(3, rank, shapes)])
    want_params = tr.params()
    want_res = {k: residual(n) for k, n in names.items()}
    assert any(not np.array_equal(want_res[k], saved[k]) for k in shapes)
    tr.close()

    tr2 = build()
    tr2.load(ckpt)
    for k, n in names.items():
        got = residual(n)
        assert got.dtype == saved[k].dtype, (k, got.dtype)
        assert np.array_equal(got.view(np.uint8), saved[k].view(np.uint8)), k
    tr2.step([_rand_grads(3, rank, shapes)])
    got_params = tr2.params()
    for k in shapes:
        assert np.array_equal(got_params[k].view(np.uint8), want_params[k].view(np.uint8)), k
        assert np.array_equal(residual(names[k]), want_res[k]), k
    tr2.close()


#: codec -> (constructor params, momentum): the settings each needs (as in the torch docs)
LOSSY = {
    "onebit": ({}, 0.9),
    "tbq": ({"threshold": 0.01}, 0.9),
    "terngrad": ({}, 0.9),
    "dgc": ({"ratio": 0.05}, 0.0),
    "graddrop": ({}, 0.9),
    "powersgd": ({}, 0.9),
}


@case
def identical_every_codec(d: Driver) -> None:
    """Every lossy built-in codec leaves bit-identical parameters and gradients on all ranks."""
    rank = hipress.rank()
    shapes = {"w": (24, 16), "b": (24,)}
    init = {k: np.random.default_rng(9).standard_normal(s).astype(np.float32)
            for k, s in shapes.items()}
    for codec, (params, momentum) in LOSSY.items():
        tr = d.build(f"suite.same.{codec}", init, compression=codec, lr=0.05,
                     momentum=momentum, **params)
        for s in range(3):
            tr.step([_rand_grads(s, rank, shapes)])
        got = tr.grads()
        assert all(np.isfinite(g).all() for g in got.values()), codec
        same_on_every_rank(got, f"{codec}.grads")
        same_on_every_rank(tr.params(), f"{codec}.params")
        tr.close()


@contextlib.contextmanager
def policy(**compression: Any) -> Iterator[None]:
    """Run with the job's ``compression`` config section changed (on every rank alike).

    Stands in for a job launched with that config, so one MPI job can run the cases; the
    "nothing was compressed" warning is re-armed (it fires once per job).
    """
    eng = hipress.api._engine()
    old = eng.cfg.compression
    eng.cfg.compression = old.model_copy(update=compression)
    eng._warned_uncompressed = False
    try:
        yield
    finally:
        eng.cfg.compression = old


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: List[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@case
def direct_collectives_exact(d: Driver) -> None:
    """With a lossy policy configured, allreduce/broadcast called directly are exact."""
    rank, size = hipress.rank(), hipress.size()
    with policy(algorithm="onebit", min_compress_bytes=4096, params={}):
        # 8 KiB metric vectors of integers times size: the exact average is an integer
        vals = [np.random.default_rng(50 + r).integers(-1000, 1000, 2048).astype(np.float32)
                * np.float32(size) for r in range(size)]
        got = d.allreduce(vals[rank], f"suite.metric.{d.framework}")
        want = sum(vals) / np.float32(size)
        assert got.dtype == np.float32, got.dtype
        assert np.array_equal(got, want), float(np.abs(got - want).max())
        got = d.allreduce(vals[rank], f"suite.metric.sum.{d.framework}", op="sum")
        assert np.array_equal(got, sum(vals)), float(np.abs(got - sum(vals)).max())
        st = hipress.stats()[f"suite.metric.{d.framework}"]
        assert st["codec"] == "none", st
        got = d.broadcast(vals[rank], size - 1, f"suite.bcast.{d.framework}")
        assert np.array_equal(got, vals[size - 1])
        # a per-call codec is honoured on a tensor far below min_compress_bytes
        x = np.full(1000, rank + 1.0, np.float32)
        got = d.allreduce(x, f"suite.explicit.{d.framework}", compression="onebit")
        st = hipress.stats()[f"suite.explicit.{d.framework}"]
        assert st["codec"] == "onebit" and st["strategy"] in ("ps", "ring"), st
        assert st["compression_ratio"] > 10, st
        same_on_every_rank({"x": got}, f"explicit.{d.framework}")


@case
def explicit_codec_every_tensor(d: Driver) -> None:
    """compression='onebit' in the optimizer compresses every tensor, whatever its size."""
    rank = hipress.rank()
    shapes = {"w": (16, 8), "b": (4,)}
    with policy(min_compress_bytes=1 << 20):
        tr = d.build("suite.explicit", _zeros(shapes), compression="onebit")
        tr.step([_rand_grads(0, rank, shapes)])
        for k in shapes:
            st = hipress.stats()[tr.engine_name(k)]
            assert st["codec"] == "onebit", (k, st)
        same_on_every_rank(tr.grads(), "explicit.grads")
        tr.close()


@case
def warns_when_nothing_compressed(d: Driver) -> None:
    """A onebit policy whose threshold exceeds every gradient: one warning, on rank 0."""
    rank = hipress.rank()
    shapes = {"w": (16, 8), "b": (4,)}
    rec = _Records()
    log = logging.getLogger("hipress")
    log.addHandler(rec)
    try:
        with policy(algorithm="onebit", min_compress_bytes=4096, warmup_steps=0, params={},
                    rules=[]):
            tr = d.build("suite.warn", _zeros(shapes), compression=None)
            for s in range(3):
                tr.step([_rand_grads(s, rank, shapes)])
            for k in shapes:
                assert hipress.stats()[tr.engine_name(k)]["codec"] == "none"
            tr.close()
    finally:
        log.removeHandler(rec)
    warned = [m for m in rec.messages if "compression was asked for" in m]
    if rank == 0:
        assert len(warned) == 1, rec.messages
        assert "compression.min_compress_bytes=4096" in warned[0], warned[0]
        assert "compression.algorithm='onebit'" in warned[0], warned[0]
    else:
        assert not warned, warned
    # rules that switch the job's codec off for (nearly) everything are named too
    from hipress.config import CompressionRule

    rec = _Records()
    log.addHandler(rec)
    try:
        with policy(algorithm="onebit", min_compress_bytes=0, warmup_steps=0, params={},
                    rules=[CompressionRule(pattern="*", algorithm="none")]):
            tr = d.build("suite.warn.rules", _zeros(shapes), compression=None)
            tr.step([_rand_grads(0, rank, shapes)])
            tr.close()
    finally:
        log.removeHandler(rec)
    warned = [m for m in rec.messages if "compression was asked for" in m]
    assert len(warned) == (1 if rank == 0 else 0), rec.messages
    if warned:
        assert "compression.rules ['*'] send uncompressed" in warned[0], warned[0]


def _codec_state() -> Dict[str, Any]:
    return {k: {n: np.array(v, copy=True) for n, v in c.items()}
            for k, c in hipress.state_dict()["codecs"].items()}


@case
def nonfinite_passthrough(d: Driver) -> None:
    """inf on one rank: non-finite everywhere, residual/codec state kept, next step normal."""
    rank, size = hipress.rank(), hipress.size()
    shapes = {"w": (32, 16), "v": (64,)}
    for codec in ("onebit", "powersgd"):
        tr = d.build(f"suite.nonfinite.{codec}", _zeros(shapes), compression=codec)
        names = {k: tr.engine_name(k) for k in shapes}
        tr.step([_rand_grads(0, rank, shapes)])
        res_before = {k: residual(n) for k, n in names.items()}
        state_before = _codec_state()
        bad = _rand_grads(1, rank, shapes)
        if rank == size - 1:
            bad["w"][3, 5] = np.inf
            bad["v"][7] = np.nan
        tr.step([bad])
        got = tr.grads()
        for k in shapes:
            assert not np.isfinite(got[k]).all(), (codec, k, "inf/NaN must reach every rank")
            st = hipress.stats()[names[k]]
            assert st.get("nonfinite_steps") == 1, st
        assert not np.isfinite(got["w"][3, 5]) and not np.isfinite(got["v"][7])
        for k, n in names.items():
            after = residual(n)
            if res_before[k] is None:
                assert after is None, (codec, k)
            else:
                assert np.array_equal(after, res_before[k]), (codec, k, "residual moved")
        state_after = _codec_state()
        if codec == "powersgd":
            assert any(n.startswith(names["w"]) for q in state_before.values() for n in q), \
                state_before
        assert state_after.keys() == state_before.keys()
        for key in state_before:
            for n, q in state_before[key].items():
                assert np.array_equal(state_after[key][n], q), (codec, key, n, "state moved")
        tr.step([_rand_grads(2, rank, shapes)])
        got = tr.grads()
        assert all(np.isfinite(g).all() for g in got.values()), codec
        same_on_every_rank(got, f"nonfinite.{codec}")
        if codec == "onebit":
            assert not np.array_equal(residual(names["w"]), res_before["w"]), "EF must resume"
        tr.close()


@case
def nonfinite_accumulated(d: Driver) -> None:
    """An overflow in one of two accumulated passes: that step non-finite, the next clean."""
    rank = hipress.rank()
    shapes = {"w": (16, 8)}
    tr = d.build("suite.nonfinite.bpps", _zeros(shapes), compression="onebit",
                 backward_passes_per_step=2)
    first = _rand_grads(0, rank, shapes)
    if rank == 0:
        first["w"][0, 0] = -np.inf
    tr.step([first, _rand_grads(1, rank, shapes)])
    assert not np.isfinite(tr.grads()["w"]).all()
    tr.step([_rand_grads(2, rank, shapes), _rand_grads(3, rank, shapes)])
    got = tr.grads()
    assert np.isfinite(got["w"]).all(), "NaN/inf left behind by the overflowed step"
    same_on_every_rank(got, "nonfinite.bpps")
    tr.close()


# ----------------------------------------------------------------------------- runner
@case
def allgather_rows(d: Driver) -> None:
    """Rank r sends r+1 rows; every rank gets all rows in rank order (float32, int32)."""
    rank, size = hipress.rank(), hipress.size()
    for dt in (np.float32, np.int32):
        mine = (np.arange((rank + 1) * 3).reshape(rank + 1, 3) + 100 * rank).astype(dt)
        got = d.collective("allgather", mine, name=f"suite.ag.{d.framework}.{np.dtype(dt)}")
        want = np.concatenate([(np.arange((r + 1) * 3).reshape(r + 1, 3) + 100 * r).astype(dt)
                               for r in range(size)])
        assert got.dtype == np.dtype(dt) and got.shape == want.shape, (got.dtype, got.shape)
        assert np.array_equal(got, want), (got, want)
    objs = d.module.allgather_object({"rank": rank, "tag": "x" * rank},
                                     name=f"suite.ago.{d.framework}")
    assert objs == [{"rank": r, "tag": "x" * r} for r in range(size)], objs


def _splits(rank: int, size: int) -> List[int]:
    return [(rank + 2 * j) % 3 for j in range(size)]


@case
def alltoall_splits(d: Driver) -> None:
    """Per-rank splits arrive in source-rank order; bad splits fail on every rank."""
    from hipress.errors import CollectiveArgumentError

    rank, size = hipress.rank(), hipress.size()
    sp = _splits(rank, size)
    rows = np.concatenate([np.full((sp[j], 2), 10 * rank + j, np.float32) for j in range(size)])
    got, received = d.collective("alltoall", rows, splits=sp,
                                 name=f"suite.a2a.{d.framework}")
    want_splits = [_splits(r, size)[rank] for r in range(size)]
    want = np.concatenate([np.full((want_splits[r], 2), 10 * r + rank, np.float32)
                           for r in range(size)])
    assert [int(v) for v in received] == want_splits, (received, want_splits)
    assert np.array_equal(got, want), (got, want)
    even = np.arange(2 * size, dtype=np.int64) + 1000 * rank
    got = d.collective("alltoall", even, name=f"suite.a2a.even.{d.framework}")
    want = np.concatenate([np.arange(2 * rank, 2 * rank + 2) + 1000 * r for r in range(size)])
    assert np.array_equal(got, want), (got, want)
    bad = list(sp)
    if rank == size - 1:
        bad[0] += 1  # one row more than the tensor has
    try:
        d.collective("alltoall", rows, splits=bad, name=f"suite.a2a.bad.{d.framework}")
    except Exception as exc:  # noqa: BLE001 - TF graph mode wraps errors from py_function
        assert isinstance(exc, CollectiveArgumentError) or "CollectiveArgumentError" in str(
            type(exc)) or "add up" in str(exc), repr(exc)
        assert f"rank {size - 1}" in str(exc) and "add up" in str(exc), str(exc)
    else:
        raise AssertionError("bad splits on one rank did not raise")
    # the engine goes on
    again = d.collective("allgather", np.array([rank], np.int64),
                         name=f"suite.a2a.after.{d.framework}")
    assert again.tolist() == list(range(size)), again


@case
def reducescatter_ops(d: Driver) -> None:
    """Each rank gets its block of the reduction; lower ranks get one row more."""
    rank, size = hipress.rank(), hipress.size()
    n = 2 * size + 1
    q, m = divmod(n, size)
    lo = rank * q + min(rank, m)
    hi = lo + q + (1 if rank < m else 0)
    per = [np.arange(n * 2, dtype=np.float32).reshape(n, 2) * (r + 1) for r in range(size)]
    for op in ("sum", "average"):
        got = d.collective("reducescatter", per[rank], op=op,
                           name=f"suite.rs.{op}.{d.framework}")
        want = sum(per)[lo:hi]
        if op == "average":
            want = want / np.float32(size)
        assert got.shape == (hi - lo, 2) and np.array_equal(got, want), (op, got, want)
    ints = [(np.arange(n * 2).reshape(n, 2) * (-1) ** r + r).astype(np.int32) for r in range(size)]
    for op, fn in (("min", np.minimum.reduce), ("max", np.maximum.reduce)):
        got = d.collective("reducescatter", ints[rank], op=op,
                           name=f"suite.rs.{op}.{d.framework}")
        assert got.dtype == np.int32 and np.array_equal(got, fn(ints)[lo:hi]), (op, got)


@case
def grouped_allreduce_order(d: Driver) -> None:
    """One group of float32, float64 and int64 tensors: exact, in input order."""
    rank, size = hipress.rank(), hipress.size()
    arrays = [np.full(5, rank + 1, np.float32), np.arange(3, dtype=np.float64) * rank,
              np.array([rank, 7], np.int64)]
    got = d.collective("grouped_allreduce", *arrays, group=True, op="sum",
                       name=f"suite.group.{d.framework}")
    want = [sum(np.full(5, r + 1, np.float32) for r in range(size)),
            sum(np.arange(3, dtype=np.float64) * r for r in range(size)),
            sum(np.array([r, 7], np.int64) for r in range(size))]
    assert len(got) == 3
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and np.array_equal(g, w), (g, w)


@case
def ops_and_int_dtypes(d: Driver) -> None:
    """Min/Max/Product/Sum of integer tensors are exact; an int average is refused."""
    rank, size = hipress.rank(), hipress.size()
    for dt in d.int_dtypes:
        vals = [np.array([r + 1, 3 - r, r % 2, 2], dtype=np.int64) for r in range(size)]
        per = [v.astype(dt) for v in vals]
        for op, fn in (("sum", np.sum), ("min", np.min), ("max", np.max),
                       ("product", np.prod)):
            got = d.collective("allreduce", per[rank], op=op,
                               name=f"suite.ops.{d.framework}.{np.dtype(dt)}.{op}")
            want = fn(np.stack(vals), axis=0).astype(dt)  # integer arithmetic wraps
            assert got.dtype == np.dtype(dt), (dt, op, got.dtype)
            assert np.array_equal(got, want), (dt, op, got, want)
    # compression="none" (Horovod's Compression.none) is no codec: integers are fine
    got = d.collective("allreduce", np.array([rank, 1], np.int32), op="sum",
                       compression="none", name=f"suite.ops.none.{d.framework}")
    assert got.tolist() == [size * (size - 1) // 2, size], got
    try:
        d.collective("allreduce", np.ones(3, np.int32), op="average",
                     name=f"suite.ops.intavg.{d.framework}")
    except Exception as exc:  # noqa: BLE001 - TF graph mode wraps errors from py_function
        assert "integer average" in str(exc), str(exc)
    else:
        raise AssertionError("an int32 average did not raise")
    x = np.array([1.5, -2.0, 4.0], np.float32) * (rank + 1)
    got = d.collective("allreduce", x, op="max", name=f"suite.ops.fmax.{d.framework}")
    assert np.array_equal(got, np.max([x / (rank + 1) * (r + 1) for r in range(size)], 0))


@case
def join_uneven(d: Driver) -> None:
    """Rank r runs r+1 steps then joins: averages count the running ranks only."""
    rank, size = hipress.rank(), hipress.size()
    shapes = {"w": (3, 2), "b": (4,)}
    tr = d.build("suite.join", _zeros(shapes), compression="none")
    for step in range(rank + 1):
        per_rank = [_int_grads(300 + 10 * step + r, shapes) for r in range(size)]
        tr.step([per_rank[rank]])
        running = [r for r in range(size) if r >= step]
        got = tr.grads()
        for k in shapes:
            want = sum(per_rank[r][k] for r in running) / np.float32(len(running))
            assert np.array_equal(got[k], want), (step, k, got[k], want)
    assert d.module.join() == size - 1
    tr.close()
    shapes = {"w": (16, 8), "b": (64,)}  # large enough for onebit to shrink
    tr = d.build("suite.join1", _zeros(shapes), compression="onebit")
    grads = {}
    for step in range(size - rank):
        tr.step([_int_grads(400 + 10 * step + rank, shapes)])
        grads[f"s{step}"] = np.concatenate([tr.grads()[k].reshape(-1) for k in shapes])
        assert all(np.isfinite(g).all() for g in grads.values())
    assert d.module.join() == 0
    # step s ran on ranks 0 .. size-1-s; rank 0 ran every step
    root = hipress.broadcast_object(grads if rank == 0 else None, 0,
                                    name=f"suite.join.{d.framework}")
    for k, v in grads.items():
        assert np.array_equal(v, root[k]), (k, v, root[k])
    tr.close()


@case
def horovod_args_refused(d: Driver) -> None:
    """Horovod arguments HiPress lacks fail at once, naming the argument; Adasum too."""
    from hipress.adapter_common import UnsupportedArgumentError

    x = np.ones(4, np.float32)
    calls = [("broadcast", dict(root_rank=0, process_set=1), "process_set"),
             ("allgather", dict(process_set=1), "process_set"),
             ("alltoall", dict(process_set=1), "process_set"),
             ("reducescatter", dict(prescale_factor=2.0), "prescale_factor"),
             ("allreduce", dict(op="adasum"), "Adasum"),
             ("allreduce", dict(process_set=1), "process_set")]
    for fn, kwargs, word in calls:
        try:
            getattr(d.module, fn)(d.tensor(x), **kwargs)
        except UnsupportedArgumentError as exc:
            assert word in str(exc) and "not supported" in str(exc), (fn, str(exc))
        else:
            raise AssertionError(f"{fn}({kwargs}) did not raise")


@case
def host_layout(d: Driver) -> None:
    """One host: cross_rank 0, cross_size 1, homogeneous; local ranks are the ranks."""
    assert d.module.cross_rank() == 0 and d.module.cross_size() == 1
    assert d.module.is_homogeneous() is True
    assert d.module.local_size() == hipress.size()
    assert d.module.local_rank() == hipress.rank()


def run_cases(
    names: Sequence[str],
    drivers: Mapping[str, Driver],
    extra: Optional[Mapping[str, Callable[[], None]]] = None,
) -> int:
    """Run cases on this rank; print ``PASS``/``FAIL`` lines; return the exit status.

    Args:
        names: case names. ``<case>@<driver>`` runs a suite case with that driver (e.g.
            ``identity_exact@graph``); a plain name runs a framework-specific case from
            ``extra``.
        drivers: driver by label.
        extra: framework-specific cases (no arguments).

    Returns:
        0 if every case passed on this rank, else 1.
    """
    failed = False
    for name in names:
        try:
            if "@" in name:
                case_name, label = name.split("@", 1)
                CASES[case_name](drivers[label])
            else:
                (extra or {})[name]()
        except Exception:  # noqa: BLE001
            failed = True
            print(f"FAIL {name} rank {hipress.rank()}\n{traceback.format_exc()}", flush=True)
        else:
            print(f"PASS {name} rank {hipress.rank()}", flush=True)
    sys.stdout.flush()
    return 1 if failed else 0


def worker_main(hp, extra: Mapping[str, Callable[[], None]]) -> None:
    """Entry point of the Horovod-compat workers: init, run argv[1]'s cases, exit.

    ``hp`` is the adapter module (``hipress.torch``, ``.tensorflow``, ``.mxnet``), started
    with every tensor compressible and a 20 s stall limit; the process exits with
    :func:`run_cases`' status.
    """
    names = sys.argv[1].split(",")
    hp.init({"compression": {"min_compress_bytes": 0}, "sync": {"stall_timeout_s": 20},
             "logging": {"level": "WARNING"}})
    status = run_cases(names, {}, extra)
    hp.shutdown()
    sys.exit(status)
