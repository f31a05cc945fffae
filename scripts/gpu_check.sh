#!/usr/bin/env bash
# GPU check of the SGLang backend on the shipped pair: Qwen2-MoE target + dense Qwen2 draft
# (same tokenizer), STANDALONE speculative decoding, through the real gRPC server.
#   scripts/gpu_check.sh [extra sglang_gpu_check.py args]
# Then the plugin's statistics under CUDA graphs (scripts/gpu_check_tap.py) and 32 concurrent clients
# through the backend with statistics on and off beside SGLang alone (moespec bench sglang-batching).
# Env: MOESPEC_SKIP_INSTALL=1 skips `pip install .[sglang]` (already installed);
#      PYTHON picks the interpreter (default python3). Figures go to $OUT/sglang_gpu_check.json
#      when $OUT is set. Sized for one 10-minute run: 4 engine starts (k=0, 2, 4, ngram 4) of a
#      tiny model, 8 requests x 64 tokens each.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

if ! "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null \
   && ! command -v nvidia-smi >/dev/null; then
  echo "SKIP: no CUDA GPU on this machine"; exit 0
fi
if [[ "${MOESPEC_SKIP_INSTALL:-0}" != 1 ]]; then
  "$PY" -m pip install --quiet ".[sglang]"
fi
"$PY" -c 'import sglang; print("sglang", sglang.__version__)'
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true

for f in service/models/target/model.safetensors service/models/draft/model.safetensors; do
  [[ -s $f ]] || { echo "FAIL: $f is missing (the shipped models are not in this checkout)"; exit 1; }
done

# The plugin's statistics under CUDA-graph capture and replay against eager (torch only).
"$PY" scripts/gpu_check_tap.py ${OUT:+--out "$OUT/gpu_check_tap.json"}
# 32 concurrent clients with CUDA graphs on (SGLang's defaults): SGLang alone, moespec with the
# plugin's statistics, and without them.
"$PY" -m service.cli bench sglang-batching --device cuda --clients 32 --rounds 1 \
  --out "${OUT:-reports}/sglang-batching"

out=()
[[ -n "${OUT:-}" ]] && out=(--out "$OUT/sglang_gpu_check.json")
exec "$PY" scripts/sglang_gpu_check.py \
  --model-path service/models/target --draft-model-path service/models/draft \
  --speculative-algorithm STANDALONE --lengths 0,2,4 --ngram-length 4 \
  --requests 8 --max-new-tokens 64 \
  --serve-arg=--sglang-mem-fraction=0.3 "${out[@]}" "$@"
