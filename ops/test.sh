#!/usr/bin/env bash
# The test command: installs what the tests need, then runs them (GPU tests skip without CUDA).
set -euo pipefail
cd "$(dirname "$0")/.."
bash ops/setup.sh test
# Two test processes (DQ_TEST_PROCESSES): the suite mostly waits on servers and worker processes, so two share
# a 2-core machine well; each takes whole modules (--dist loadscope), which keeps a module's shared server and worker
# to one process. DQ_TEST_PROCESSES=0 runs it in this one.
exec "${PYTHON:-python3}" -m pytest -q -p no:cacheprovider -n "${DQ_TEST_PROCESSES:-2}" --dist loadscope "$@"
