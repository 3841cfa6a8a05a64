"""Thread count of NumPy's BLAS while HiPress computes codecs (``sync.blas_threads``).

Matrix codecs (PowerSGD's ``P = M Q`` and ``Q = M^T P``, its Gram-Schmidt) call NumPy's
BLAS, which by default starts one thread per core. Several ranks per machine then run
ranks x cores BLAS threads beside the framework's own, and a thread that spins waiting
for a descheduled peer makes each product many times slower. Measured on the 2-core dev
box (the five PowerSGD products of a ResNet-50-like set, 4 processes at once): 10-63 ms
per pass with OpenBLAS's default 2 threads, 2.0-2.5 ms with 1. A single process alone
took 0.58 ms with 2 threads and 1.09 ms with 1.

The engine is one compute server per rank (its thread, or its pool: see
``sync.compute_threads``), and SeCoPa's cost model and its refit from a timeline price it
as such: the CPU time of a span is read with the thread's own clock, which does not see
BLAS helper threads. So while the engine runs, NumPy's BLAS is limited to
``sync.blas_threads`` threads (default 1), and the original count is restored when it
shuts down. This is the process-wide setting of the BLAS library NumPy loaded (OpenBLAS
has no per-thread count), so NumPy products in the training script run with the same
count meanwhile; PyTorch's, TensorFlow's and MXNet's own thread pools and BLAS libraries
are left alone (only libraries inside NumPy's installation are touched). ``0`` keeps the
library's setting (``OPENBLAS_NUM_THREADS``, ``OMP_NUM_THREADS`` or one per core).

Uses threadpoolctl (https://github.com/joblib/threadpoolctl).
"""

from __future__ import annotations

import logging
import os
from typing import Any, Callable, List

logger = logging.getLogger("hipress")


def _numpy_blas() -> Any:
    """A threadpoolctl controller of the BLAS libraries inside NumPy's installation.

    Wheels carry theirs in ``site-packages/numpy.libs`` (Linux) or ``numpy/.dylibs``
    (macOS); NumPy is imported first so that its BLAS is loaded when the libraries are
    scanned.
    """
    import numpy as np
    from threadpoolctl import ThreadpoolController

    pkg = os.path.dirname(os.path.realpath(np.__file__))
    dirs = (pkg + os.sep, pkg + ".libs" + os.sep)
    ctl = ThreadpoolController().select(user_api="blas")
    return ctl.select(filepath=[lc.filepath for lc in ctl.lib_controllers
                                if os.path.realpath(lc.filepath).startswith(dirs)])


def limit_numpy_blas(threads: int) -> Callable[[], None]:
    """Limit the BLAS library of NumPy to ``threads`` threads, process-wide.

    Args:
        threads: thread count (>= 1), or 0 to change nothing.

    Returns:
        A callable that restores the counts found before (does nothing if nothing was
        changed). Call it once.

    Raises:
        ValueError: ``threads`` is negative.

    A NumPy built against a BLAS outside its own installation (a conda or system
    OpenBLAS/MKL) is left alone: limiting that library could slow another framework that
    shares it; the limit is then logged at DEBUG level as not applied.
    """
    if threads < 0:
        raise ValueError(f"sync.blas_threads must be >= 0, got {threads}; 0 keeps the "
                         "library's own setting")
    if threads == 0:
        return _nothing
    mine = _numpy_blas()
    if not mine.lib_controllers:
        logger.debug("NumPy's BLAS lies outside NumPy's installation: its threads are not "
                     "limited (sync.blas_threads=%d)", threads)
        return _nothing
    before = [lc.num_threads for lc in mine.lib_controllers]
    if all(n == threads for n in before):
        return _nothing
    limiter = mine.limit(limits=threads)
    logger.debug("NumPy's BLAS limited from %s to %d threads while HiPress runs", before,
                 threads)
    return limiter.restore_original_limits


def numpy_blas_threads() -> List[int]:
    """Thread counts of the BLAS libraries inside NumPy's installation (for tests, logs)."""
    return [lc.num_threads for lc in _numpy_blas().lib_controllers]


def _nothing() -> None:
    return None
