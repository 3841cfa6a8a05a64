"""Worker for tests/test_failures.py: a training loop in which one rank fails on purpose.

Usage: python tests/workers/failures.py MODE [FRAMEWORK]   (under mpirun/hipressrun)

Rank 1 (the *culprit*) fails at step 3 in the way MODE says; the other ranks train on.
Just before failing the culprit prints ``FAILAT <unix time>`` so the test can measure the
time from the failure to the end of the job. MODE:

- ``raise_init``: raise right after ``init()``;
- ``raise_before``: raise before the step's gradients are submitted (others wait for them);
- ``raise_after``: raise after submitting them, before waiting for the results;
- ``raise_waiting``: the others are blocked in synchronize for 1 s when the culprit raises;
- ``exit3``: ``sys.exit(3)`` mid-training; ``kill``: SIGKILL itself;
- ``uneven``: the culprit runs one step fewer, then ``hipress.shutdown()`` (or, with
  ``uneven_noshutdown``, just ends);
- ``stop``: SIGSTOP itself (a hung rank); ``STALL_SHUTDOWN`` seconds end the job;
- ``slow``: rank 0 spends ``SLOW`` seconds outside HiPress once (evaluation): only
  warnings, the job completes.

FRAMEWORK ``core`` (default) uses NumPy arrays, ``torch`` a small model with
``hipress.torch.DistributedOptimizer``.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import numpy as np

MODE = sys.argv[1]
FRAMEWORK = sys.argv[2] if len(sys.argv) > 2 else "core"
STEPS = 8
FAIL_STEP = 3

if FRAMEWORK == "torch":
    import torch

    import hipress.torch as hp
else:
    import hipress as hp

hp.init({"logging": {"level": "WARNING"},
         "sync": {"stall_warning_s": float(os.environ.get("STALL_WARNING", "60")),
                  "stall_shutdown_s": float(os.environ.get("STALL_SHUTDOWN", "0"))}})
rank, size = hp.rank(), hp.size()
culprit = rank == 1


def fail_now(how):
    print(f"FAILAT {time.time():.3f}", flush=True)
    if how == "raise":
        raise RuntimeError(f"boom on rank {rank} ({MODE})")
    if how == "exit3":
        sys.exit(3)
    if how == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if how == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)


if MODE == "raise_init" and culprit:
    fail_now("raise")

if FRAMEWORK == "torch":
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    opt = hp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                  named_parameters=model.named_parameters(),
                                  compression="onebit")
    x = torch.randn(16, 32)


def submit(step):
    if FRAMEWORK == "torch":
        opt.zero_grad()
        model(x).sum().backward()  # gradients are submitted as they become ready
        return None
    return [hp.allreduce_async(np.full(4096, rank + step, np.float32), f"grad.{i}",
                               codec="onebit") for i in range(4)]


def wait(handles):
    if FRAMEWORK == "torch":
        opt.step()
    else:
        for h in handles:
            hp.synchronize(h)
        hp.step()


steps = STEPS - 1 if MODE.startswith("uneven") and culprit else STEPS
for step in range(steps):
    if step == FAIL_STEP and culprit:
        if MODE == "raise_before":
            fail_now("raise")
        if MODE == "raise_waiting":
            time.sleep(1.0)  # the others are blocked waiting for this rank's gradients
            fail_now("raise")
        if MODE in ("exit3", "kill", "stop"):
            fail_now(MODE)
    if MODE == "slow" and rank == 0 and step == FAIL_STEP:
        time.sleep(float(os.environ.get("SLOW", "3")))
    handles = submit(step)
    if step == FAIL_STEP and culprit:
        if MODE == "raise_after":
            fail_now("raise")
    wait(handles)
if MODE.startswith("uneven") and culprit:
    print(f"FAILAT {time.time():.3f}", flush=True)  # the others still wait for a step
if MODE != "uneven_noshutdown":
    hp.shutdown()
print(f"DONE rank {rank}", flush=True)
