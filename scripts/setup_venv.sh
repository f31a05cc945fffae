#!/usr/bin/env bash
# Create .venv with the CPU build of torch first (an unpinned torch would pull a multi-GB CUDA
# build), then the project with the given extras. Usage: scripts/setup_venv.sh [EXTRAS]
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
[ -x .venv/bin/python ] || python3 -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
python -m pip install -q torch==2.13.0
if [ -n "$extras" ]; then
  python -m pip install -q -e ".[$extras]"
else
  python -m pip install -q -e .
fi
