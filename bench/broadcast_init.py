r"""Initial broadcast of a model's state: one tensor at a time against all started together.

Run under a launcher with several ranks; rank 0 prints, per variant and repetition, the
seconds and the negotiation rounds it took::

    hipressrun -np 4 python bench/broadcast_init.py                    # localhost
    python -m hipress.testing.emucluster --hosts 4 --rate 1gbit -- \
        sh -c 'hipressrun -np 4 -H $HIPRESS_EMU_HOSTS python bench/broadcast_init.py'
    ... python bench/broadcast_init.py --tensor-mb 400      # one 400 MB tensor

``one-at-a-time`` is the loop ``broadcast_parameters`` ran before 2026-12-07 (each
``broadcast_`` waited for before the next starts); ``together`` is
``hipress.torch.broadcast_parameters`` now (every broadcast started, then each waited
for). ``together-direct`` is ``together`` with every broadcast sent by the root to each
rank, as the engine did before its scatter-allgather pipeline
(:func:`hipress.engine.tasks.broadcast_task`; every rank switches it off alike). All run
in the same processes, in turn, ``--repeats`` times.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples" / "torch"))

import torch  # noqa: E402
from models import resnet50, vgg19  # noqa: E402

import hipress.torch as hvd  # noqa: E402
from hipress import api  # noqa: E402
from hipress.engine import tasks  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=["resnet50", "vgg19"], default="resnet50")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--tensor-mb", type=int, default=0,
                   help="broadcast one float32 tensor of this many MB instead of --model's "
                        "state")
    args = p.parse_args()
    hvd.init()
    if args.tensor_mb:
        args.model = "one tensor"
        state = {"x": torch.ones(args.tensor_mb * 250_000)}
    else:
        state = (resnet50() if args.model == "resnet50" else vgg19()).state_dict()
    mb = sum(t.numel() * t.element_size() for t in state.values()) / 1e6
    engine = api._ENGINE  # its round counter: how many negotiation rounds a variant took
    for rep in range(args.repeats):
        for variant in ("one-at-a-time", "together-direct", "together"):
            direct = tasks.BCAST_DIRECT_BYTES
            if variant == "together-direct":
                tasks.BCAST_DIRECT_BYTES = 1 << 62
            rounds, t0 = engine._round, time.perf_counter()
            if variant == "one-at-a-time":
                for name, t in state.items():
                    hvd.broadcast_(t, 0, name=f"serial.{rep}.{name}")
            else:
                hvd.broadcast_parameters(state, root_rank=0)
            dt = time.perf_counter() - t0
            tasks.BCAST_DIRECT_BYTES = direct
            if hvd.rank() == 0:
                print(f"{args.model} ({len(state)} tensors, {mb:.0f} MB), {hvd.size()} ranks, "
                      f"{variant}: {dt:.2f} s, {engine._round - rounds} rounds", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
