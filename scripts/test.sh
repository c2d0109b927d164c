#!/usr/bin/env bash
# Set up (idempotently) and run the default test suite: unit tests plus real end-to-end tests
# (SGLang servers, Megatron-core over torchrun). Extra arguments go to pytest.
#
# With no test selection among the arguments (no existing path, -m or -k), the default suite
# runs in two passes at once: the e2e tests on two pytest workers, each test file on one worker
# (its module fixtures start once), and beside them the unit tests on one worker, whose output
# is printed when they end. A real job spends most of its start-up in one process at a time, so
# the e2e pass alone leaves about half a core of two idle; the unit pass fills it.
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
unit_log="$(mktemp -t relax-unit-tests.XXXXXX)"
unit_pid=""
stop_unit_pass() {  # by its group's PID: the pass and its worker
  if [ -n "$unit_pid" ]; then kill -- "-$unit_pid" 2>/dev/null || true; fi
  rm -f "$unit_log"
}
trap stop_unit_pass EXIT
trap 'exit 130' INT  # run once the foreground e2e pass has ended on the same Ctrl-C
trap 'exit 143' TERM HUP
echo "unit tests: one worker beside the e2e pass; their log $unit_log is printed when they end"
# In a session of their own (so a Ctrl-C reaches the e2e pass only, and the trap stops them);
# no cache writes, which the e2e pass's would overwrite.
setsid .venv/bin/python -m pytest -p no:cacheprovider -n 1 \
  -m "not e2e and not slow and not slurm" "$@" >"$unit_log" 2>&1 &
unit_pid=$!
.venv/bin/python -m pytest -n 2 --dist loadfile -m "e2e and not slow and not slurm" "$@" || status=$?
unit_status=0
wait "$unit_pid" || unit_status=$?
unit_pid=""  # reaped: its PID may be reused
echo "==================== unit tests (ran beside the e2e pass) ===================="
cat "$unit_log"
if [ "$unit_status" -ne 0 ]; then status=$unit_status; fi
exit "$status"
