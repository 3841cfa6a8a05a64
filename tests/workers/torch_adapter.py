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
import traceback

import numpy as np
import torch

import hipress
import hipress.torch as hp

torch.set_num_threads(1)
CASES = {}


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


@case
def identity_exact():
    """compression='none': p.grad after step() is exactly the average of every rank's grad."""
    rank, size = hp.rank(), hp.size()
    model = _int_model(0)
    # reference: every rank's gradient computed here, summed exactly, divided once
    total = None
    for r in range(size):
        m = copy.deepcopy(model)
        _loss(m, _int_batch(r)).backward()
        grads = [p.grad.clone() for p in m.parameters()]
        assert all(torch.equal(gr, gr.round()) for gr in grads), "grads must be integers"
        total = grads if total is None else [a + b for a, b in zip(total, grads)]
    ref = [t / size for t in total]
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
    hp.broadcast_parameters(model.state_dict(), root_rank=1)
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
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    size, rank = hp.size(), hp.rank()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["RANK"] = str(rank)
    os.environ["WORLD_SIZE"] = str(size)
    dist.init_process_group("gloo")
    try:
        base = _int_model(3)
        total = None
        for r in range(size):
            m = copy.deepcopy(base)
            _loss(m, _int_batch(r)).backward()
            grads = [p.grad.clone() for p in m.parameters()]
            total = grads if total is None else [a + b for a, b in zip(total, grads)]
        ref = [t / size for t in total]
        model = DDP(copy.deepcopy(base), bucket_cap_mb=0.0001)  # several buckets
        model.register_comm_hook(hp.DDPHookState(model), hp.make_ddp_hook("none"))
        for _ in range(3):  # the 2nd iteration runs on rebuilt buckets
            model.zero_grad()
            _loss(model, _int_batch(rank)).backward()
            for p, want in zip(model.parameters(), ref):
                assert torch.equal(p.grad, want), (p.grad, want)
        names = [n for n in hipress.stats() if n.startswith("ddp.bucket")]
        assert names, hipress.stats().keys()
        # a compressed hook runs too (fp16 of small integers is exact)
        model2 = DDP(copy.deepcopy(base))
        model2.register_comm_hook(hp.DDPHookState(model2, prefix="ddp16"),
                                  hp.make_ddp_hook("fp16"))
        model2.zero_grad()
        _loss(model2, _int_batch(rank)).backward()
        for p, want in zip(model2.parameters(), ref):
            assert torch.equal(p.grad, want), (p.grad, want)
    finally:
        dist.destroy_process_group()


# ----------------------------------------------------------------------------- main
def main():
    names = sys.argv[1].split(",")
    hp.init({"compression": {"min_compress_bytes": 0}, "sync": {"stall_timeout_s": 20},
             "logging": {"level": "WARNING"}})
    failed = False
    for name in names:
        try:
            CASES[name]()
        except Exception:  # noqa: BLE001
            failed = True
            print(f"FAIL {name} rank {hp.rank()}\n{traceback.format_exc()}", flush=True)
        else:
            print(f"PASS {name} rank {hp.rank()}", flush=True)
    hp.shutdown()
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
