"""Train a small CNN on scikit-learn's handwritten digits with HiPress (data parallel).

The digits (1797 8x8 grey images, 10 classes) ship with scikit-learn: real data, no
download. The training set is split across ranks; every rank evaluates its share of the
test set and the counts are summed, so the accuracy is that of the whole test set.

Run it with the launcher and a job config (compression and sync policy from the YAML)::

    hipressrun -np 4 --config configs/digits-torch.yaml

or directly under MPI (compression from ``--compression``, else ``HIPRESS_CONFIG``, else
none)::

    mpirun -np 4 python examples/torch/train_digits.py --compression onebit
    mpirun -np 4 python examples/torch/train_digits.py --compression dgc --param ratio=0.01

or under ``torchrun`` (HiPress then runs over torch.distributed's gloo), here as a
``DistributedDataParallel`` model whose gradients HiPress's comm hook carries::

    torchrun --nproc-per-node 4 examples/torch/train_digits.py --ddp --compression powersgd

Rank 0 shows a progress bar and prints one line per epoch::

    epoch 3/5 loss 0.1234 test_acc 97.50%

Precedence of the compression settings: defaults < YAML (``HIPRESS_CONFIG``, set by
``hipressrun --config``) < ``HIPRESS_*`` environment < this script's flags. ``--compression``
replaces the algorithm and its params (``--param key=value``, repeatable); the rest of the
policy (rules, ``min_compress_bytes``, warm-up, memory) still comes from the config unless
``--min-compress-bytes``, ``--warmup-steps`` or ``--memory`` are given.
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F  # noqa: N812

import hipress.torch as hp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from digits_common import argument_parser, config_overrides, load_data  # noqa: E402
from models import DigitsCNN  # noqa: E402


def parse_args(argv=None):
    parser = argument_parser(__doc__.split("\n\n")[0])
    parser.add_argument("--ddp", action="store_true",
                        help="wrap the model in DistributedDataParallel with HiPress's comm "
                             "hook instead of hipress.torch.DistributedOptimizer")
    parser.add_argument("--device", default="cpu",
                        help="cpu (default) or cuda: model, data and gradients on GPU "
                             "local_rank (ranks of a host share its GPUs round robin)")
    return parser.parse_args(argv)


def to_tensors(x: np.ndarray, y: np.ndarray):
    """Return images as float32 (n, 1, 8, 8) and labels as int64 tensors."""
    return torch.from_numpy(x).reshape(-1, 1, 8, 8), torch.from_numpy(y.astype(np.int64))


def shard(n: int, epoch: int, seed: int, rank: int, size: int) -> torch.Tensor:
    """Return this rank's sample indices for ``epoch``: equal counts on every rank."""
    g = torch.Generator().manual_seed(seed * 1000 + epoch)
    perm = torch.randperm(n, generator=g)
    per_rank = n // size
    return perm[rank::size][:per_rank]


def evaluate(model, x, y, rank, size):
    """Return (correct, count, loss sum) of this rank's share of the test set."""
    model.eval()
    with torch.no_grad():
        xs, ys = x[rank::size], y[rank::size]
        logits = model(xs)
        correct = (logits.argmax(1) == ys).sum().item()
        loss = F.cross_entropy(logits, ys, reduction="sum").item()
    model.train()
    return correct, len(ys), loss


class _LineStream:
    """File-like wrapper that turns tqdm's carriage-return redraws into whole lines."""

    def __init__(self, stream) -> None:
        self.stream = stream

    def write(self, text: str) -> None:
        text = text.replace("\r", "").strip()
        if text:
            self.stream.write(text + "\n")

    def flush(self) -> None:
        self.stream.flush()


def main(argv=None) -> float:
    args = parse_args(argv)
    torch.set_num_threads(1)
    hp.init(**config_overrides(args))
    rank, size = hp.rank(), hp.size()

    device = torch.device("cpu")
    if args.device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda: torch sees no CUDA device (torch "
                             f"{torch.__version__}); run on a GPU machine or use --device cpu")
        device = torch.device("cuda", hp.local_rank() % torch.cuda.device_count())
        torch.cuda.set_device(device)
    elif args.device != "cpu":
        raise SystemExit(f"--device {args.device!r}: use cpu or cuda")
    x_tr, y_tr, x_te, y_te = load_data(args.test_fraction, args.seed)
    (x_tr, y_tr), (x_te, y_te) = to_tensors(x_tr, y_tr), to_tensors(x_te, y_te)
    x_tr, y_tr, x_te, y_te = (t.to(device) for t in (x_tr, y_tr, x_te, y_te))
    torch.manual_seed(args.seed)
    model = DigitsCNN().to(device)
    if args.ddp:
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel

        if not dist.is_initialized():
            dist.init_process_group("gloo")  # env:// (torchrun, or hipressrun's exports)
        ddp = DistributedDataParallel(model)  # broadcasts rank 0's parameters
        ddp.register_comm_hook(hp.DDPHookState(ddp), hp.make_ddp_hook())
        opt = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=args.momentum)
        forward = ddp
    else:
        opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
        opt = hp.DistributedOptimizer(opt, named_parameters=model.named_parameters())
        hp.broadcast_parameters(model.state_dict(), root_rank=0)
        hp.broadcast_optimizer_state(opt, root_rank=0)
        forward = model

    progress = None
    if rank == 0 and not args.no_progress:
        try:
            from tqdm import tqdm

            progress = tqdm
        except ImportError:
            progress = None

    start = time.perf_counter()
    acc = 0.0
    for epoch in range(1, args.epochs + 1):
        idx = shard(len(x_tr), epoch, args.seed, rank, size).to(device)
        batches = torch.split(idx, args.batch_size)
        it = batches
        if progress is not None:
            # under mpirun/hipressrun stderr is a pipe that is relayed line by line: give the
            # bar whole lines (one per second) instead of carriage-return redraws
            tty = sys.stderr.isatty()
            it = progress(batches, desc=f"epoch {epoch}/{args.epochs}", leave=False,
                          unit="batch", file=sys.stderr if tty else _LineStream(sys.stderr),
                          mininterval=0.1 if tty else 1.0, ncols=None if tty else 70)
        loss_sum = 0.0
        for b in it:
            opt.zero_grad()
            loss = F.cross_entropy(forward(x_tr[b]), y_tr[b])
            loss.backward()
            opt.step()
            loss_sum += loss.item() * len(b)
        correct, count, _ = evaluate(model, x_te, y_te, rank, size)
        # metrics are summed exactly: never compressed, whatever the config says
        totals = hp.allreduce(torch.tensor([loss_sum, len(idx), correct, count],
                                           dtype=torch.float64),
                              name=f"metrics.epoch{epoch}", op=hp.Sum, compression="none")
        train_loss = totals[0].item() / totals[1].item()
        acc = 100.0 * totals[2].item() / totals[3].item()
        if rank == 0:
            print(f"epoch {epoch}/{args.epochs} loss {train_loss:.4f} test_acc {acc:.2f}%",
                  flush=True)
    elapsed = time.perf_counter() - start
    if rank == 0:
        import hipress

        codecs = sorted(
            f"{n}={s['codec']}" + (f"(x{s.get('compression_ratio', 1):.1f})"
                                   if s["codec"] != "none" else "")
            for n, s in hipress.stats().items()
            if not n.startswith(("metrics.", "broadcast", "optimizer_state", "__")))
        print(f"final test_acc {acc:.2f}% ranks {size} time {elapsed:.1f}s codecs "
              f"{' '.join(codecs)}", flush=True)
    hp.shutdown()
    return acc


if __name__ == "__main__":
    main()
