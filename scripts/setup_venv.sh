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

# Test extras: the real observability backends the tests run against (tests/support/real_backends.py).
# Prometheus from the Debian package, skipped when one is already on PATH; Arize Phoenix in its own
# venv outside the checkout (scripts/setup_phoenix.sh; its dependencies clash with ours).
if [[ ",$extras," == *",test,"* ]]; then
  if ! command -v prometheus >/dev/null; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus
  fi
  bash scripts/setup_phoenix.sh
fi
