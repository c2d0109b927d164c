"""A real job with the DAPO / Dr.GRPO / GSPO family on: dynamic sampling draws more prompts when
groups carry no signal, masked importance sampling measures the engine/trainer mismatch, and
held-out prompts are evaluated every 2 steps and after the last."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_rl_job import assert_calm_console, run_tiny

from relax_launch.config import load_config
from relax_launch.rl.data import PromptStream, load_prompts

pytestmark = pytest.mark.e2e
CONFIG = Path(__file__).parent / "loss_family_tiny.yaml"


def expected_rounds(steps: int) -> list[tuple[int, int]]:
    """(rounds, groups without signal) per step: the reward is flat for prompts whose answer is
    even, so which groups have signal follows from the seeded prompt order alone."""
    job = load_config(str(CONFIG))
    a, per_round = job.algorithm, job.data.prompts_per_step
    stream = PromptStream(load_prompts(job.data), shuffle=True, seed=0)
    out = []
    for _ in range(steps):
        kept = flat = rounds = 0
        while kept < per_round and rounds < a.dynamic_sampling_max_rounds:
            odd = [int(p.label) % 2 for p in stream.next_batch(per_round)]
            kept, flat, rounds = kept + sum(odd), flat + odd.count(0), rounds + 1
        out.append((rounds, flat))
    return out


def test_dynamic_sampling_and_rollout_correction_in_a_real_job(tmp_path):
    result = run_tiny(CONFIG, f"logging.dir={tmp_path}")
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    steps = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    drawn = [(s["data/sampling_rounds"], s["data/groups_without_signal"]) for s in steps]
    assert drawn == expected_rounds(3)
    assert any(rounds > 1 for rounds, _ in drawn)  # the data makes it draw again
    for s in steps:
        assert s["data/groups_padded"] == 0 and s["train_skipped"] == 0
        # same weights and float32 on both sides: the engine's logprobs are the trainer's
        assert s["mismatch_kl"] < 1e-3 and s["is_cut_fraction"] == 0.0
        assert s["is_ratio_max"] == pytest.approx(1.0, abs=0.05)
        assert s["grad_norm"] > 0  # the kept groups have signal
    # evaluation after steps 2 and 3 (every 2, and the last): 4 prompts x 2 samples
    assert ["eval/reward" in s for s in steps] == [False, True, True]
    for s in steps[1:]:
        assert s["eval/prompts"] == 4 and s["eval/samples_invalid"] == 0
        assert 0.0 <= s["eval/pass@1"] <= s["eval/pass@2"] <= 1.0 and s["time/eval"] > 0
    assert "eval reward " in result.stdout and "pass@2 " in result.stdout
    assert "  eval           step 2: reward " in result.stdout
    assert_calm_console(result, tmp_path, ranks=3, steps=3)
