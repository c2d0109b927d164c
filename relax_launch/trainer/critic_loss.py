"""The value model's loss: PPO's clipped value regression, a pure function of tensors returning
a loss *sum* and its token count (summed over micro-batches and data-parallel ranks and divided
once, like the policy loss), unit-tested against hand-computed values."""

from __future__ import annotations

import torch

from relax_launch.trainer.batch import TokenBatch


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    targets: torch.Tensor,
    mask: torch.Tensor,
    clip: float | None,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """(loss sum, count, detached sums) of ``0.5 max((V - R)^2, (clip(V, V_old - clip, V_old +
    clip) - R)^2)`` over the masked tokens (``clip`` None: ``0.5 (V - R)^2``).

    Sums: "value_clipped" (tokens where the clipped term is the larger, i.e. the one whose
    gradient is cut), "value_sum" (of V), "tokens"."""
    on = mask > 0
    loss = (values - targets) ** 2
    clipped = torch.zeros_like(loss, dtype=torch.bool)
    if clip is not None:
        moved = old_values + (values - old_values).clamp(-clip, clip)
        loss_clipped = (moved - targets) ** 2
        clipped = loss_clipped > loss
        loss = torch.maximum(loss, loss_clipped)
    per_token = torch.where(on, 0.5 * loss, torch.zeros_like(loss))
    with torch.no_grad():
        sums = {
            "value_clipped": (clipped & on).float().sum(),
            "value_sum": torch.where(on, values, torch.zeros_like(values)).sum(),
            "tokens": mask.sum(),
        }
    return per_token.sum(), mask.sum(), sums


def critic_batch(
    batch: TokenBatch, returns: list[list[float]], old_values: list[list[float]]
) -> TokenBatch:
    """The critic's train batch in the shard channel's format: ``batch``'s tokens and mask, the
    returns in ``token_weights`` and the values before the update in ``old_logprobs`` (rows
    aligned with the tokens: position 0 is never trained on)."""
    return TokenBatch(
        batch.tokens,
        batch.loss_mask,
        tuple(tuple(r) for r in returns),
        tuple(tuple(v) for v in old_values),
    )
