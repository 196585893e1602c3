#!/usr/bin/env bash
# The GPU check, in one go for a machine lent for minutes (an H100 or H200, 16 cores; at most 9 minutes,
# GPU_CHECK_SECONDS). Prepare here first with `bash benchmarks/gpu_prepare.sh` and carry what it
# writes: the device call names [".whl", ".devcheck"] in carry.
#   1. installs what the machine's image lacks, from wheels carried in .whl/ (pydantic and its needs), and stops
#      at once if the project still cannot be imported;
#   2. runs the kernel tests and the serving path's CUDA-against-CPU test on CUDA (8 workers; the CPU kernels'
#      tests run there too, on that host's CPU, whose AVX-512 path this AVX2 box cannot run; left out: the
#      cross-compile for sm_90, the rebuilds without AVX-512 or AVX2 and the build-cache test, which need no GPU);
#   3. runs the GPU benchmark (benchmarks.kernels --device cuda) on the 1M-ad world tiled TILES times
#      (default 1 10), from a table saved by `python -m benchmarks.kernels --save-table .devcheck/table-1m.pt`
#      when there is one (synthesizing 1M ads takes about 2 minutes), else synthesized there;
#   4. the first request of each shape in a fresh process with an empty Triton cache, as a new pod has, without
#      and after Retriever.warm_up (benchmarks.cold_start: the JIT a shard replica's first requests would wait
#      for), printed only;
#   5. with a saved table, A/B runs, printed only (ab.log): the threshold scan's skip below tau off (--no-skip; 10M ads,
#      fp16, B = 1 and 64), and the matched-rows load for batches of up to 0 and up to 4 requests
#      (--matched-rows-max-b; 10M and 100M ads, fp16, B = 1, 2, 3 and 4), beside step 3's rows;
#   6. with a saved table, profiles one call of the fused pass (benchmarks.profile_pass: 1M and 10M ads, fp16,
#      B = 1 and 64): where the fixed cost per call the H200 showed goes (request side on the host, device
#      busy, the rest);
# The steps run in that order (the most needed first) within GPU_CHECK_SECONDS (default 540: a device call may run
# 600), each under its own time cap and the time left; a step without a minute left is skipped and a step cut short
# at its cap says so, both in its log. The machine, versions and each step's time go to $logs/check.log.
# Results (7 files, within what a device call brings back): stdout, the logs, and the benchmark's section in
# docs/benchmarks.md (all copied to $OUT when set, the
# section as soon as step 3 wrote it; step 3 rewrites it after each corpus size).
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
budget=${GPU_CHECK_SECONDS:-540}
if ! [[ "$budget" =~ ^[1-9][0-9]*$ ]]; then
    echo "GPU_CHECK_SECONDS: a whole number of seconds, got '$budget'"
    exit 2
fi
export TQDM_DISABLE=1  # no progress bars in the logs
step() {  # step CAP LOG COMMAND...: runs COMMAND under min(CAP, the time left), its output to the screen and $logs/LOG
    local cap=$1 log=$2 left=$((budget - SECONDS)) began=$SECONDS; shift 2
    if [ "$left" -lt 60 ]; then
        echo "skipped for time ($left s left): $*" | tee "$logs/$log" >>"$logs/check.log"
        return
    fi
    local limit=$((cap < left ? cap : left))
    echo "== $* (at most $limit s)" | tee -a "$logs/check.log"
    timeout -k 10 "$limit" "$@" 2>&1 | tee "$logs/$log" | tail -60
    local status=${PIPESTATUS[0]}
    if [ "$status" -eq 124 ] || [ "$status" -eq 137 ]; then
        echo "cut short at its cap of $limit s" | tee -a "$logs/$log"
    fi
    echo "   exit $status after $((SECONDS - began)) s" | tee -a "$logs/check.log"
}
{ nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__,
                                        'cuda', torch.cuda.is_available())"
} 2>&1 | tee "$logs/check.log"
step 150 tests.log python3 -m pytest tests/kernels tests/unit/test_retriever_cuda.py -o addopts="" -q \
    -p no:cacheprovider -n 8 -W ignore --durations=10 \
    -k "not compile_for_sm90 and not without_avx512_or_avx2 and not read_only"
tiles=("$@")
if [ ${#tiles[@]} -eq 0 ]; then tiles=(1 10); fi
table=()
if [ -f .devcheck/table-1m.pt ]; then table=(--table .devcheck/table-1m.pt); fi
step 280 bench.log python3 -m benchmarks.kernels --device cuda --ads 1000000 "${table[@]}" --tile "${tiles[@]}" \
    --batch 1 4 16 64 --threads 16 --repeats 10 --peer-pairs 64e6
if [ -n "${OUT:-}" ] && grep -q "ads fp16 B=" "$logs/bench.log"; then cp docs/benchmarks.md "$OUT/"; fi  # a size done
step 120 cold-start.log python3 -m benchmarks.cold_start --device cuda
if [ ${#table[@]} -gt 0 ]; then  # without a saved table each would spend its time synthesizing one
    ab=(python3 -m benchmarks.kernels --device cuda --ads 1000000 "${table[@]}" --storage fp16 --threads 16
        --peer-pairs 0)
    step 150 ab.log bash -c '"$@" --tile 10 --batch 1 64 --repeats 5 --no-skip
        for most in 0 4; do
            "$@" --tile 10 100 --batch 1 2 3 4 --repeats 10 --matched-rows-max-b "$most"
        done' ab "${ab[@]}"
    step 45 profile.log python3 -m benchmarks.profile_pass --device cuda "${table[@]}" --tile 1 10 --batch 1 64
fi
echo "gpu_check done in $SECONDS s" | tee -a "$logs/check.log"
