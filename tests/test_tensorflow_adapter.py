"""Tests of the TensorFlow adapter (hipress.tensorflow) under real MPI at 2 and 3 ranks.

The behaviour cases shared by every adapter (tests/behaviour_suite.py) run through
``hp.DistributedOptimizer`` both eagerly (``@eager``) and inside ``tf.function``
(``@graph``, the ``tf.py_function`` bridge that ``model.fit`` uses); the TensorFlow-specific
cases (DistributedGradientTape, IndexedSlices, model.fit, collectives, errors) live in
tests/workers/tf_adapter.py. One MPI job per world size runs every case (TensorFlow takes
seconds to import on each rank); one pytest test per case reads its ``PASS`` lines.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from mpi_util import check_case, rank_lines, run_mpi

tf = pytest.importorskip("tensorflow", reason="TensorFlow is not installed in this interpreter "
                         "(pip install -e '.[tensorflow]')")

WORKER = Path(__file__).parent / "workers" / "tf_adapter.py"
ROOT = Path(__file__).resolve().parent.parent

SUITE_2 = ["identity_exact", "sum_op", "unused_zero_filled", "accumulation", "checkpoint",
           "identical_every_codec"]
#: behaviour-suite cases of "correct by default" (tests/behaviour_suite.py), all adapters
SUITE_13 = ["direct_collectives_exact", "explicit_codec_every_tensor",
            "warns_when_nothing_compressed", "nonfinite_passthrough", "nonfinite_accumulated"]
#: behaviour-suite cases of Horovod's collectives (tests/behaviour_suite.py), all adapters
SUITE_14 = ["allgather_rows", "alltoall_splits", "reducescatter_ops", "grouped_allreduce_order",
            "ops_and_int_dtypes", "join_uneven", "host_layout", "horovod_args_refused"]
JOBS = {
    1: [f"{c}@graph" for c in SUITE_14],
    2: [f"{c}@graph" for c in SUITE_2]
    + ["identity_exact@eager", "unused_zero_filled@eager", "accumulation@eager",
       "checkpoint@eager", "tape_none_and_structure", "tape_unnamed_variables",
       "indexed_slices", "indexed_slices_accumulated", "model_fit", "collectives", "errors"]
    + [f"{c}@graph" for c in SUITE_13] + ["direct_collectives_exact@eager",
                                          "nonfinite_passthrough@eager"]
    + [f"{c}@{m}" for c in SUITE_14 for m in ("graph", "eager")],
    3: ["identity_exact@graph", "identity_exact@eager", "unused_zero_filled@graph",
        "accumulation@graph", "checkpoint@graph", "tape_none_and_structure", "indexed_slices"]
    + [f"{c}@graph" for c in SUITE_13 + SUITE_14],
}

_results: dict = {}


def _job(np_: int):
    if np_ not in _results:
        _results[np_] = run_mpi(np_, WORKER, [",".join(JOBS[np_])], timeout=240,
                                env={"TF_CPP_MIN_LOG_LEVEL": "2"})
    return _results[np_]


def _check(np_: int, case: str) -> str:
    proc = _job(np_)
    return check_case(proc, np_, case)


pytestmark = pytest.mark.mpi

PARAMS = [
    pytest.param(np_, c, id=f"np{np_}-{c}")
    for np_, cases in JOBS.items() for c in cases
]


@pytest.mark.parametrize("np_,case", PARAMS)
def test_case(np_, case):
    _check(np_, case)


# ------------------------------------------------------------- local (no MPI) helpers
def test_conversion_zero_copy_and_alignment():
    import numpy as np

    from hipress.tensorflow.convert import TF_ALIGN_BYTES, aligned_copy, from_array, to_array

    t = tf.random.normal([1000])
    a = to_array(t)
    assert a.ctypes.data == to_array(t).ctypes.data  # the tensor's own buffer
    assert np.array_equal(a, t.numpy()) and not a.flags.writeable
    bf = to_array(tf.constant([1.5, -2.0], dtype=tf.bfloat16))
    assert bf.dtype.name == "bfloat16" and np.array_equal(bf.astype(np.float32), [1.5, -2.0])
    # an aligned writable array is shared; a misaligned one is copied to an aligned buffer
    base = np.arange(2000, dtype=np.float32)
    aligned = aligned_copy(base)
    assert aligned.ctypes.data % TF_ALIGN_BYTES == 0
    shared = from_array(aligned)
    assert to_array(shared).ctypes.data == aligned.ctypes.data
    off = base[1:]  # 4 bytes off any 64-byte boundary
    copied = from_array(off)
    assert to_array(copied).ctypes.data % TF_ALIGN_BYTES == 0
    assert np.array_equal(copied.numpy(), off) and float(tf.reduce_sum(copied * 2.0)) > 0
    assert from_array(np.float64(2.5) * np.ones(3), dtype=tf.float32).dtype == tf.float32
    with pytest.raises(TypeError, match="sparse_as_dense"):
        to_array(tf.IndexedSlices(tf.ones([1, 2]), tf.constant([0]), tf.constant([3, 2])))


# ------------------------------------------------------------------------- examples
def test_train_digits_example_learns_with_config_compression():
    """The TF main job: digits, compression from configs/digits-tf.yaml, 2 ranks, 3 epochs."""
    config = ROOT / "configs" / "digits-tf.yaml"
    proc = run_mpi(2, ROOT / "examples" / "tensorflow" / "train_digits.py",
                   ["--epochs", "3", "--no-progress"], timeout=240,
                   env={"HIPRESS_CONFIG": str(config), "TF_CPP_MIN_LOG_LEVEL": "2"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    epochs = re.findall(r"^epoch (\d)/3 loss ([\d.]+) test_acc ([\d.]+)%$", proc.stdout, re.M)
    assert [e[0] for e in epochs] == ["1", "2", "3"], proc.stdout
    assert float(epochs[-1][1]) < float(epochs[0][1])
    assert float(epochs[-1][2]) >= 88.0, epochs
    final = rank_lines(proc.stdout, "final test_acc")
    assert len(final) == 1, proc.stdout
    assert "fc1/kernel=onebit" in final[0] and "fc1/bias=none" in final[0], final[0]
