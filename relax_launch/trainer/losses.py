"""The policy loss the trainer computes: PPO-clip over per-token logprobs, with the KL penalty to
the initial (reference) policy.

Pure functions of tensors (unit-tested against hand-computed values). Each returns a loss *sum*
and the count it is a mean over: the trainer adds both up over every micro-batch and
data-parallel rank and divides once (Megatron's per-token loss), so the loss of a batch does not
depend on how it is split. Log-ratios are zeroed outside the mask and clamped to
``±LOG_RATIO_LIMIT`` inside it, so no position can overflow ``exp`` into Inf or NaN.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

LOG_RATIO_LIMIT = 20.0  # exp(20) ~ 5e8: far past any clip, still finite in fp32 and bf16
KL_LIMIT = 10.0  # the k3 estimate's cap (as verl's low_var_kl), so one token cannot dominate


@dataclass(frozen=True)
class LossSpec:
    """The policy loss's settings, sent from the controller with each train step."""

    clip_low: float = 0.2
    clip_high: float = 0.2
    aggregation: str = "token"  # "token": mean over all tokens; "sequence": per sequence first
    kl_coef: float = 0.0  # > 0: the trainer scores the batch with the reference model too


def log_ratio(logprobs: torch.Tensor, other: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``other - logprobs`` on masked tokens, clamped to ±LOG_RATIO_LIMIT; 0 elsewhere."""
    delta = torch.where(mask > 0, other - logprobs, torch.zeros_like(logprobs))
    return delta.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)


def reference_kl(
    logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Per-token KL(policy || reference), the non-negative "k3" estimator of the sampled token:
    ``exp(d) - d - 1`` with ``d = ref - logprob`` (unbiased, lower variance than the log-ratio),
    capped at KL_LIMIT; 0 outside ``mask``."""
    delta = log_ratio(logprobs, ref_logprobs, torch.ones_like(logprobs) if mask is None else mask)
    return (torch.exp(delta) - delta - 1.0).clamp(max=KL_LIMIT)


def aggregate(
    per_token: torch.Tensor, mask: torch.Tensor, aggregation: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum, count) whose ratio over the whole batch is the loss: the sum and number of masked
    tokens ("token"), or of each sequence's token mean and the sequences ("sequence")."""
    masked = torch.where(mask > 0, per_token, torch.zeros_like(per_token))
    if aggregation == "token":
        return masked.sum(), mask.sum()
    if aggregation == "sequence":
        lengths = mask.sum(-1)
        return (masked.sum(-1) / lengths.clamp(min=1.0)).sum(), (lengths > 0).sum().float()
    raise ValueError(f"unknown loss aggregation {aggregation!r}")


def likelihood_loss(
    logprobs: torch.Tensor, weights: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Weighted next-token likelihood: ``-sum(weight * logprob)`` over masked tokens, and their
    count."""
    return aggregate(-weights * logprobs, mask, "token")


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    spec: LossSpec,
    ref_logprobs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """PPO-clip loss over [batch, tokens]: (loss sum, count, detached token sums).

    ratio = exp(logprob - old); per token ``-min(ratio * A, clip(ratio, 1 - lo, 1 + hi) * A)``,
    plus ``kl_coef * reference_kl`` when reference logprobs are given; summed per
    ``spec.aggregation``. The token sums ("tokens", "clipped", "approx_kl" = old - new, and
    "kl_ref") divided by "tokens" are the batch's diagnostics.
    """
    ratio = torch.exp(-log_ratio(logprobs, old_logprobs, mask))
    clipped = torch.clamp(ratio, 1.0 - spec.clip_low, 1.0 + spec.clip_high)
    per_token = -torch.minimum(ratio * advantages, clipped * advantages)
    with torch.no_grad():
        sums = {
            "tokens": mask.sum(),
            "clipped": aggregate(((ratio - clipped).abs() > 1e-12).float(), mask, "token")[0],
            "approx_kl": aggregate(-torch.log(ratio), mask, "token")[0],
        }
    if ref_logprobs is not None:
        kl = reference_kl(logprobs, ref_logprobs, mask)
        per_token = per_token + spec.kl_coef * kl
        sums["kl_ref"] = aggregate(kl.detach(), mask, "token")[0]
    loss_sum, count = aggregate(per_token, mask, spec.aggregation)
    return loss_sum, count, sums
