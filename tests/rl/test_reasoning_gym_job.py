"""A real job on two reasoning-gym tasks (tests/rl/reasoning_gym_tiny.yaml): both reward
sources score in their worker processes every step, the evaluation reports pass@k per task,
and no scoring worker outlives the job."""

from __future__ import annotations

import json
from pathlib import Path

import psutil
import pytest
from test_rl_job import run_tiny

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_a_job_on_reasoning_gym_tasks_with_both_rewards(tmp_path):
    config = Path(__file__).parent / "reasoning_gym_tiny.yaml"
    result = run_tiny(config, f"logging.dir={tmp_path}")
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    steps = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2]
    for s in steps:
        for name in ("task", "math"):
            assert 0.0 <= s[f"reward/{name}"] <= 1.0
            assert s[f"reward/{name}/failed"] == 0 and s[f"reward/{name}/timeouts"] == 0
        assert s["samples_invalid"] == 0
    last = steps[-1]
    for task in ("chain_sum", "basic_arithmetic"):
        assert 0.0 <= last[f"eval/{task}/pass@1"] <= last[f"eval/{task}/pass@2"] <= 1.0
    assert last["eval/prompts"] == 4
    # a worker is `python -m relax_launch.rl.reward_worker PARENT_PID`: one whose parent (the
    # job's rank 0) is gone outlived the job (other tests' workers have live parents)
    orphans = [
        p.pid
        for p in psutil.process_iter(["cmdline"])
        if (cmd := p.info["cmdline"] or [])[-2:-1] == ["relax_launch.rl.reward_worker"]
        and not psutil.pid_exists(int(cmd[-1]))
    ]
    assert not orphans, f"scoring workers outlived the job: {orphans}"
