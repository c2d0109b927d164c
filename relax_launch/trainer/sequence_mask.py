"""The closed-loop control's sequence mask (``algorithm.control.ratio_mask``, ``rl/control.py``).

A sequence's importance ratio of the trainer (the policy being trained) over the engine that
sampled it is taken as the geometric mean over its trained tokens, ``exp(mean_t log(p_trainer /
p_engine))``: unlike ``sequence_mis``'s product it does not grow with the length, so one bound
fits short and long responses. It is taken either way, ``max(r, 1/r)``: an engine whose tokens
the trainer finds unlikely (r << 1, what wrong weights show) is as far off as the reverse.

Every PPO step reports the batch's largest (``sequence_ratio_max``), which the control watches;
while the control engages the mask (``LossSpec.sequence_ratio_bound``) a sequence beyond the
bound contributes nothing to the loss, with any rollout correction (none included), and the step
reports the share of sequences dropped. Pure functions of tensors, unit-tested.
"""

from __future__ import annotations

import torch

MEAN_LOG_RATIO_LIMIT = 20.0  # exp(20): far past any bound, finite in fp32


def sequence_ratios(
    logprobs: torch.Tensor, engine_logprobs: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """[sequences] each sequence's geometric-mean ratio of trainer over engine, either way
    (>= 1); 1 for a sequence without a trained token."""
    delta = torch.where(mask > 0, logprobs.detach() - engine_logprobs, torch.zeros_like(mask))
    mean = delta.sum(-1) / mask.sum(-1).clamp(min=1.0)
    return torch.exp(mean.abs().clamp(max=MEAN_LOG_RATIO_LIMIT))


def sequence_mask(
    logprobs: torch.Tensor,
    engine_logprobs: torch.Tensor,
    mask: torch.Tensor,
    bound: float | None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(what to multiply the per-token loss by: [sequences, 1], 0 for a dropped sequence;
    detached sums): ``sequence_ratio_max`` always; with a ``bound``, the sequences dropped
    (``masked_sequences``, beyond [1/bound, bound]) and those trained on (``sequences``)."""
    ratios = sequence_ratios(logprobs, engine_logprobs, mask)
    trained = mask.sum(-1) > 0
    sums = {"sequence_ratio_max": torch.where(trained, ratios, torch.ones_like(ratios)).max()}
    if bound is None:
        return torch.ones_like(ratios).unsqueeze(-1), sums
    beyond = trained & (ratios > bound)
    sums["masked_sequences"] = beyond.float().sum()
    sums["sequences"] = trained.float().sum()
    return (~beyond).to(logprobs.dtype).unsqueeze(-1), sums
