"""MPI worker for tests/test_torch_adapter.py: runs the named cases on every rank.

Usage: mpirun -np N python tests/workers/torch_adapter.py case1,case2,...

Each case prints ``PASS <case> rank <r>`` on success; an exception prints ``FAIL <case>``
with the traceback and the worker exits 1 at the end. Every case uses its own gradient
names, so cases do not share engine state.
"""

from __future__ import annotations

import copy
import io
import os
import sys

import numpy as np
import torch

import hipress
import hipress.torch as hp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import behaviour_suite as suite  # noqa: E402

torch.set_num_threads(1)
CASES = {}


# ------------------------------------------------------------ behaviour-suite driver
class TorchTrainer(suite.Trainer):
    def __init__(self, prefix, init, compression, backward_passes_per_step, op, lr, momentum,
                 codec_params):
        self.prefix = prefix
        self.params_ = {k: torch.nn.Parameter(torch.tensor(v)) for k, v in init.items()}
        self.opt = hp.DistributedOptimizer(
            torch.optim.SGD(list(self.params_.values()), lr=lr, momentum=momentum),
            named_parameters=[(self.engine_name(k), p) for k, p in self.params_.items()],
            compression=compression, backward_passes_per_step=backward_passes_per_step,
            op=op, **codec_params)
        self._grads = {}

    def engine_name(self, key):
        return f"{self.prefix}.{key}"

    def step(self, passes):
        self.opt.zero_grad()
        for grads in passes:
            loss = sum((self.params_[k] * torch.tensor(g)).sum() for k, g in grads.items())
            loss.backward()
        self.opt.step()
        self._grads = {k: p.grad.detach().numpy().copy() for k, p in self.params_.items()}

    def grads(self):
        return self._grads

    def params(self):
        return {k: p.detach().numpy().copy() for k, p in self.params_.items()}

    def save(self):
        buf = io.BytesIO()
        torch.save({"params": self.params(), "opt": self.opt.state_dict()}, buf)
        return buf.getvalue()

    def load(self, checkpoint):
        state = torch.load(io.BytesIO(checkpoint), weights_only=False)
        with torch.no_grad():
            for k, v in state["params"].items():
                self.params_[k].copy_(torch.tensor(v))
        self.opt.load_state_dict(state["opt"])

    def close(self):
        self.opt.remove_hooks()


class TorchDriver(suite.Driver):
    framework = "torch"

    def build(self, prefix, init, compression="none", backward_passes_per_step=1,
              op="average", lr=0.0, momentum=0.0, **codec_params):
        return TorchTrainer(f"{prefix}.torch", init, compression, backward_passes_per_step,
                            op, lr, momentum, codec_params)

    def allreduce(self, array, name, op="average", compression=None):
        return hp.allreduce(torch.tensor(array), name=name, op=op,
                            compression=compression).numpy()

    def broadcast(self, array, root, name):
        return hp.broadcast(torch.tensor(array), root, name=name).numpy()

    module = hp

    def tensor(self, array):
        return torch.from_numpy(np.array(array, copy=True))

    def numpy(self, t):
        return t.numpy()


DRIVERS = {"torch": TorchDriver()}


def case(fn):
    CASES[fn.__name__] = fn
    return fn


def prefixed(model, prefix):
    return [(f"{prefix}.{n}", p) for n, p in model.named_parameters()]


# ----------------------------------------------------------------------------- cases
def _int_model(seed):
    g = torch.Generator().manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.ReLU(), torch.nn.Linear(4, 3))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randint(-3, 4, p.shape, generator=g).float())
    return model


def _int_batch(r):
    g = torch.Generator().manual_seed(100 + r)
    return (torch.randint(-4, 5, (6, 5), generator=g).float(),
            torch.randint(-2, 3, (6, 3), generator=g).float())


def _loss(model, batch):
    x, t = batch
    return (model(x) * t).sum()


def _reference_average(model, size):
    """Every rank's (integer) gradient computed here, summed exactly, divided once."""
    total = None
    for r in range(size):
        m = copy.deepcopy(model)
        _loss(m, _int_batch(r)).backward()
        grads = [p.grad.clone() for p in m.parameters()]
        assert all(torch.equal(gr, gr.round()) for gr in grads), "grads must be integers"
        total = grads if total is None else [a + b for a, b in zip(total, grads)]
    return [t / size for t in total]


@case
def identity_exact():
    """compression='none': p.grad after step() is exactly the average of every rank's grad."""
    rank, size = hp.rank(), hp.size()
    model = _int_model(0)
    ref = _reference_average(model, size)
    opt = hp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0),
                                  named_parameters=prefixed(model, "exact"), compression="none")
    for _ in range(2):  # twice: the second step reuses every name
        opt.zero_grad()
        _loss(model, _int_batch(rank)).backward()
        opt.step()
        for (name, p), want in zip(model.named_parameters(), ref):
            assert p.grad.dtype == torch.float32
            assert torch.equal(p.grad, want), (name, p.grad, want)
    stats = hipress.stats()
    assert "exact.0.weight" in stats and stats["exact.0.weight"]["codec"] == "none", stats


@case
def unused_parameter():
    """Rank 1 never uses b: no hang, both ranks get the average, rank 1's residual kept."""
    assert hp.size() == 2
    rank = hp.rank()
    for compression in ("none", "onebit"):
        a = torch.nn.Parameter(torch.zeros(2))
        b = torch.nn.Parameter(torch.zeros(2))
        names = [(f"unused.{compression}.a", a), (f"unused.{compression}.b", b)]
        opt = hp.DistributedOptimizer(torch.optim.SGD([a, b], lr=0.0), named_parameters=names,
                                      compression=compression)
        bname = f"unused.{compression}.b"
        residual_before = None
        for it in range(2):
            opt.zero_grad()
            if rank == 0 or it == 0:  # step 0: b used everywhere; step 1: only rank 0
                loss = (a * torch.tensor([1.0, 1.0])).sum() + (b * torch.tensor([2.0, 4.0])).sum()
            else:
                loss = (a * torch.tensor([3.0, 3.0])).sum()
            loss.backward()
            if it == 1:
                assert (b.grad is None) == (rank == 1), b.grad
                residual_before = _residual(bname)
            opt.step()
        assert b.grad is not None
        if compression == "none":
            assert torch.equal(b.grad, torch.tensor([1.0, 2.0])), b.grad
            assert torch.equal(a.grad, torch.tensor([2.0, 2.0])), a.grad
        else:
            after = _residual(bname)
            assert residual_before is not None, "onebit must keep a residual for b"
            if rank == 1:
                assert np.array_equal(after, residual_before), (after, residual_before)
            else:
                assert not np.array_equal(after, residual_before), "rank 0's residual moves"


def _residual(name):
    """Return this rank's worker-side residual of gradient ``name`` (all partitions), or None.

    The engine keys residuals by ``name#p<partition>`` (``...@agg`` for the aggregator's own
    residual, which is not this rank's local error and is left out).
    """
    parts = []
    for table in hipress.state_dict()["memories"].values():
        for key in sorted(table):
            if (key == name or key.startswith(name + "#")) and "@" not in key:
                parts.append(np.array(table[key], copy=True).reshape(-1))
    return np.concatenate(parts) if parts else None


@case
def backward_passes():
    """Two passes per step are summed locally, then averaged: (1+3 + 5+7) / 2 = 8."""
    assert hp.size() == 2
    rank = hp.rank()
    w = torch.nn.Parameter(torch.zeros(()))
    opt = hp.DistributedOptimizer(torch.optim.SGD([w], lr=0.0), named_parameters=[("bpps.w", w)],
                                  compression="none", backward_passes_per_step=2)
    passes = {0: (1.0, 3.0), 1: (5.0, 7.0)}[rank]
    for _epoch in range(3):  # the count resets at every step(), across epochs too
        for _ in range(2):
            opt.zero_grad()
            for g in passes:
                (w * g).backward()
            opt.step()
            assert w.grad.item() == 8.0, w.grad
    # a third pass before step() raises
    opt.zero_grad()
    (w * 1.0).backward()
    (w * 1.0).backward()
    try:
        (w * 1.0).backward()
    except hp.BackwardPassError as exc:
        assert "backward_passes_per_step=2" in str(exc), exc
        assert "'bpps.w'" in str(exc), exc
    else:
        raise AssertionError("a third backward pass must raise")
    opt.step()  # drains the submitted gradient; the next steps are clean again
    opt.zero_grad()
    for g in passes:
        (w * g).backward()
    opt.step()
    assert w.grad.item() == 8.0, w.grad
    # zero_grad between backward and step is refused: the engine may still read .grad
    opt.zero_grad()
    (w * 1.0).backward()
    try:
        opt.zero_grad()
    except RuntimeError as exc:
        assert "before optimizer.step()" in str(exc)
    else:
        raise AssertionError("zero_grad() mid-step must raise")
    (w * 1.0).backward()
    opt.step()


@case
def bfloat16_cpu():
    """bfloat16 gradients [1.5, 2.0] on both ranks, op Sum -> [3.0, 4.0] in bfloat16."""
    p = torch.nn.Parameter(torch.zeros(2, dtype=torch.bfloat16))
    opt = hp.DistributedOptimizer(torch.optim.SGD([p], lr=0.0), named_parameters=[("bf16.p", p)],
                                  compression="none", op=hp.Sum)
    opt.zero_grad()
    (p * torch.tensor([1.5, 2.0], dtype=torch.bfloat16)).sum().backward()
    opt.step()
    want = torch.tensor([1.5, 2.0], dtype=torch.bfloat16) * hp.size()
    assert p.grad.dtype == torch.bfloat16 and torch.equal(p.grad, want), p.grad
    out = hp.allreduce(torch.tensor([1.5, 2.0], dtype=torch.bfloat16), name="bf16.t", op=hp.Sum)
    assert out.dtype == torch.bfloat16 and torch.equal(out, want), out


@case
def names_checked():
    """Duplicate names are refused, listing them; unnamed optimizer params are refused."""
    a, b, c = (torch.nn.Parameter(torch.zeros(1)) for _ in range(3))
    opt = torch.optim.SGD([a, b, c], lr=0.1)
    try:
        hp.DistributedOptimizer(opt, named_parameters=[("x", a), ("y", b), ("x", c)])
    except ValueError as exc:
        assert "duplicates: 'x'" in str(exc), exc
    else:
        raise AssertionError("duplicate names must raise")
    try:
        hp.DistributedOptimizer(opt, named_parameters=[("x", a), ("y", b)])
    except ValueError as exc:
        assert "not in it" in str(exc), exc
    else:
        raise AssertionError("a missing name must raise")
    try:
        hp.DistributedOptimizer(opt, compression="no-such-codec")
    except hipress.errors.CodecError as exc:
        assert "onebit" in str(exc), exc  # lists the valid names
    else:
        raise AssertionError("an unknown codec must raise")


@case
def sparse_embedding():
    """Sparse gradients are densified: p.grad is the dense average."""
    size, rank = hp.size(), hp.rank()
    emb = torch.nn.Embedding(6, 3, sparse=True)
    opt = hp.DistributedOptimizer(torch.optim.SGD(emb.parameters(), lr=0.0),
                                  named_parameters=prefixed(emb, "sparse"), compression="none")
    idx = {r: torch.tensor([r, r + 1, 1]) for r in range(size)}
    ref = torch.zeros(6, 3)
    for r in range(size):
        for i in idx[r].tolist():
            ref[i] += 2.0
    opt.zero_grad()
    (emb(idx[rank]) * 2.0).sum().backward()
    assert emb.weight.grad.is_sparse
    opt.step()
    assert not emb.weight.grad.is_sparse
    assert torch.equal(emb.weight.grad, ref / size), (emb.weight.grad, ref / size)


def _ckpt_batch(step, rank):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(8, 20, generator=g), torch.randint(0, 4, (8,), generator=g)


def _ckpt_step(model, opt, step):
    x, y = _ckpt_batch(step, hp.rank())
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()


@case
def checkpoint():
    """optimizer.state_dict() carries the residuals; a fresh optimizer restores them exactly."""
    torch.manual_seed(0)

    def build():
        m = torch.nn.Sequential(torch.nn.Linear(20, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
        o = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
        return m, hp.DistributedOptimizer(o, named_parameters=prefixed(m, "ckpt"),
                                          compression="onebit")

    model, opt = build()
    for s in range(3):
        _ckpt_step(model, opt, s)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    saved_residuals = {n: _residual(n) for n, _ in prefixed(model, "ckpt")}
    assert all(r is not None for r in saved_residuals.values()), saved_residuals
    _ckpt_step(model, opt, 3)
    want_params = [p.detach().clone() for p in model.parameters()]
    want_residuals = {n: _residual(n) for n in saved_residuals}
    assert any(not np.array_equal(want_residuals[n], saved_residuals[n]) for n in saved_residuals)
    opt.remove_hooks()

    model2, opt2 = build()
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)  # plain tensors and values only
    model2.load_state_dict(ckpt["model"])
    opt2.load_state_dict(ckpt["opt"])
    for n, r in saved_residuals.items():
        got = _residual(n)
        assert got.dtype == r.dtype and np.array_equal(got.view(np.uint8), r.view(np.uint8)), n
    _ckpt_step(model2, opt2, 3)
    for p, want in zip(model2.parameters(), want_params):
        assert torch.equal(p.detach(), want)
    for n, r in want_residuals.items():
        assert np.array_equal(_residual(n), r), n


@case
def broadcast_state():
    """broadcast_parameters / broadcast_optimizer_state give every rank root's values."""
    rank = hp.rank()
    torch.manual_seed(rank)  # different init per rank
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    model(torch.randn(5, 4)).sum().backward()  # BN running stats differ per rank
    opt = torch.optim.Adam(model.parameters(), lr=0.01 * (rank + 1))
    opt.step()  # rank-dependent Adam state
    root_params = hp.broadcast_object(
        {k: v.clone() for k, v in model.state_dict().items()} if rank == 1 else None, root_rank=1,
        name="bcast.check")
    from hipress import api

    rounds = api._ENGINE._round
    hp.broadcast_parameters(model.state_dict(), root_rank=1)
    # all 7 tensors started before any is waited for: they share rounds (one at a time
    # took a round each)
    assert api._ENGINE._round - rounds <= 3, api._ENGINE._round - rounds
    for k, v in model.state_dict().items():
        assert torch.equal(v, root_params[k]), k
    root_state = hp.broadcast_object(opt.state_dict() if rank == 1 else None, root_rank=1,
                                     name="bcast.opt.check")
    hp.broadcast_optimizer_state(opt, root_rank=1)
    got = opt.state_dict()
    assert got["param_groups"][0]["lr"] == 0.02
    for i, st in root_state["state"].items():
        for key, val in st.items():
            assert torch.equal(got["state"][i][key], val), (i, key)


def _toy_data(seed, n=64):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(16, 4, generator=torch.Generator().manual_seed(7))
    x = torch.randn(n, 16, generator=g)
    return x, (x @ w).argmax(1)


@case
def loss_falls_every_codec():
    """Every built-in codec trains: the loss after 40 steps is well below the first one."""
    from hipress.codecs import codec_names

    rank = hp.rank()
    # TBQ has no default threshold; random-k at its default 1% moves 5 of 512 weights a step
    codec_params = {"tbq": {"threshold": 0.01}, "randomk": {"ratio": 0.1}}
    results = {}
    for name in codec_names():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(),
                                    torch.nn.Linear(32, 4))
        # DGC's memory applies momentum correction itself: plain SGD outside (as in the paper)
        momentum = 0.0 if name == "dgc" else 0.9
        opt = hp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1,
                                                      momentum=momentum),
                                      named_parameters=prefixed(model, f"falls.{name}"),
                                      compression=name, **codec_params.get(name, {}))
        x, y = _toy_data(rank)
        losses = []
        for _ in range(40):
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        opt.remove_hooks()
        results[name] = (losses[0], min(losses[-5:]))
        params = [p.detach().clone() for p in model.parameters()]
        root = hp.broadcast_object(params if rank == 0 else None, 0, name=f"falls.{name}.eq")
        assert all(torch.equal(a, b) for a, b in zip(params, root)), f"{name}: ranks diverged"
    if rank == 0:
        print("LOSSES " + " ".join(f"{k}:{a:.3f}->{b:.3f}" for k, (a, b) in results.items()))
    bad = {k: v for k, v in results.items() if not v[1] < 0.6 * v[0]}
    assert not bad, f"loss did not fall enough: {bad}"


@case
def ddp_hook():
    """DDP with the HiPress comm hook (gloo group) averages the buckets exactly."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    size, rank = hp.size(), hp.rank()
    _ddp_group()
    base = _int_model(3)
    ref = _reference_average(base, size)
    model = DDP(copy.deepcopy(base), bucket_cap_mb=0.0001)  # several buckets
    model.register_comm_hook(hp.DDPHookState(model, prefix="ddp"), hp.make_ddp_hook("none"))
    for _ in range(3):  # the 2nd iteration runs on rebuilt buckets
        model.zero_grad()
        _loss(model, _int_batch(rank)).backward()
        for p, want in zip(model.parameters(), ref):
            assert torch.equal(p.grad, want), (p.grad, want)
    names = [n for n in hipress.stats() if n.startswith("ddp.0.")]
    assert names, hipress.stats().keys()
    # a compressed hook runs too (fp16 of small integers is exact)
    model2 = DDP(copy.deepcopy(base))
    model2.register_comm_hook(hp.DDPHookState(model2, prefix="ddp16"),
                              hp.make_ddp_hook("fp16"))
    model2.zero_grad()
    _loss(model2, _int_batch(rank)).backward()
    for p, want in zip(model2.parameters(), ref):
        assert torch.equal(p.grad, want), (p.grad, want)


@case
def gradscaler_overflow():
    """GradScaler: one rank overflows once -> step skipped on every rank, scale halves,
    training goes on and parameters stay bit-identical (also with 2 accumulated passes)."""
    rank, size = hp.rank(), hp.size()
    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    for bpps in (1, 2):
        model = copy.deepcopy(base)
        opt = hp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                      named_parameters=prefixed(model, f"amp{bpps}"),
                                      compression="onebit", backward_passes_per_step=bpps)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=1000)
        gen = torch.Generator().manual_seed(rank)
        for step in range(4):
            opt.zero_grad()
            for p in range(bpps):
                x, t = torch.randn(8, 32, generator=gen), torch.randn(8, 4, generator=gen)
                if step == 1 and p == 0 and rank == size - 1:
                    x[0, 0] = float("inf")  # this rank's gradients overflow, once
                scaler.scale(((model(x) - t) ** 2).mean()).backward()
            opt.synchronize()
            scaler.unscale_(opt)
            before = [q.detach().clone() for q in model.parameters()]
            scale = scaler.get_scale()
            with opt.skip_synchronize():
                scaler.step(opt)
            scaler.update()
            after = [q.detach().clone() for q in model.parameters()]
            moved = any(not torch.equal(a, b) for a, b in zip(before, after))
            if step == 1:
                assert not moved, f"bpps {bpps}: the overflowed step was applied on rank {rank}"
                assert scaler.get_scale() == scale / 2, (scaler.get_scale(), scale)
            else:
                assert moved, f"bpps {bpps} step {step}: no update"
                assert scaler.get_scale() == scale, (step, scaler.get_scale(), scale)
            assert all(torch.isfinite(q).all() for q in after), f"bpps {bpps} step {step}"
            root = hp.broadcast_object(after if rank == 0 else None, 0,
                                       name=f"amp{bpps}.eq{step}")
            assert all(torch.equal(a, b) for a, b in zip(after, root)), f"step {step} diverged"
        opt.remove_hooks()


@case
def differentiable_collectives():
    """Autograd through hp.allreduce (sum/average) and hp.allgather, as horovod.torch."""
    rank, size = hp.rank(), hp.size()
    y = torch.ones(3, requires_grad=True)
    z = hp.allreduce(y * (rank + 1), name="diff.sum", op=hp.Sum)
    assert torch.equal(z.detach(), torch.full((3,), float(size * (size + 1) // 2)))
    (z * (rank + 1)).sum().backward()
    # d/dy of sum_r (r+1) * allreduce_sum(y_r (r+1)): rank r gets (r+1) * sum_k (k+1)
    want = float((rank + 1) * size * (size + 1) // 2)
    assert torch.equal(y.grad, torch.full((3,), want)), (y.grad, want)
    y2 = torch.ones(2, requires_grad=True)
    hp.allreduce(y2 * (rank + 1), name="diff.avg").sum().backward()
    # the backward averages the incoming gradients (all ones): y2.grad = (rank + 1)
    assert torch.equal(y2.grad, torch.full((2,), float(rank + 1))), y2.grad
    x = torch.full((rank + 1, 2), float(rank), requires_grad=True)
    g = hp.allgather(x, name="diff.ag")
    assert g.shape == (size * (size + 1) // 2, 2)
    weights = torch.arange(g.shape[0], dtype=torch.float32)[:, None] * (rank + 1)
    (g * weights).sum().backward()
    # averaged over ranks: row i's gradient is i * mean_r (r + 1); this rank gets its rows
    off = rank * (rank + 1) // 2
    mean = sum(r + 1 for r in range(size)) / size
    want = torch.arange(off, off + rank + 1, dtype=torch.float32)[:, None].expand(rank + 1, 2)
    assert torch.allclose(x.grad, want * mean), (x.grad, want * mean)
    # no grad needed: plain collectives, no autograd node
    assert hp.allreduce(torch.ones(2), name="diff.plain").grad_fn is None


@case
def inplace_and_async_collectives():
    """allreduce_, allreduce_async_, grouped_allreduce_, broadcast_async(_), poll."""
    rank, size = hp.rank(), hp.size()
    total = float(size * (size - 1) // 2)
    t = torch.full((5,), float(rank))
    assert hp.allreduce_(t, name="ip.ar", op=hp.Sum) is t and t.tolist() == [total] * 5
    t = torch.full((4, 3), float(rank))
    h = hp.allreduce_async_(t, name="ip.ara", op=hp.Sum)
    out = hp.synchronize(h)
    assert out is t and hp.poll(h) and torch.all(t == total)
    ts = [torch.full((2,), float(rank)), torch.full((3,), float(rank), dtype=torch.float64)]
    outs = hp.grouped_allreduce_(ts, name="ip.group", op=hp.Sum)
    assert outs[0] is ts[0] and outs[1] is ts[1] and all(torch.all(x == total) for x in ts)
    h = hp.grouped_allreduce_async(ts, name="ip.groupa", op=hp.Sum)
    new = hp.synchronize(h)
    assert all(torch.all(x == total * size) for x in new) and all(torch.all(x == total)
                                                                   for x in ts)
    b = torch.full((3,), float(rank))
    got = hp.synchronize(hp.broadcast_async(b, size - 1, name="ip.bca"))
    assert got.tolist() == [float(size - 1)] * 3 and b.tolist() == [float(rank)] * 3
    assert hp.synchronize(hp.broadcast_async_(b, size - 1, name="ip.bca_")) is b
    assert b.tolist() == [float(size - 1)] * 3
    strided = torch.arange(12.0).reshape(3, 4).t() * (rank + 1)  # not contiguous
    hp.allreduce_(strided, name="ip.strided", op=hp.Sum)
    assert torch.equal(strided, torch.arange(12.0).reshape(3, 4).t() * (size * (size + 1) // 2))


def _ddp_group():
    import torch.distributed as dist

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("RANK", str(hp.rank()))
        os.environ.setdefault("WORLD_SIZE", str(hp.size()))
        dist.init_process_group("gloo")
    return dist


@case
def ddp_powersgd_per_parameter():
    """The README recipe make_ddp_hook(compression="powersgd", rank=1) compresses each
    weight matrix (a conv kernel as (out, in*kh*kw)); ratio > 10 with a 1024x1024 layer."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist = _ddp_group()
    rank = hp.rank()
    torch.manual_seed(1)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3), torch.nn.Flatten(), torch.nn.Linear(8 * 6 * 6, 1024),
        torch.nn.ReLU(), torch.nn.Linear(1024, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 10))
    ddp = DDP(model)
    ddp.register_comm_hook(hp.DDPHookState(ddp, prefix="psgd"),
                           hp.make_ddp_hook(compression="powersgd", rank=1))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(3):
        opt.zero_grad()
        x, t = torch.randn(4, 3, 8, 8, generator=gen), torch.randint(0, 10, (4,), generator=gen)
        torch.nn.functional.cross_entropy(ddp(x), t).backward()
        opt.step()
    stats = {n: st for n, st in hipress.stats().items() if n.startswith("psgd.")}
    assert set(stats) == {f"psgd.{n}" for n, _ in model.named_parameters()}, sorted(stats)
    for n in ("0.weight", "2.weight", "4.weight", "6.weight"):
        assert stats[f"psgd.{n}"]["codec"] == "powersgd", (n, stats[f"psgd.{n}"])
    assert stats["psgd.4.weight"]["compression_ratio"] > 400, stats["psgd.4.weight"]
    assert stats["psgd.0.weight"]["compression_ratio"] > 1.5, stats["psgd.0.weight"]
    assert stats["psgd.4.bias"]["compression_ratio"] <= 1.0, stats["psgd.4.bias"]
    raw = sum(st["raw_bytes"] for st in stats.values())
    payload = sum(st["payload_bytes"] for st in stats.values())
    if rank == 0:
        print(f"DDP_POWERSGD_RATIO {raw / payload:.1f}", flush=True)
    assert raw / payload > 10, (raw, payload)
    params = [q.detach().clone() for q in model.parameters()]
    root = hp.broadcast_object(params if rank == 0 else None, 0, name="psgd.eq")
    assert all(torch.equal(a, b) for a, b in zip(params, root)), "ranks diverged"
    dist.barrier()


@case
def ddp_rules_on_parameter_names():
    """Under the policy, compression.rules match the DDP hook's parameter names."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from hipress.config import CompressionRule

    _ddp_group()
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    ddp = DDP(model)
    ddp.register_comm_hook(hp.DDPHookState(ddp, prefix="rules"), hp.make_ddp_hook())
    rules = [CompressionRule(pattern="*.bias", algorithm="none")]
    with suite.policy(algorithm="onebit", min_compress_bytes=0, rules=rules, params={}):
        ddp(torch.randn(4, 16)).sum().backward()
    stats = hipress.stats()
    for n, _ in model.named_parameters():
        want = "none" if n.endswith("bias") else "onebit"
        assert stats[f"rules.{n}"]["codec"] == want, (n, stats[f"rules.{n}"])


@case
def ddp_plan_auto():
    """DDP's comm hook under sync.plan: auto: the hook counts the steps (a bucket index
    repeats), every rank plans at the same bucket, and the replicas stay identical."""
    import hashlib

    from torch.nn.parallel import DistributedDataParallel as DDP

    from hipress.api import _engine

    hp.shutdown()
    hp.init({"compression": {"algorithm": "onebit"},
             "sync": {"plan": "auto", "plan_observe_steps": 1, "stall_timeout_s": 20},
             "logging": {"level": "WARNING"}})
    try:
        _ddp_group()
        torch.manual_seed(0)
        model = DDP(torch.nn.Sequential(torch.nn.Linear(256, 128), torch.nn.ReLU(),
                                        torch.nn.Linear(128, 10)), bucket_cap_mb=0.05)
        model.register_comm_hook(hp.DDPHookState(model, prefix="auto"), hp.make_ddp_hook())
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        g = torch.Generator().manual_seed(hp.rank())
        for _ in range(5):
            opt.zero_grad()
            model(torch.randn(8, 256, generator=g)).pow(2).sum().backward()
            opt.step()
        p = _engine()._plan.plan  # made at iteration 2's first bucket, followed since
        assert p is not None and {gr.name for gr in p.gradients} == {
            f"auto.{n}" for n, _ in model.module.named_parameters()}, p
        digest = hashlib.sha1(b"".join(q.detach().numpy().tobytes()
                                       for q in model.parameters())).hexdigest()
        got = [hp.broadcast_object(digest, root_rank=r, name=f"ddp-auto-{r}")
               for r in range(hp.size())]
        assert len(set(got)) == 1, got
    finally:
        hp.shutdown()
        hp.init({"compression": {"min_compress_bytes": 0}, "sync": {"stall_timeout_s": 20},
                 "logging": {"level": "WARNING"}})


# ----------------------------------------------------------------------------- main
def main():
    names = sys.argv[1].split(",")
    hp.init({"compression": {"min_compress_bytes": 0}, "sync": {"stall_timeout_s": 20},
             "logging": {"level": "WARNING"}})
    status = suite.run_cases(names, DRIVERS, CASES)
    hp.shutdown()
    sys.exit(status)


if __name__ == "__main__":
    main()
