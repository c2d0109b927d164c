"""A real job whose rollout is a user function holding two-turn conversations with a tool
result between the turns: every conversation is recorded token for token and trained."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_rl_job import assert_calm_console, run_tiny

pytestmark = pytest.mark.e2e


def test_agentic_rollouts_in_a_real_job(tmp_path):
    result = run_tiny(Path(__file__).parent / "agentic_tiny.yaml", f"logging.dir={tmp_path}")
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    steps = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2]
    for s in steps:
        assert s["agent/turns"] == 2.0  # every conversation ran both turns
        assert s["agent/rejected"] == s["agent/failed"] == s["agent/out_of_budget"] == 0
        assert s["samples_invalid"] == 0 and s["train_skipped"] == 0
        # the engine's logprobs of its own tokens are the trainer's (same weights, float32):
        # what the trainer scored is the sequence the engine produced
        assert s["mismatch_kl"] < 1e-3
        assert s["grad_norm"] > 0
    assert_calm_console(result, tmp_path, ranks=2, steps=2)
