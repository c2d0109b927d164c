"""Sample: one sampled response and everything the step writes onto it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from relax_launch.rl.vision_prompts import PromptImages
    from relax_launch.trainer.batch import RowImages


@dataclass
class TurnTokens:
    """One earlier turn of a conversation trained one sample per turn (``rollout.multi_turn:
    per_turn``): the context the engine was given and what it produced, with its logprobs."""

    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]


@dataclass
class Sample:
    """A response to one prompt; ``group`` is the prompt's position in the step's batch."""

    group: int
    question: str
    label: str | None
    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]  # of each response token, from the engine that sampled it
    text: str
    weight_version: str
    finish_reason: str = ""
    data_source: str = "default"  # the prompt's, for reward functions that branch on it
    meta: dict | None = None  # the prompt's (a reasoning-gym row's entry), for its reward
    teacher_logprobs: list[float] | None = None  # written back by teacher scoring
    rewards: dict[str, float] = field(default_factory=dict)
    reward: float = 0.0
    valid: bool = True  # False when a reward source failed for it: no gradient
    masked: bool = False  # in its group's advantages, but not trained on (over-long filtering)
    advantage: float = 0.0
    # agentic rollouts (rl/agent.py): 1 where the engine produced the response token, 0 where
    # the conversation did (tool results, user turns, template markup); the conversation as the
    # rollout function returned it; its assistant turns; how it ended ("", out_of_budget,
    # failed, rejected).
    response_mask: list[float] | None = None
    conversation: list[dict] | None = None
    turns: int = 1
    outcome: str = ""
    scores: dict[str, float] | None = None  # rewards its rollout computed (builtin:environment)
    # one row per turn (rollout.multi_turn: per_turn): the turns before the last, trained as
    # rows of their own with this sample's advantage; the sample's own tokens are the last turn
    earlier_turns: list[TurnTokens] | None = None
    # fully asynchronous rollout (rl/async_rollout.py): the weight version of each response
    # token (a generation interrupted by a sync continues with the new weights)
    token_versions: list[int] | None = None
    # routing replay: the experts the engine routed each input token to, per MoE layer
    # (int32 [prompt + response tokens - 1, MoE layers, top-k]; ``rollout.routed_experts``)
    routed_experts: torch.Tensor | None = None
    # a vision-language policy's prompt images (patches, grids), for the trainer
    images: RowImages | None = None
    # the same images as the engines take them (data: URLs beside the template's ids), for
    # the teacher's and the judge's requests (rl/vision_scoring.py)
    prompt_images: PromptImages | None = None
