#!/usr/bin/env bash
# Set up (idempotently) and run the CPU quickstart job, configs/quickstart_cpu.yaml: 4 ranks, a
# Megatron-core trainer on ranks 0-1, SGLang rollout and teacher engines on ranks 2 and 3; 12
# GRPO steps with on-policy distillation on SmolLM2-135M-Instruct. Extra arguments are config
# overrides, e.g. `bash scripts/quickstart.sh algorithm.num_steps=3`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
mkdir -p runs
# The rank map as a table and a picture; the run itself prints the plan's summary.
.venv/bin/relax-launch plan configs/quickstart_cpu.yaml "$@" --picture runs/quickstart-plan.svg \
  > runs/quickstart-plan.txt
.venv/bin/relax-launch run configs/quickstart_cpu.yaml "$@"
