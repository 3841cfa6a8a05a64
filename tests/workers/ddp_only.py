"""A DDP script that calls no HiPress function but make_ddp_hook (run under torchrun).

Each rank trains a small model on its own data for 3 steps through DDP with the HiPress
hook (``compression`` from argv[1], "none" by default), then checks that the parameters
are bit-identical on every rank and, for "none", equal to a reference trained with
``dist.all_reduce`` averages. Prints ``DDPONLY PASS rank <r> transport <name>``.
"""

import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import hipress
import hipress.torch as hp


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))


def batches(rank):
    g = torch.Generator().manual_seed(100 + rank)
    return [(torch.randn(16, 32, generator=g), torch.randint(0, 4, (16,), generator=g))
            for _ in range(3)]


def main():
    compression = sys.argv[1] if len(sys.argv) > 1 else "none"
    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    model = DDP(make_model())
    assert not hp.is_initialized()
    model.register_comm_hook(hp.DDPHookState(model), hp.make_ddp_hook(compression))
    assert hp.is_initialized() and hp.size() == size and hp.rank() == rank
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref = make_model()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for x, y in batches(rank):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        ref_opt.zero_grad()
        torch.nn.functional.cross_entropy(ref(x), y).backward()
        for p in ref.parameters():
            dist.all_reduce(p.grad)
            p.grad /= size
        ref_opt.step()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    everyone = [torch.empty_like(flat) for _ in range(size)]
    dist.all_gather(everyone, flat)
    assert all(torch.equal(everyone[0], f) for f in everyone), "ranks differ"
    if compression == "none":
        want = torch.cat([p.detach().reshape(-1) for p in ref.parameters()])
        assert torch.allclose(flat, want, rtol=1e-5, atol=1e-6), (flat - want).abs().max()
    transport = hipress.api._engine().world.tx.name
    print(f"DDPONLY PASS rank {rank} transport {transport}", flush=True)
    hp.shutdown()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
