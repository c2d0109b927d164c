"""The engines decode greedily below SGLang's temperature epsilon: its sampling parameters turn
into the argmax (top-k 1), with no random draw, so the same weights draw the same tokens in
every run (the exact replays after a resume rely on it: tests/rl/test_critic_job.py). Any
temperature above it draws at random, and SGLang's draws are unseeded unless the engine runs
deterministic inference."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize("temperature", [1e-7, 0.0])
def test_a_temperature_below_sglangs_epsilon_decodes_greedily(temperature: float) -> None:
    from sglang.srt.sampling.sampling_params import SamplingParams

    params = SamplingParams(temperature=temperature, max_new_tokens=8)
    assert (params.top_k, params.temperature) == (1, 1.0)  # argmax of the raw logits


def test_near_greedy_still_samples() -> None:
    from sglang.srt.sampling.sampling_params import SamplingParams

    params = SamplingParams(temperature=1e-3, max_new_tokens=8)
    assert params.top_k != 1 and params.temperature == 1e-3  # a draw from the tempered softmax
