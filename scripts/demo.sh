#!/usr/bin/env bash
# Set up .venv and run the main job on the embedded model: server + load + tuner, then a report.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_venv.sh
. .venv/bin/activate
moespec demo "$@"
