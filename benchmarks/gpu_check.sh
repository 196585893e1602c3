#!/usr/bin/env bash
# The GPU check, in one go for a machine lent for minutes (budget: 8 minutes on one H200, 16 cores):
#   1. installs what the machine's image lacks, from wheels carried in .whl/ (pydantic and its needs);
#   2. runs the kernel tests on CUDA (every case of tests/kernels on the GPU, plus the realistic-size ones);
#   3. runs the GPU benchmark (benchmarks.kernels --device cuda) on a 1M-ad world tiled to 10M and 100M.
# Results: stdout, and the benchmark's section in docs/benchmarks.md (copied to $OUT when set).
#   bash benchmarks/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH="/tmp/site:$PWD"
else
    export PYTHONPATH="$PWD"
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.cuda.is_available())"
timeout 180 python3 -m pytest tests/kernels -p no:warnings -x -q -p no:cacheprovider 2>&1 | tail -15
timeout 420 python3 -m benchmarks.kernels --device cuda --ads 1000000 --tile 1 10 100 --batch 1 4 16 64 \
    --threads 16 --repeats 20 --peer-pairs 64e6
if [ -n "${OUT:-}" ]; then cp docs/benchmarks.md "$OUT/"; fi
