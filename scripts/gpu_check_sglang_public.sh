#!/usr/bin/env bash
# GPU check of the SGLang backend on a real public MoE model whose weights are already local
# (nothing is downloaded): e.g. Qwen1.5-MoE-A2.7B, Qwen3-30B-A3B, a Ling/BailingMoeV2 checkpoint.
#   scripts/gpu_check_sglang_public.sh MODEL_DIR [DRAFT_DIR] [extra sglang_gpu_check.py args]
# Without DRAFT_DIR only the n-gram drafter runs (SGLang's NGRAM needs no draft model).
# Skips cleanly (exit 0, "SKIP: ...") without a GPU or without the weights. Sized for 10 minutes:
# 3 engine starts (plain, ngram k=4, and model k=3 when a draft is given), 4 requests x 64 tokens.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
MODEL=${1:-}
DRAFT=${2:-}
shift $(( $# > 2 ? 2 : $# ))

if [[ -z "$MODEL" || ! -f "$MODEL/config.json" ]] || ! ls "$MODEL"/*.safetensors >/dev/null 2>&1; then
  echo "SKIP: no local MoE weights at '${MODEL}' (give a directory with config.json and *.safetensors)"; exit 0
fi
if ! "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null \
   && ! command -v nvidia-smi >/dev/null; then
  echo "SKIP: no CUDA GPU on this machine"; exit 0
fi
if [[ "${MOESPEC_SKIP_INSTALL:-0}" != 1 ]]; then
  "$PY" -m pip install --quiet ".[sglang]"
fi

args=(--model-path "$MODEL" --requests 4 --max-new-tokens 64 --ngram-length 4)
if [[ -n "$DRAFT" ]]; then
  args+=(--draft-model-path "$DRAFT" --speculative-algorithm STANDALONE --lengths 0,3)
else
  args+=(--speculative-algorithm NGRAM --lengths 0)
fi
[[ -n "${OUT:-}" ]] && args+=(--out "$OUT/sglang_gpu_check_public.json")
exec "$PY" scripts/sglang_gpu_check.py "${args[@]}" "$@"
