#!/usr/bin/env bash
# The CUDA checks, as one script for a lent GPU machine (the `device` tool's `run`):
#   1. tests/ops/test_cuda_backend.py: the CPU double's tests, then the same cases on torch's own
#      kernels on the GPU (test_torchs_kernels_on_a_gpu_equal_the_oracle);
#   2. mcore-flash bench-cuda --check: each kernel's error against float64, then the
#      TFLOP/s table of ours vs torch SDPA's backends at 8K-32K (docs/benchmarks.md, "GPU").
# Uses the machine's python3 with torch (no megatron-core needed); logs go to $OUT when set.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu-check}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"
$PY -c "import torch; print('torch', torch.__version__, 'cuDNN', torch.backends.cudnn.version())" | tee -a "$OUT/gpu.txt"
$PY -m pytest -q -p no:cacheprovider tests/ops/test_cuda_backend.py 2>&1 | tee "$OUT/tests.txt"
$PY -m mcore_flash.benchmarks.cuda_kernels --check "$@" 2>"$OUT/bench-progress.txt" | tee "$OUT/bench-cuda.md"
