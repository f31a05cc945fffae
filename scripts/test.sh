#!/usr/bin/env bash
# Set up .venv and run the whole check: ruff, then the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_venv.sh test
. .venv/bin/activate
ruff check .
# The real-backend tests fail instead of skipping when Prometheus or Phoenix is missing.
export MOESPEC_REQUIRE_BACKENDS=1
python -m pytest -q "$@"
