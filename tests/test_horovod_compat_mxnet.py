"""Horovod API conventions (issue #14) in the MXNet adapter, under real MPI at 2 ranks.

``hp.Compression`` attributes, ``gradient_predivide_factor`` and refused Horovod arguments
on ``hp.DistributedTrainer`` (tests/workers/horovod_compat_mxnet.py). MXNet 1.9 imports
only with NumPy < 1.24, so this runs in the MXNet virtualenv (``make test-mxnet``) and
skips in the main one; the framework-free parts are in tests/test_horovod_compat.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from mpi_util import check_case, run_mpi

mx = pytest.importorskip("mxnet", reason="MXNet is not importable in this interpreter; it "
                         "lives in its own virtualenv (make venv-mxnet; make test-mxnet)")

WORKER = Path(__file__).parent / "workers" / "horovod_compat_mxnet.py"
CASES = ["compression_fp16", "predivide_trainer", "predivide_errors", "unsupported_arguments"]

_results: dict = {}


def _job():
    if "job" not in _results:
        _results["job"] = run_mpi(2, WORKER, [",".join(CASES)], timeout=240)
    return _results["job"]


@pytest.mark.mpi
@pytest.mark.parametrize("case", CASES)
def test_mxnet_under_mpi(case):
    check_case(_job(), 2, case)


def test_exports():
    import hipress.mxnet as hp

    assert hp.Compression.fp16 == "fp16" and hp.Adasum == "adasum"
