#!/usr/bin/env bash
# The GPU check, in one go for a machine lent for minutes (one H200, 16 cores; about 5 minutes at the
# default sizes, at most 9.5). Prepare here first with `bash benchmarks/gpu_prepare.sh` and carry what it
# writes: the device call names [".whl", ".devcheck"] in carry.
#   1. installs what the machine's image lacks, from wheels carried in .whl/ (pydantic and its needs), and stops
#      at once if the project still cannot be imported;
#   2. runs the kernel tests and the serving path's CUDA-against-CPU test on CUDA (8 workers; the CPU kernels'
#      tests run there too, on that host's CPU, whose AVX-512 path this AVX2 box cannot run; left out: the
#      cross-compile for sm_90, the rebuilds without AVX-512 or AVX2 and the build-cache test, which need no GPU);
#   3. with a saved table, profiles one call of the fused pass (benchmarks.profile_pass: 1M and 10M ads, fp16,
#      B = 1 and 64): where the fixed cost per call the H200 showed goes (request side on the host, device
#      busy, the rest);
#   4. runs the GPU benchmark (benchmarks.kernels --device cuda) on the 1M-ad world tiled TILES times
#      (default 1 10), from a table saved by `python -m benchmarks.kernels --save-table .devcheck/table-1m.pt`
#      when there is one (synthesizing 1M ads takes about 2 minutes), else synthesized there;
#   5. an A/B of the threshold scan's skip below tau: 10M ads, fp16, B = 1 and 64, with the skip off
#      (--no-skip; step 4 ran it on), printed only;
#   6. the first request of each shape in a fresh process with an empty Triton cache, as a new pod has, without
#      and after Retriever.warm_up (benchmarks.cold_start: the JIT a shard replica's first requests would wait
#      for), printed only.
# Results: stdout, the logs, and the benchmark's section in docs/benchmarks.md (all copied to $OUT when set, the
# section as soon as step 4 wrote it).
#   bash benchmarks/gpu_check.sh [TILES...]
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD"
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH="/tmp/site:$PWD"
fi
python3 -c "import andromeda_core.index" || { echo "the project cannot be imported here: run benchmarks/gpu_prepare.sh and carry .whl"; exit 1; }
logs="${OUT:-/tmp}"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.cuda.is_available())"
timeout 150 python3 -m pytest tests/kernels tests/unit/test_retriever_cuda.py -q -p no:cacheprovider -n 8 \
    -W ignore --durations=10 -k "not compile_for_sm90 and not without_avx512_or_avx2 and not read_only" 2>&1 \
    | tee "$logs/tests.log" | tail -40
tiles=("$@")
if [ ${#tiles[@]} -eq 0 ]; then tiles=(1 10); fi
table=()
if [ -f .devcheck/table-1m.pt ]; then table=(--table .devcheck/table-1m.pt); fi
if [ ${#table[@]} -gt 0 ]; then  # without a saved table it would spend its time synthesizing one
    timeout 45 python3 -m benchmarks.profile_pass --device cuda "${table[@]}" --tile 1 10 --batch 1 64 2>&1 \
        | grep -v "it/s\|B/s\]" | tee "$logs/profile.log"
fi
timeout 300 python3 -m benchmarks.kernels --device cuda --ads 1000000 "${table[@]}" --tile "${tiles[@]}" \
    --batch 1 4 16 64 --threads 16 --repeats 10 --peer-pairs 64e6 2>&1 | grep -v "it/s\|B/s\]" | tee "$logs/bench.log"
if [ -n "${OUT:-}" ]; then cp docs/benchmarks.md "$OUT/"; fi
timeout 60 python3 -m benchmarks.kernels --device cuda --ads 1000000 "${table[@]}" --tile 10 --batch 1 64 \
    --storage fp16 --threads 16 --repeats 5 --peer-pairs 0 --no-skip 2>&1 | grep -v "it/s\|B/s\]" | tee "$logs/no-skip.log"
timeout 120 python3 -m benchmarks.cold_start --device cuda 2>&1 | grep -v "it/s\|B/s\]" | tee "$logs/cold-start.log"
