"""A real RL job with agentic turns on a vision-language policy (``vlm_tiny.yaml`` with
``rollout.function: vlm_agent:zoom_tool``): each sample is a conversation whose first turn
shows the prompt's image and whose tool returns another (PIL-drawn); the trainer trains the
engine's token ids with both images. Its logprobs of every trained token equal the engine's
(``logprob_diff_max``: a reply after an image attends to its features, so an image the trainer
read otherwise, or not at all, shows there), and the parity probe holds after each sync."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
HERE = Path(__file__).parent
FP32_PARITY = 1e-5  # trainer and engine in float32: float32 rounding
FP32_SAMPLES = 1e-4  # the trained tokens' largest gap over a whole batch (mismatch_guard.py)


def test_agentic_turns_with_a_tool_image_train_the_engines_tokens_with_both_images(tmp_path):
    cli = Path(sys.executable).with_name("relax-launch")
    overrides = [
        f"logging.dir={tmp_path}",
        "rollout.function=vlm_agent:zoom_tool",
        "algorithm.num_steps=2",
        "data.max_response_tokens=64",
    ]
    result = subprocess.run(
        [str(cli), "run", str(HERE / "vlm_tiny.yaml"), *overrides],
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "PYTHONPATH": str(HERE)},
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-3000:]
    steps = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    shown = ("sync/", "time/", "agent/", "reward", "logprob_diff_max", "mismatch_kl", "grad_norm")
    print(
        json.dumps([{k: v for k, v in s.items() if k.startswith(shown)} for s in steps], indent=1)
    )
    assert [s["step"] for s in steps] == [1, 2]
    for s in steps:
        assert s["agent/turns"] == 2.0 and s["samples_invalid"] == 0
        assert s["agent/rejected"] == s["agent/failed"] == s["agent/out_of_budget"] == 0
        assert s["logprob_diff_max"] <= FP32_SAMPLES and s["grad_norm"] > 0
        assert s["sync/parity_gap"] <= FP32_PARITY and s["sync/parity_gap_image"] <= FP32_PARITY
    assert "finished 2 steps" in result.stdout
