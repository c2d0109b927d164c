"""Pieces shared by the GPU example configs."""

from relax_launch.config import DataConfig, RewardConfig, RewardSource

QWEN3_8B = "/models/Qwen3-8B"
QWEN3_32B = "/models/Qwen3-32B"
ANSWER = RewardSource(name="answer", function="builtin:exact_numeric")
ANSWER_AND_JUDGE = RewardConfig(
    sources=(ANSWER, RewardSource(name="judge", genrm=True, weight=0.5))
)


def math_data(prompts_per_step: int, max_response_tokens: int) -> DataConfig:
    return DataConfig(
        dataset="/data/math_prompts.jsonl",
        prompts_per_step=prompts_per_step,
        max_prompt_tokens=1024,
        max_response_tokens=max_response_tokens,
    )
