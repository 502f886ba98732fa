#!/usr/bin/env bash
# The checks that need a CUDA device, as one bounded script (run on a GPU host from the repository root):
# the GPU halves of the kernel tests, the model on CUDA, the HBM tier through a real node, the kernels' and
# the HBM tier's benchmarks. Missing Python packages may come as wheels in .whl/ (installed into /tmp/site).
# Writes logs and benchmark JSON under ${OUT:-gpu-out}.
set -uo pipefail
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "gpu_check: installing .whl/ failed" >&2; exit 1; }
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version,pcie.link.gen.max,pcie.link.width.max --format=csv \
  | tee "$OUT/gpu.txt"
python3 -c "import torch, cupy; print('torch', torch.__version__, 'cupy', cupy.__version__)" | tee -a "$OUT/gpu.txt"
rc=0
timeout 240 python3 -m pytest tests/gpu tests/kernels tests/workers/test_model_cuda.py -q -rs -p no:cacheprovider \
  --timeout 200 2>&1 | tee "$OUT/gpu_tests.log" || rc=1
timeout 120 python3 benchmarks/kernel_bench.py --device cuda --runs 3 --out "$OUT" 2>&1 | tee "$OUT/kernel_bench.log" || rc=1
timeout 120 python3 benchmarks/hbm_bench.py --pages 128 --runs 3 --out "$OUT" 2>&1 | tee "$OUT/hbm_bench.log" || rc=1
exit $rc
