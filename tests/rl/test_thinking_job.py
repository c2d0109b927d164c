"""Real jobs on a tiny random Qwen3 with Qwen3's tokenizer configuration and chat template
(tests/rl/template_tokenizers.py): three-turn tool conversations with a follow-up question
(tests/rl/thinking_agent.py) on a real SGLang engine and the real Megatron-core trainer.

Qwen3's template renders an earlier assistant turn otherwise once the conversation goes on
(without its <think> block, and without the empty one it gives the last turn), so before
``rollout.multi_turn`` (``strict`` now) every conversation was rejected and the job stopped at
its first step with no sample to score; ``continue_tokens`` and ``per_turn`` train all of them,
the engine's logprobs equal to the trainer's (exact tokens)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from template_tokenizers import build_tiny_model
from test_rl_job import run_tiny

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

AGENTIC = Path(__file__).parent / "agentic_tiny.yaml"


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model("qwen3", tmp_path_factory.mktemp("tiny-qwen3-thinking"))


def run(tmp_path: Path, model: Path, multi_turn: str) -> subprocess.CompletedProcess:
    return run_tiny(
        AGENTIC,
        f"logging.dir={tmp_path}",
        f"trainer.model={model}",
        "rollout.function=thinking_agent:think_call_follow_up",
        f"rollout.multi_turn={multi_turn}",
        "data.max_prompt_tokens=512",  # Qwen3's tools system prompt
        "data.max_response_tokens=400",
    )


@pytest.mark.parametrize("multi_turn", ["continue_tokens", "per_turn"])
def test_qwen3_conversations_with_a_follow_up_train_exactly(tmp_path, tiny_qwen3, multi_turn):
    result = run(tmp_path, tiny_qwen3, multi_turn)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    steps = [json.loads(line) for line in lines]
    assert [s["step"] for s in steps] == [1, 2]
    for s in steps:
        assert s["agent/rejected"] == s["agent/failed"] == 0
        assert s["agent/turns"] > 1  # conversations went on past the first turn
        assert s["samples_invalid"] == 0 and s["train_skipped"] == 0
        # what the trainer scored is what the engine produced, token for token
        assert s["mismatch_kl"] < 1e-3 and s["logprob_diff_max"] < 1e-4
        assert s["grad_norm"] > 0


def test_before_qwen3_conversations_were_all_rejected(tmp_path, tiny_qwen3):
    result = run(tmp_path, tiny_qwen3, "strict")
    assert result.returncode != 0
    # every conversation rejected: the first step has no sample to score, and the job stops
    assert "no sample of this step has a reward" in result.stdout + result.stderr
    assert not (tmp_path / "metrics.jsonl").exists() or not (
        (tmp_path / "metrics.jsonl").read_text().strip()
    )
