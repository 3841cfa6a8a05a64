r"""Initial broadcast of a model's state: one tensor at a time against all started together.

Run under a launcher with several ranks; rank 0 prints, per variant and repetition, the
seconds and the negotiation rounds it took::

    hipressrun -np 4 python bench/broadcast_init.py                    # localhost
    python -m hipress.testing.emucluster --hosts 4 --rate 1gbit -- \
        sh -c 'hipressrun -np 4 -H $HIPRESS_EMU_HOSTS python bench/broadcast_init.py'

``one-at-a-time`` is the loop ``broadcast_parameters`` ran before 2026-12-07 (each
``broadcast_`` waited for before the next starts); ``together`` is
``hipress.torch.broadcast_parameters`` now (every broadcast started, then each waited
for). Both run in the same processes, alternating, ``--repeats`` times.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples" / "torch"))

from models import resnet50, vgg19  # noqa: E402

import hipress.torch as hvd  # noqa: E402
from hipress import api  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=["resnet50", "vgg19"], default="resnet50")
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args()
    hvd.init()
    state = (resnet50() if args.model == "resnet50" else vgg19()).state_dict()
    mb = sum(t.numel() * t.element_size() for t in state.values()) / 1e6
    engine = api._ENGINE  # its round counter: how many negotiation rounds a variant took
    for rep in range(args.repeats):
        for variant in ("one-at-a-time", "together"):
            rounds, t0 = engine._round, time.perf_counter()
            if variant == "one-at-a-time":
                for name, t in state.items():
                    hvd.broadcast_(t, 0, name=f"serial.{rep}.{name}")
            else:
                hvd.broadcast_parameters(state, root_rank=0)
            dt = time.perf_counter() - t0
            if hvd.rank() == 0:
                print(f"{args.model} ({len(state)} tensors, {mb:.0f} MB), {hvd.size()} ranks, "
                      f"{variant}: {dt:.2f} s, {engine._round - rounds} rounds", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
