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
"""

from __future__ import annotations

import sys
import traceback
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence

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


# ----------------------------------------------------------------------------- runner
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
