#!/usr/bin/env bash
# Verify-cost profiles on a CUDA GPU: plain torch grouped expert products in bf16, CUDA-event timing,
# for the shipped geometry and three public ones (random weights; no network, no SGLang: torch and numpy
# only, matplotlib if present). Sized for one call under ~8 minutes on an 80 GB GPU.
#   scripts/gpu_verify_cost.sh
# Env: PYTHON (default python3); OUT: folder for the profiles (default reports/bench/verify-cost-gpu).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
DEST=${OUT:-reports/bench/verify-cost-gpu}

if ! "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  echo "SKIP: no CUDA GPU visible to torch"; exit 0
fi
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
mkdir -p "$DEST"
run() {  # geometry layers rounds; each geometry bounded so one slow shape cannot eat the others' time
  timeout 170 "$PY" -m service.bench.verify_cost --device cuda --geometry "$1" --layers "$2" --rounds "$3" \
    --repeats 10 --unions 5 --out "$DEST" 2>&1 | tee "$DEST/verify-cost-$1.txt" || echo "FAILED or timed out: $1"
}
run qwen3-30b-a3b 8 5
run ling-mini-2.0 8 5
run target 4 5
run deepseek-v3 2 3
ls -l "$DEST"
