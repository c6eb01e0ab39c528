#!/usr/bin/env bash
# The test command: installs what the tests need, then runs them (GPU tests skip without CUDA).
set -euo pipefail
cd "$(dirname "$0")/.."
bash ops/setup.sh test
# Three test processes (DQ_TEST_PROCESSES): the suite mostly waits on servers, worker processes and their timers
# (two processes kept a 2-core machine about half busy: 106% CPU; three, 144%, the whole run 867 -> 655 s); each
# takes whole modules (--dist loadscope), which keeps a module's shared server and worker to one process.
# DQ_TEST_PROCESSES=0 runs it in this one.
exec "${PYTHON:-python3}" -m pytest -q -p no:cacheprovider -n "${DQ_TEST_PROCESSES:-3}" --dist loadscope "$@"
