#!/usr/bin/env bash
# The GPU checks in one go, for a machine with a CUDA device (the CI machine has none):
#   1. the prefill benchmark, FlashAttention (sdpa) against our Triton kernels, LLaMA-3-8B shapes, bf16;
#   2. the decode benchmark, likewise;
#   3. the kernels alone under several tile and launch settings (scripts/bench_gpu.py --tune);
#   4. the gpu-marked tests, compiled Triton kernels (TRITON_INTERPRET=0): against the plain kernel on the same GPU,
#      against the CPU reference, no host read inside a layer call, greedy generation against the CPU's tokens.
#     bash scripts/gpu_checks.sh [OUT_DIR]   # default results/bench: gpu_checks.log, gpu_{attention,decode,tune}.{json,md}
# Each step has its own time limit, so one that hangs leaves the others their time; the exit status is the first
# failure's.
# Sending this checkout to a lent GPU machine: the tool copies the tracked working tree, at most 64 MiB, and the run
# store alone is ~250 MB (results/runs, which no GPU check reads). Untrack it for the call, then put it back:
#   git rm -r -q --cached results/runs && echo /results/runs/ >> .git/info/exclude   # before
#   git reset -q -- results/runs && sed -i '\#^/results/runs/$#d' .git/info/exclude   # after (nothing committed)
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-results/bench}
mkdir -p "$out"
log="$out/gpu_checks.log"
: > "$log"
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
status=0
step() {  # step SECONDS NAME COMMAND...
  local limit=$1 name=$2; shift 2
  local t0=$SECONDS
  echo "== $name: $*" | tee -a "$log"
  timeout "$limit" "$@" 2>&1 | tee -a "$log"
  local rc=${PIPESTATUS[0]}
  echo "== $name: exit $rc after $((SECONDS - t0)) s" | tee -a "$log"
  [ "$rc" -ne 0 ] && [ "$status" -eq 0 ] && status=$rc
  return 0
}
{ nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>&1 || true; } | tee -a "$log"
python -c "import torch, triton, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'triton', triton.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())" | tee -a "$log"
step 180 prefill python scripts/bench_attention.py --device cuda --out "$out/gpu_attention"
step 180 decode python scripts/bench_decode.py --device cuda --out "$out/gpu_decode"
step 150 tune python scripts/bench_gpu.py --tune --out "$out/gpu_tune"
step 300 tests python -m pytest -q -m gpu -rs --durations=8 tests/test_triton_kernels.py tests/test_backends.py
exit $status
