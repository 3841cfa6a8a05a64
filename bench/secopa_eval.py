"""SeCoPa evidence: predicted vs measured sync time of a plan and of its baselines.

Under mpirun on localhost (it launches itself), in one run:

1. profile the cluster (``hipress.secopa.run_profile``, ``--profile-budget`` seconds) or load
   a profile (``--profile``);
2. predict, with SeCoPa's cost model, the per-iteration sync time of the gradient set under
   four policies: ``plan`` (SeCoPa's per-gradient choice), ``compress_everything`` (every
   gradient compressed, best path and K each), ``threshold`` (the engine's fixed policy:
   compress >= 64 KiB, ceil(bytes / 4 MiB) partitions) and ``compress_nothing``;
3. measure each policy with the real engine (``hipress.allreduce_async`` per gradient with
   the policy's codec and strategy; the per-gradient partition count is applied through a
   small monkeypatch of ``Engine._partitions`` that stands in for the integration of
   ``sync.plan`` into the engine), slowest rank, median over ``--iters`` after one warm-up.

Usage::

    python bench/secopa_eval.py --np 4 --model resnet50 --codec onebit --strategy ps
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

POLICIES = ("plan", "compress_everything", "threshold", "compress_nothing")


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--np", type=int, default=4)
    p.add_argument("--model", default="resnet50")
    p.add_argument("--codec", default="onebit")
    p.add_argument("--params", default="{}")
    p.add_argument("--strategy", default="ps", choices=("ps", "ring", "auto"))
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--profile", default=None, help="load this profile instead of measuring")
    p.add_argument("--profile-budget", type=float, default=20.0)
    p.add_argument("--save-profile", default=None)
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args()


def launch(args: argparse.Namespace) -> int:
    mpirun = Path(sys.executable).parent / "mpirun"
    cmd = [str(mpirun if mpirun.exists() else "mpirun"), "-np", str(args.np), "--oversubscribe",
           "--bind-to", "none", sys.executable, __file__, "--worker"] + sys.argv[1:]
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMPI_MCA_mpi_yield_when_idle="1", PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1",
               NUMBA_NUM_THREADS="1")
    return subprocess.call(cmd, env=env)


def choices(model, codec, shapes, strategy, fb, policy):
    """Per-gradient (compress, Cost) of a policy, and its predicted total (seconds)."""
    from hipress.secopa.cost import engine_paths
    from hipress.secopa.planner import _best, may_compress, options

    out = []
    for shape in shapes:
        n = math.prod(shape)
        unc = (False, model.uncompressed(n))
        comp = options(model, codec, n, strategy, fb, allow_uncompressed=False, force=True,
                       shape=shape)
        if policy == "compress_nothing" or not comp:
            out.append(unc)
        elif policy == "compress_everything":
            out.append(_best(comp))
        elif policy == "plan":
            out.append(_best([unc] + (comp if may_compress(codec, n, shape) else [])))
        else:  # threshold
            paths = engine_paths(codec, strategy)
            path = "allreduce" if codec.summable and "allreduce" in paths else paths[0]
            if 4 * n < 65536:
                out.append(unc)
            else:
                k = max(1, math.ceil(4 * n / (4 * 2**20)))
                out.append((True, model.compressed(codec, n, path, k, fb, tuple(shape))))
    total = sum(c.total_s for _, c in out)
    if any(not z for z, _ in out):
        total += model.fused_fixed()
    return out, total


def worker(args: argparse.Namespace) -> None:
    from mpi4py import MPI

    import hipress as hp
    from hipress.codecs import get_codec
    from hipress.engine import engine as engine_mod
    from hipress.secopa import CostModel, Profile, load_gradients, run_profile

    comm = MPI.COMM_WORLD
    rank, N = comm.Get_rank(), comm.Get_size()
    codec = get_codec(args.codec, **json.loads(args.params))
    if args.profile:
        prof = Profile.load(args.profile)
    else:
        dup = comm.Dup()
        prof = run_profile(dup, [codec], time_budget_s=args.profile_budget)
        dup.Free()
        if rank == 0 and args.save_profile:
            prof.save(args.save_profile)
    model = CostModel(prof, N)
    fb = bool(codec.error_feedback)
    grads = load_gradients(args.model)
    rng = np.random.default_rng(1234 + rank)
    arrays = {name: rng.standard_normal(shape, dtype=np.float32) * 0.01 for name, shape in grads}

    # stand-in for the sync.plan integration: per-gradient partitions by name
    parts = {}
    current = {}
    orig_path, orig_parts = engine_mod.Engine._path, engine_mod.Engine._partitions

    def _path(self, sub):
        current["name"] = sub.name
        return orig_path(self, sub)

    def _partitions(self, nbytes):
        k = parts.get(current.get("name"))
        return k if k is not None else orig_parts(self, nbytes)

    engine_mod.Engine._path = _path
    engine_mod.Engine._partitions = _partitions
    hp.init({"compression": {"algorithm": "none", "min_compress_bytes": 0},
             "logging": {"level": "WARNING"}})

    plans = {}
    for policy in args.policies.split(","):
        ch, predicted = choices(model, codec, [s for _, s in grads], args.strategy, fb, policy)
        subs = []
        for (name, _), (z, cost) in zip(grads, ch):
            label = f"{policy}/{name}"
            if z:
                parts[label] = cost.partitions
                subs.append((name, label, codec, cost.path))
            else:
                subs.append((name, label, None, None))
        plans[policy] = (ch, predicted, subs, [])
    # iterations interleaved across policies, so load changes on a shared machine hit all
    for it in range(args.iters + 1):
        for _, _, subs, times in plans.values():
            comm.Barrier()
            t0 = time.perf_counter()
            hs = [hp.allreduce_async(arrays[n], label, codec=c, strategy=s)
                  for n, label, c, s in reversed(subs)]
            for h in hs:
                hp.synchronize(h)
            dt = comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)
            if it:
                times.append(dt)
    results = []
    for policy, (ch, predicted, _, times) in plans.items():
        measured = float(np.median(times))
        row = {"model": args.model, "codec": args.codec, "strategy": args.strategy, "np": N,
               "policy": policy, "compressed": sum(z for z, _ in ch), "gradients": len(ch),
               "predicted_s": predicted, "measured_s": measured, "times_s": times}
        results.append(row)
        if rank == 0:
            print(f"{args.model:9s} {args.codec:8s} {args.strategy:4s} {policy:20s} "
                  f"compressed {row['compressed']:3d}/{len(ch):3d}  predicted {predicted:7.3f} s"
                  f"  measured {measured:7.3f} s  ({' '.join(f'{t:.3f}' for t in times)})",
                  flush=True)
    if rank == 0:
        print(f"profile: step overhead {prof.step_overhead_s * 1e6:.0f} us, "
              f"{prof.elapsed_s:.1f} s; load average {os.getloadavg()[0]:.1f}", flush=True)
    hp.shutdown()
    if rank == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump({"profile_elapsed_s": prof.elapsed_s, "rows": results}, f, indent=1)


if __name__ == "__main__":
    a = parse()
    if a.worker:
        worker(a)
    else:
        sys.exit(launch(a))
