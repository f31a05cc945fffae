#!/usr/bin/env bash
# Build (once) the virtual environment holding Arize Phoenix, the real OTLP trace backend that
# tests/telemetry/test_phoenix_traces.py sends spans to. It lives outside the checkout and apart from .venv
# because Phoenix pins its own versions of packages moespec also uses (protobuf, grpcio,
# opentelemetry); the tests only start its server as a separate process on loopback.
# Usage: scripts/setup_phoenix.sh   (MOESPEC_PHOENIX_VENV overrides where the environment goes)
set -euo pipefail
venv="${MOESPEC_PHOENIX_VENV:-$HOME/.cache/moespec/phoenix-venv}"
mkdir -p "$(dirname "$venv")"
exec 9>"$venv.lock"
flock 9  # two checkouts setting up at once build it once
if [ -x "$venv/bin/python" ] && "$venv/bin/python" -c "import phoenix.server.main" 2>/dev/null; then
  exit 0  # already built
fi
rm -rf "$venv"  # a half-built one from an interrupted run
python3 -m venv "$venv"
"$venv/bin/python" -m pip install -q --upgrade pip
"$venv/bin/python" -m pip install -q arize-phoenix
"$venv/bin/python" -c "import phoenix.server.main"
