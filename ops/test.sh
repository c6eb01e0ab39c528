#!/usr/bin/env bash
# The test command: installs what the tests need, then runs them (GPU tests skip without CUDA).
set -euo pipefail
cd "$(dirname "$0")/.."
bash ops/setup.sh test
exec "${PYTHON:-python3}" -m pytest -q -p no:cacheprovider "$@"
