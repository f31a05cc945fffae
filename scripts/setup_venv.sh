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
# Prometheus and PostgreSQL (the fleet tests start a private cluster: tests/support/real_postgres.py)
# from the Debian packages, each skipped when already installed; Arize Phoenix in its own venv
# outside the checkout (scripts/setup_phoenix.sh; its dependencies clash with ours).
if [[ ",$extras," == *",test,"* ]]; then
  apt_packages=()
  command -v prometheus >/dev/null || apt_packages+=(prometheus)
  { command -v initdb >/dev/null || compgen -G "/usr/lib/postgresql/*/bin/initdb" >/dev/null; } || apt_packages+=(postgresql)
  # docker-compose (Debian's, no Docker engine needed): tests/test_security_deploy.py has its real
  # parser resolve deploy/docker-compose.yml (interpolation, required variables, port bindings).
  command -v docker-compose >/dev/null || apt_packages+=(docker-compose)
  if [ ${#apt_packages[@]} -gt 0 ]; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${apt_packages[@]}"
  fi
  bash scripts/setup_phoenix.sh
fi
