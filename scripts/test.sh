#!/usr/bin/env bash
# Set up (idempotently) and run the default test suite: unit tests plus real end-to-end tests
# (SGLang servers, Megatron-core over torchrun). Extra arguments go to pytest.
#
# With no test selection among the arguments (no existing path, -m or -k), the default suite
# runs in two passes: the unit tests on two pytest workers, then the e2e tests on two workers,
# each test file on one worker (its module fixtures start once). A real job spends most of its
# start-up in one process at a time, so one job alone keeps about one core of two busy.
# Either pass failing fails the run; both always run.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
for arg in "$@"; do
  case "$arg" in
    -m | -k | -m?* | -k?*) exec .venv/bin/python -m pytest "$@" ;;
  esac
  if [ -e "${arg%%::*}" ]; then exec .venv/bin/python -m pytest "$@"; fi  # a path
done
status=0
.venv/bin/python -m pytest -n 2 -m "not e2e and not slow and not slurm" "$@" || status=$?
.venv/bin/python -m pytest -n 2 --dist loadfile -m "e2e and not slow and not slurm" "$@" || status=$?
exit "$status"
