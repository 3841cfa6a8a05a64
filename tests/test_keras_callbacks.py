"""Tests of the Keras callbacks of hipress.tensorflow under real MPI at 1 and 2 ranks.

MetricAverageCallback, LearningRateWarmupCallback and BestModelCheckpoint each run in a
real ``model.fit`` with ``hp.DistributedOptimizer`` (tests/workers/keras_callbacks.py).
One MPI job per world size runs every case (TensorFlow takes seconds to import on each
rank); one pytest test per case reads its ``PASS`` lines.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from mpi_util import check_case, run_mpi

tf = pytest.importorskip("tensorflow", reason="TensorFlow is not installed in this interpreter "
                         "(pip install -e '.[tensorflow]')")

WORKER = Path(__file__).parent / "workers" / "keras_callbacks.py"

JOBS = {
    1: ["metric_average", "metric_average_empty_logs", "lr_warmup", "lr_warmup_momentum",
        "best_checkpoint"],
    2: ["metric_average", "metric_average_empty_logs", "lr_warmup", "lr_warmup_momentum",
        "lr_warmup_errors", "best_checkpoint"],
}

_results: dict = {}


def _job(np_: int):
    if np_ not in _results:
        _results[np_] = run_mpi(np_, WORKER, [",".join(JOBS[np_])], timeout=300,
                                env={"TF_CPP_MIN_LOG_LEVEL": "2"})
    return _results[np_]


pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("np_,case", [pytest.param(n, c, id=f"np{n}-{c}")
                                      for n, cases in JOBS.items() for c in cases])
def test_case(np_, case):
    proc = _job(np_)
    check_case(proc, np_, case)
