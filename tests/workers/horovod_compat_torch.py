"""MPI worker for tests/test_horovod_compat.py (PyTorch): Horovod API conventions.

Usage: mpirun -np N python tests/workers/horovod_compat_torch.py case1,case2,...

Each case prints ``PASS <case> rank <r>`` on success; an exception prints ``FAIL <case>``
with the traceback and the worker exits 1 at the end. Every case uses its own gradient
names, so cases do not share engine state.
"""

from __future__ import annotations

import copy
import os
import sys

import torch

import hipress
import hipress.torch as hp
from hipress.adapter_common import BackwardPassError
from hipress.errors import ConfigError

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import behaviour_suite as suite  # noqa: E402

torch.set_num_threads(1)
CASES = {}


def case(fn):
    CASES[fn.__name__] = fn
    return fn


def prefixed(model, prefix):
    return [(f"{prefix}.{n}", p) for n, p in model.named_parameters()]


def _model(seed):
    """Integer weights: integer data gives integer gradients, so sums are exact."""
    g = torch.Generator().manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.ReLU(), torch.nn.Linear(4, 3))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randint(-3, 4, p.shape, generator=g).float())
    return model


def _batch(r, step=0):
    g = torch.Generator().manual_seed(100 + 10 * step + r)
    return (torch.randint(-4, 5, (6, 5), generator=g).float(),
            torch.randint(-2, 3, (6, 3), generator=g).float())


def _loss(model, batch):
    x, t = batch
    return (model(x) * t).sum()


def _reference_grads(model, size, step=0, integer=True):
    """Every rank's gradient computed here, summed, divided once.

    With ``integer`` (integer weights) the float32 sum is exact and the division rounds
    once, as the engine's uncompressed average does, so the identity path compares
    exactly. Returns float32 tensors.
    """
    total = None
    for r in range(size):
        m = copy.deepcopy(model)
        _loss(m, _batch(r, step)).backward()
        grads = [p.grad.clone() for p in m.parameters()]
        assert not integer or all(torch.equal(g, g.round()) for g in grads), "not integers"
        total = grads if total is None else [a + b for a, b in zip(total, grads)]
    return [t / size for t in total]


def _expect(exc_type, fragments, fn):
    try:
        fn()
    except exc_type as exc:
        msg = str(exc)
        missing = [f for f in fragments if f not in msg]
        assert not missing, f"message lacks {missing}: {msg}"
        return exc
    raise AssertionError(f"expected {exc_type.__name__}")


# ------------------------------------------------------------------ 1. Compression
@case
def compression_objects():
    """hp.Compression.fp16 runs fp16; hp.Compression.none is exact (not the policy)."""
    rank, size = hp.rank(), hp.size()
    for attr, codec in ((hp.Compression.fp16, "fp16"), (hp.Compression.none, "none")):
        model = _model(1)
        ref = _reference_grads(model, size)
        opt = hp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0),
                                      named_parameters=prefixed(model, f"hvdcomp.{codec}"),
                                      compression=attr)
        opt.zero_grad()
        _loss(model, _batch(rank)).backward()
        opt.step()
        stats = hipress.stats()
        key = f"hvdcomp.{codec}.0.weight"
        assert stats[key]["codec"] == codec, (key, stats.get(key))
        for p, want in zip(model.parameters(), ref):
            if codec == "none":  # integer gradients: the exact average
                assert torch.equal(p.grad, want), (p.grad, want)
            else:  # fp16 of small integers and halves is exact too
                torch.testing.assert_close(p.grad, want, rtol=1e-3, atol=1e-3)
        opt.remove_hooks()
    # a direct allreduce with a Compression attribute
    t = torch.full((4,), float(rank + 1))
    out = hp.allreduce(t, name="hvdcomp.allreduce", compression=hp.Compression.fp16)
    assert torch.equal(out, torch.full((4,), (size + 1) / 2)), out
    assert hipress.stats()["hvdcomp.allreduce"]["codec"] == "fp16"


# ------------------------------------------------------ 2. gradient_predivide_factor
@case
def predivide_factor():
    """f in [1, size]: p.grad is the plain average (exactly equal for f=1)."""
    rank, size = hp.rank(), hp.size()
    for i, f in enumerate((1, 1.5, float(size))):
        model = _model(2)
        opt = hp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0),
                                      named_parameters=prefixed(model, f"predivide.{i}"),
                                      compression=hp.Compression.none,
                                      gradient_predivide_factor=f)
        for step in range(2):
            ref = _reference_grads(model, size, step)
            opt.zero_grad()
            _loss(model, _batch(rank, step)).backward()
            opt.step()
            for (name, p), want in zip(model.named_parameters(), ref):
                got = p.grad
                if f == 1:
                    assert torch.equal(got, want), (f, name, got, want)
                else:
                    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        opt.remove_hooks()


@case
def predivide_errors():
    """f outside [1, size] or with op=Sum is a ConfigError naming the argument and range."""
    size = hp.size()
    model = _model(3)

    def build(**kw):
        return hp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=prefixed(model, "prediv_err"), **kw)

    for bad in (0, -1.0, size + 0.5, 0.5):
        _expect(ConfigError, ["gradient_predivide_factor", repr(bad), f"[1, {size}]"],
                lambda bad=bad: build(gradient_predivide_factor=bad))
    _expect(ConfigError, ["gradient_predivide_factor", "op=hp.Average"],
            lambda: build(gradient_predivide_factor=size, op=hp.Sum))
    _expect(ConfigError, ["gradient_predivide_factor", "number"],
            lambda: build(gradient_predivide_factor="2"))
    build(gradient_predivide_factor=1, op=hp.Sum).remove_hooks()  # f=1 with Sum is fine


# ------------------------------------------------------------------ 4. step(closure)
@case
def step_with_closure():
    """SGD.step(closure): the closure's gradients are averaged before the update."""
    rank, size = hp.rank(), hp.size()
    model = _model(4)
    reference = copy.deepcopy(model)
    lr = 0.01
    opt = hp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=lr),
                                  named_parameters=prefixed(model, "closure"),
                                  compression=hp.Compression.none)
    for step in range(2):
        ref = _reference_grads(reference, size, step, integer=step == 0)
        with torch.no_grad():
            for p, g in zip(reference.parameters(), ref):
                p.sub_(lr * g)
        calls = []

        def closure(step=step, calls=calls):
            calls.append(1)
            opt.zero_grad()
            loss = _loss(model, _batch(rank, step))
            loss.backward()
            return loss

        with torch.no_grad():
            expected_loss = _loss(model, _batch(rank, step))
        loss = opt.step(closure)
        assert len(calls) == 1
        assert torch.equal(loss.detach(), expected_loss), (loss, expected_loss)  # local loss
        for p, q in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-6, atol=1e-5)
        assert not opt._hp_sync.in_progress
    # a backward() before step(closure) is synchronized first; the closure may redo it
    opt.zero_grad()
    _loss(model, _batch(rank, 5)).backward()
    opt.step(lambda: (opt.zero_grad(), _loss(model, _batch(rank, 6)).backward())[0])
    assert not opt._hp_sync.in_progress
    # a closure without backward (loss only) after a plain backward: Horovod's order
    opt.zero_grad()
    _loss(model, _batch(rank, 7)).backward()
    with torch.no_grad():
        before = [p.clone() for p in model.parameters()]
    out = opt.step(lambda: torch.tensor(3.0))
    assert float(out) == 3.0
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    opt.remove_hooks()


@case
def closure_too_many_passes():
    """A closure running two backward passes with backward_passes_per_step=1: clear error."""
    rank = hp.rank()
    model = _model(5)
    opt = hp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                  named_parameters=prefixed(model, "closure2"),
                                  compression=hp.Compression.none)

    def closure():
        opt.zero_grad()
        loss = _loss(model, _batch(rank))
        loss.backward(retain_graph=True)
        loss.backward()
        return loss

    _expect(BackwardPassError, ["closure given to DistributedOptimizer.step()",
                                "backward_passes_per_step=1"], lambda: opt.step(closure))
    opt.remove_hooks()
    hipress.barrier()


# ------------------------------------------------------------------ 5. SyncBatchNorm
def _bn_data(sizes, channels, step, dims=2):
    g = torch.Generator().manual_seed(500 + step)
    shape = (sum(sizes), channels) + ((4, 3) if dims == 2 else ())
    x = torch.randn(shape, generator=g) * 3 + 1.5
    w = torch.randn(shape, generator=g)
    return x, w


def _check_sync_bn(kind, sizes, momentum):
    rank = hp.rank()
    channels = 3
    dims = 2 if kind == "2d" else 1
    ref_cls = torch.nn.BatchNorm2d if kind == "2d" else torch.nn.BatchNorm1d
    ref = ref_cls(channels, momentum=momentum)
    with torch.no_grad():
        ref.weight.copy_(torch.tensor([0.5, -1.0, 2.0]))
        ref.bias.copy_(torch.tensor([0.1, 0.0, -0.3]))
    sync = hp.SyncBatchNorm.convert_sync_batchnorm(copy.deepcopy(ref))
    assert isinstance(sync, hp.SyncBatchNorm)
    start = sum(sizes[:rank])
    for step in range(3):
        x, w = _bn_data(sizes, channels, step, dims)
        xr = x.clone().requires_grad_(True)
        out_ref = ref(xr)
        (out_ref * w).sum().backward()
        xl = x[start:start + sizes[rank]].clone().requires_grad_(True)
        out = sync(xl)
        (out * w[start:start + sizes[rank]]).sum().backward()
        sl = slice(start, start + sizes[rank])
        torch.testing.assert_close(out, out_ref[sl], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(xl.grad, xr.grad[sl], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(sync.running_mean, ref.running_mean, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(sync.running_var, ref.running_var, rtol=1e-5, atol=1e-6)
        assert int(sync.num_batches_tracked) == int(ref.num_batches_tracked)
        # weight/bias: each rank's own sum; their sum over ranks is the reference's
        for name in ("weight", "bias"):
            local = getattr(sync, name).grad
            total = hp.allreduce(local, name=f"bn.{kind}.{step}.{name}", op=hp.Sum)
            torch.testing.assert_close(total, getattr(ref, name).grad, rtol=1e-5, atol=1e-5)
            getattr(sync, name).grad = None
            getattr(ref, name).grad = None
    # eval mode: exactly torch's BatchNorm given the same running statistics (the synced
    # ones above match within rounding; copy them so the comparison can be exact)
    sync.load_state_dict(ref.state_dict())
    sync.eval()
    ref.eval()
    x, _ = _bn_data(sizes, channels, 9, dims)
    with torch.no_grad():
        assert torch.equal(sync(x), ref(x))


@case
def sync_batch_norm():
    """Forward, input gradients and running stats equal one BatchNorm over all batches."""
    size = hp.size()
    even = [4] * size
    uneven = [3 + 2 * r for r in range(size)]
    _check_sync_bn("2d", even, 0.1)
    _check_sync_bn("2d", uneven, None)  # cumulative average, different batch sizes
    _check_sync_bn("1d", uneven, 0.3)


@case
def sync_batch_norm_training():
    """SyncBatchNorm inside a model trained with DistributedOptimizer: no hang, same weights."""
    rank = hp.rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(2, 4, 3), torch.nn.BatchNorm2d(4),
                                torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(16, 2))
    model = hp.SyncBatchNorm.convert_sync_batchnorm(model)
    opt = hp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                  named_parameters=prefixed(model, "bntrain"),
                                  compression=hp.Compression.none)
    g = torch.Generator().manual_seed(rank)
    for _ in range(3):
        x = torch.randn(5, 2, 4, 4, generator=g)
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
    for name, p in model.state_dict().items():
        if p.is_floating_point():
            same = hp.broadcast(p, 0, name=f"bntrain.check.{name}")
            assert torch.equal(same, p), name
    opt.remove_hooks()


# -------------------------------------------------------- 3. unsupported arguments
@case
def unsupported_arguments():
    """Horovod arguments HiPress lacks fail by name, at world size > 1 as well."""
    model = _model(6)
    from hipress.adapter_common import UnsupportedArgumentError

    for kw, frag in ((dict(process_set=object()), "process sets are not supported"),
                     (dict(num_groups=2), "'num_groups' is not supported by HiPress"),
                     (dict(groups=[[0]]), "'groups' is not supported by HiPress"),
                     (dict(op=hp.Adasum), "Adasum reduction is not supported by HiPress")):
        _expect(UnsupportedArgumentError, [frag], lambda kw=kw: hp.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), **kw))
    _expect(UnsupportedArgumentError, ["process_set", "all ranks"],
            lambda: hp.allreduce(torch.ones(2), name="unsup", process_set=object()))


def main():
    suite.worker_main(hp, CASES)


if __name__ == "__main__":
    main()
