#!/usr/bin/env bash
# Set up (idempotently) and run the CPU quickstart job, configs/quickstart_cpu.yaml.
# Today this validates and plans the job, builds its model, and starts the torchrun entry point
# on 4 ranks, each of which plans the job and reports its roles.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
mkdir -p runs
.venv/bin/relax-launch plan configs/quickstart_cpu.yaml --picture runs/quickstart-plan.svg
.venv/bin/python -c "from relax_launch.models.build import ensure_model as m; print('model:', m('builtin:smollm2-135m-instruct'))"
.venv/bin/torchrun --nproc-per-node 4 launch.py configs/quickstart_cpu.yaml
