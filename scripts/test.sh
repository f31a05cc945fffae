#!/usr/bin/env bash
# Set up .venv and run the whole check: ruff, then the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_venv.sh test
. .venv/bin/activate
ruff check .
python -m pytest -q "$@"
