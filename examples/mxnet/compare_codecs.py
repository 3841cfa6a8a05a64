"""Run examples/mxnet/train_digits.py once per codec (and seed); print the accuracy table.

The codec settings (but TBQ's warm-up, see :data:`CONFIGS`), seeds, table format and
command line are those of ``examples/torch/compare_codecs.py`` (imported from there, so the
three frameworks compare the same configurations); the training script and the default
config differ. Run it with the MXNet virtualenv's Python (its ``mpirun`` is used)::

    .venv-mxnet/bin/python examples/mxnet/compare_codecs.py --np 4 --epochs 8 --seeds 42 1 2
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent

_spec = importlib.util.spec_from_file_location("torch_compare_codecs",
                                               ROOT / "examples" / "torch" / "compare_codecs.py")
base = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(base)

#: The torch settings, except TBQ: it gets one epoch (21 steps at 4 ranks) of uncompressed
#: warm-up, which it needs here to stay within 2 points of uncompressed (8 epochs, seeds
#: 42/1/2: TensorFlow -2.00 -> -1.11, MXNet -3.18 -> -1.33; PyTorch -1.33 -> -0.96).
CONFIGS = dict(base.CONFIGS)
CONFIGS["tbq"] = list(base.CONFIGS["tbq"]) + ["--warmup-steps", "21"]
base.CONFIGS = CONFIGS


def run(np_: int, config: str, extra: list, epochs: int, seed: int, timeout: float) -> tuple:
    """Run one training job; return (accuracy, seconds, fc1 ratio) or (None, None, error)."""
    env = dict(os.environ, HIPRESS_CONFIG=config, OMPI_ALLOW_RUN_AS_ROOT="1",
               OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    mpirun = Path(sys.executable).parent / "mpirun"
    cmd = [str(mpirun if mpirun.exists() else "mpirun"), "-np", str(np_), "--oversubscribe",
           "--bind-to", "none", "-x", "HIPRESS_CONFIG", "-x", "OMP_NUM_THREADS",
           sys.executable, str(HERE / "train_digits.py"),
           "--no-progress", "--epochs", str(epochs), "--seed", str(seed), *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=timeout)
    m = re.search(r"^final test_acc ([\d.]+)% .*time ([\d.]+)s codecs (.*)$", proc.stdout, re.M)
    if proc.returncode != 0 or not m:
        return None, None, f"failed ({proc.returncode}): {(proc.stdout + proc.stderr)[-1500:]}"
    ratio = re.search(r"fc1[/._](?:kernel|weight)=\w+\(x([\d.]+)\)", m.group(3))
    return float(m.group(1)), float(m.group(2)), ratio.group(1) if ratio else "1"


def main() -> None:
    if not any(a == "--config" or a.startswith("--config=") for a in sys.argv[1:]):
        sys.argv[1:1] = ["--config", str(ROOT / "configs" / "digits-mxnet.yaml")]
    base.run = run
    base.main()


if __name__ == "__main__":
    main()
