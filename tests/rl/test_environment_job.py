"""A real job trained on an environment (tests/rl/tiny_env_tool.py, verifiers' contract): its
dataset is the prompts, its rollout holds two-turn conversations in a worker process that calls
the job back over HTTP, its rubric is the reward; every conversation is recorded token for token,
so the trainer's logprobs of the engine's tokens are the engine's own."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_rl_job import assert_calm_console, run_tiny

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_an_environment_trains_in_a_real_job(tmp_path):
    result = run_tiny(Path(__file__).parent / "environment_tiny.yaml", f"logging.dir={tmp_path}")
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    steps = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2]
    for s in steps:
        assert s["agent/turns"] == 2.0  # every conversation: a reply, the nudge, a reply
        assert s["agent/rejected"] == s["agent/failed"] == s["agent/out_of_budget"] == 0
        assert s["samples_invalid"] == 0 and s["reward/rubric/failed"] == 0
        assert 0 < s["reward/rubric"] <= 1.5  # the rubric's checksum of the random replies
        # same weights, float32: the trainer scored exactly the tokens the engine produced
        assert s["mismatch_kl"] < 1e-3 and s["logprob_diff_max"] < 1e-3
        assert s["grad_norm"] > 0
    assert_calm_console(result, tmp_path, ranks=2, steps=2)
    assert (tmp_path / "environment.log").exists()  # the worker's own output, off the console
