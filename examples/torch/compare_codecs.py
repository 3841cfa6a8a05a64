"""Run train_digits.py once per codec (and seed) under mpirun and print the accuracy table.

Every run uses the same job config (``--config``, default ``configs/digits-torch.yaml``:
biases and tensors under 4 KiB uncompressed, error feedback ``auto``, no warm-up), the
same number of epochs and the same seeds; only the codec settings below differ::

    python examples/torch/compare_codecs.py --np 4 --epochs 8 --seeds 42 1 2

Prints a Markdown table: test accuracy per seed, the mean, and the difference from the
uncompressed run, plus the compression ratio of the largest tensor (fc1.weight).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent

#: label -> extra train_digits.py arguments (the settings each codec needs, documented).
CONFIGS = {
    "uncompressed": ["--compression", "none"],
    # biased sign quantization: residual error feedback (memory auto -> residual)
    "onebit": ["--compression", "onebit"],
    # threshold binary quantization (Strom 2015): +-threshold where |g + e| >= threshold
    "tbq": ["--compression", "tbq", "--param", "threshold=0.01"],
    # unbiased stochastic ternary: no error feedback (memory auto -> none)
    "terngrad": ["--compression", "terngrad"],
    # DGC as in the paper: momentum correction in the DGC memory, so plain SGD outside;
    # 1% density (x48 on fc1.weight); lr 0.1 because sparse updates arrive late
    "dgc": ["--compression", "dgc", "--param", "ratio=0.01", "--memory", "dgc",
            "--momentum", "0", "--lr", "0.1"],
    # drop 99% of the elements by a sampled threshold, residual error feedback
    "graddrop": ["--compression", "graddrop"],
    # rank-1 PowerSGD with error feedback
    "powersgd": ["--compression", "powersgd"],
}


def run(np_: int, config: str, extra: list, epochs: int, seed: int, timeout: float) -> tuple:
    env = dict(os.environ, HIPRESS_CONFIG=config, OMPI_ALLOW_RUN_AS_ROOT="1",
               OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    mpirun = Path(sys.executable).parent / "mpirun"
    cmd = [str(mpirun if mpirun.exists() else "mpirun"), "-np", str(np_), "--oversubscribe",
           "--bind-to", "none", "-x", "HIPRESS_CONFIG", "-x", "OMP_NUM_THREADS",
           sys.executable, str(HERE / "train_digits.py"), "--no-progress",
           "--epochs", str(epochs), "--seed", str(seed), *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=timeout)
    m = re.search(r"^final test_acc ([\d.]+)% .*time ([\d.]+)s codecs (.*)$", proc.stdout, re.M)
    if proc.returncode != 0 or not m:
        tail = (proc.stdout + proc.stderr)[-1500:]
        return None, None, f"failed ({proc.returncode}): {tail}"
    ratio = re.search(r"fc1\.weight=\w+\(x([\d.]+)\)", m.group(3))
    return float(m.group(1)), float(m.group(2)), ratio.group(1) if ratio else "1"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--np", type=int, default=4)
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--seeds", type=int, nargs="+", default=[42, 1, 2])
    p.add_argument("--config", default=str(ROOT / "configs" / "digits-torch.yaml"))
    p.add_argument("--only", nargs="*", default=None, help="labels to run (default: all)")
    p.add_argument("--timeout", type=float, default=300.0)
    args = p.parse_args()

    rows = []
    base = None
    for label, extra in CONFIGS.items():
        if args.only and label not in args.only:
            continue
        accs, times, ratio = [], [], "-"
        for seed in args.seeds:
            acc, secs, info = run(args.np, args.config, extra, args.epochs, seed, args.timeout)
            if acc is None:
                print(f"{label} seed {seed}: {info}", file=sys.stderr)
                continue
            accs.append(acc)
            times.append(secs)
            ratio = info
            print(f"{label} seed {seed}: {acc:.2f}% in {secs:.1f}s", file=sys.stderr, flush=True)
        mean = sum(accs) / len(accs) if accs else float("nan")
        if label == "uncompressed":
            base = mean
        rows.append((label, " ".join(extra), accs, mean, ratio,
                     sum(times) / len(times) if times else float("nan")))
    print(f"\n{args.np} ranks, {args.epochs} epochs, seeds {args.seeds}, config {args.config}\n")
    print("| codec | settings | test acc per seed (%) | mean (%) | vs uncompressed | "
          "fc1.weight ratio | train time (s) |")
    print("|---|---|---|---|---|---|---|")
    for label, settings, accs, mean, ratio, secs in rows:
        diff = f"{mean - base:+.2f}" if base is not None else "-"
        print(f"| {label} | `{settings}` | {' / '.join(f'{a:.2f}' for a in accs)} | "
              f"{mean:.2f} | {diff} | x{ratio} | {secs:.1f} |")


if __name__ == "__main__":
    main()
