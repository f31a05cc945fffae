#!/usr/bin/env bash
# Set up .venv and run the whole check: ruff, then the test suite, then the SGLang stage: a real
# SGLang 0.5.23 on this CPU (its venv is built once and reused from ~/.cache/moespec/sglang-venv,
# or $MOESPEC_SGLANG_VENV) against the tests marked sglang_cpu. MOESPEC_SKIP_SGLANG=1 skips that stage.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_venv.sh test
. .venv/bin/activate
ruff check .
# The real-backend tests fail instead of skipping when Prometheus or Phoenix is missing.
export MOESPEC_REQUIRE_BACKENDS=1
python -m pytest -q "$@"
deactivate
if [ "${MOESPEC_SKIP_SGLANG:-0}" != "1" ]; then
  bash scripts/setup_sglang_cpu.sh
  sglang_python="${MOESPEC_SGLANG_VENV:-$HOME/.cache/moespec/sglang-venv}/bin/python"
  start=$SECONDS
  # MOESPEC_REQUIRE_SGLANG: in CI a missing SGLang is a failure, not a skip.
  MOESPEC_REQUIRE_SGLANG=1 "$sglang_python" -m pytest -q -m sglang_cpu tests/sglang/test_sglang_cpu.py tests/sglang/test_sglang_cpu_eagle3.py tests/sglang/test_sglang_cpu_eagle3_trees.py tests/sglang/test_sglang_cpu_step_pin.py
  echo "sglang stage: $((SECONDS - start)) s"
fi
