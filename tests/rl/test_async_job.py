"""Fully asynchronous training in a real job: the rollout engine generates all the time, a weight
sync interrupts what is in flight and it continues with the new weights; every trained sample is
at most max_staleness versions old, and the metrics count both."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_rl_job import assert_calm_console, run_tiny

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize(
    "overrides",
    # responses alone are slow: conversations interrupt and resume the same generations
    [pytest.param([], marks=pytest.mark.slow), ["rollout.function=tiny_agent:two_long_turns"]],
    ids=["responses", "conversations"],
)
def test_fully_async_job_interrupts_and_resumes_generations(tmp_path, overrides):
    config = Path(__file__).parent / "async_tiny.yaml"
    result = run_tiny(config, f"logging.dir={tmp_path}", *overrides)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    steps = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2, 3, 4, 5, 6]
    for s in steps:
        by_age = [s[f"async/samples_staleness_{age}"] for age in range(3)]
        assert sum(by_age) == 8 and s["samples_stale"] == 0  # 2 prompts x 4, none too old
        assert s["staleness"] <= 2 and s["train_skipped"] == 0
        assert 0 < s["tokens_per_s"] < 1e5  # the engines' generation rate, not a wait's
    # the producer runs ahead of the trainer: later steps train on older weights' samples
    assert steps[0]["staleness"] == 0 and max(s["staleness"] for s in steps) == 2
    # syncs interrupted generations, which then finished with the next weights
    assert sum(s["async/resumed_samples"] for s in steps) > 0
    # the token-level correction (auto) sees the gap between sampling and trained weights
    assert steps[0]["mismatch_kl"] < 1e-4 and max(s["mismatch_kl"] for s in steps) > 1e-4
    assert "stale 2" in result.stdout
    if overrides:  # each conversation's turns recorded token for token, across versions
        assert all(s["agent/turns"] == 2 and s["agent/rejected"] == 0 for s in steps)
    assert_calm_console(result, tmp_path, ranks=2, steps=6)
