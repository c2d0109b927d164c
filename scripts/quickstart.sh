#!/usr/bin/env bash
# Set up (idempotently) and run the CPU quickstart job, configs/quickstart_cpu.yaml: 4 ranks, a
# Megatron-core trainer on ranks 0-1, SGLang rollout and teacher engines on ranks 2 and 3. Until
# the RL loop lands the job brings everything up, syncs the trainer's weights into the rollout
# engine (weight_version 0) and shuts down cleanly.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
mkdir -p runs
.venv/bin/relax-launch plan configs/quickstart_cpu.yaml --picture runs/quickstart-plan.svg
.venv/bin/relax-launch run configs/quickstart_cpu.yaml
