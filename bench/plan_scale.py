"""Benchmark: planning a 512-node x 8-rank job with four roles, and the CLI's start-up time.

Prints the median time to validate the config and plan 4,096 ranks (target: well under
100 ms), and ``relax-launch plan --help`` wall time against a bare ``python -c pass`` measured in
the same run (target: under 1 s). Run: ``.venv/bin/python bench/plan_scale.py``.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from timing import median_seconds

from relax_launch.config import build_config
from relax_launch.placement import plan

RAW = {
    "cluster": {"nnodes": 512, "nproc_per_node": 8},
    "placement": {"mode": "decoupled"},
    "trainer": {"model": "/models/Qwen3-8B", "ranks": 1536, "tp_size": 8, "pp_size": 3},
    "rollout": {"ranks": 1024, "tp_size": 8},
    "genrm": {"model": "/models/Qwen3-8B", "ranks": 512, "tp_size": 8},
    "teacher": {"model": "/models/Qwen3-32B", "ranks": 1024, "tp_size": 16},
    "algorithm": {"n_samples_per_prompt": 8, "distill_coef": 0.1},
    "data": {"prompts_per_step": 512},
    "reward": {"sources": [{"name": "judge", "genrm": True}]},
}


def plan_once() -> None:
    placement = plan(build_config(RAW))
    placement.stable_hash()
    assert placement.world_size == 4096


def main() -> None:
    plan_s = median_seconds(plan_once, 20)
    cli = str(Path(sys.executable).with_name("relax-launch"))
    help_s = median_seconds(
        lambda: subprocess.run([cli, "plan", "--help"], check=True, capture_output=True), 5
    )
    bare_s = median_seconds(lambda: subprocess.run([sys.executable, "-c", "pass"], check=True), 5)
    print(
        f"plan + validate + hash, 512 nodes x 8 ranks, 4 roles: {plan_s * 1000:.1f} ms "
        f"(target < 100 ms: {plan_s / 0.1:.2f} of target)"
    )
    print(
        f"relax-launch plan --help: {help_s * 1000:.0f} ms; bare python start: "
        f"{bare_s * 1000:.0f} ms; ratio {help_s / bare_s:.1f}x (target < 1000 ms)"
    )


if __name__ == "__main__":
    main()
