"""Failure case x world size -> time to the end of the job, exit status, rank named.

Runs ``tests/workers/failures.py`` under ``hipressrun`` on this machine (rank 1 fails at
step 3 in each way; see that file) and prints a Markdown table. The time is measured from
the ``FAILAT`` stamp the failing rank prints just before failing to the exit of
``hipressrun``; startup is not included.

    python bench/failure_bounds.py --np 2,3,4
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORKER = ROOT / "tests" / "workers" / "failures.py"
CASES = {
    "exception right after init()": ("raise_init", {}),
    "exception before the step's gradients": ("raise_before", {}),
    "exception after submitting them": ("raise_after", {}),
    "exception while the others wait": ("raise_waiting", {}),
    "sys.exit(3)": ("exit3", {}),
    "SIGKILL": ("kill", {}),
    "one step fewer, then shutdown()": ("uneven", {}),
    "one step fewer, no shutdown()": ("uneven_noshutdown", {}),
    "SIGSTOP, stall_shutdown_s=3": ("stop", {"STALL_WARNING": "1", "STALL_SHUTDOWN": "3"}),
}


def run(np_: int, mode: str, extra: dict) -> tuple:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "HIPRESS_"))}
    env.update({"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1", **extra})
    xs = [a for k in sorted(extra) for a in ("-x", k)]
    proc = subprocess.run([sys.executable, "-m", "hipress.launch", "-np", str(np_), *xs,
                           sys.executable, str(WORKER), mode], capture_output=True, text=True,
                          env=env, timeout=180)
    end = time.time()
    stamp = re.search(r"FAILAT (\d+\.\d+)", proc.stdout)
    named = re.findall(r"^hipressrun: (rank \d+ failed \(.*?\))(?::|;)", proc.stderr, re.M)
    elapsed = end - float(stamp.group(1)) if stamp else float("nan")
    return elapsed, proc.returncode, named[-1] if named else "-"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--np", default="2,3,4", help="world sizes, comma-separated")
    ap.add_argument("--cases", default="", help="only cases whose label contains this")
    args = ap.parse_args()
    sizes = [int(n) for n in args.np.split(",")]
    print(f"load average before: {os.getloadavg()[0]:.2f}")
    print("| failure on rank 1 | " + " | ".join(f"np={n}" for n in sizes) + " |")
    print("|---|" + "---|" * len(sizes))
    for label, (mode, extra) in CASES.items():
        if args.cases not in label:
            continue
        cells = []
        for n in sizes:
            elapsed, rc, named = run(n, mode, extra)
            cells.append(f"{elapsed:.1f} s, rc {rc}, {named}")
        print(f"| {label} | " + " | ".join(cells) + " |", flush=True)
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
