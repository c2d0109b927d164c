"""The policy loss the trainer computes: PPO-clip over per-token logprobs, with the KL penalty to
the initial (reference) policy.

Pure functions of tensors (unit-tested against hand-computed values); the trainer's Megatron
loss function calls ``policy_loss`` on the per-token logprobs it computed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LossSpec:
    """The policy loss's settings, sent from the controller with each train step."""

    clip_low: float = 0.2
    clip_high: float = 0.2
    aggregation: str = "token"  # "token": mean over all tokens; "sequence": per sequence first
    kl_coef: float = 0.0  # > 0: the trainer scores the batch with the reference model too


def reference_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token KL(policy || reference), the non-negative "k3" estimator of the sampled token:
    ``exp(ref - logprob) - (ref - logprob) - 1`` (unbiased, lower variance than the log-ratio)."""
    delta = ref_logprobs - logprobs
    return torch.exp(delta) - delta - 1.0


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, aggregation: str) -> torch.Tensor:
    """Mean over masked tokens ("token"), or mean over sequences of each one's token mean
    ("sequence")."""
    if aggregation == "token":
        return (per_token * mask).sum() / mask.sum().clamp(min=1.0)
    if aggregation == "sequence":
        lengths = mask.sum(-1)
        per_sequence = (per_token * mask).sum(-1) / lengths.clamp(min=1.0)
        return per_sequence.sum() / (lengths > 0).sum().clamp(min=1)
    raise ValueError(f"unknown loss aggregation {aggregation!r}")


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    spec: LossSpec,
    ref_logprobs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO-clip loss over [batch, tokens]; returns the loss and detached diagnostics.

    ratio = exp(logprob - old); per token ``-min(ratio * A, clip(ratio, 1 - lo, 1 + hi) * A)``,
    plus ``kl_coef * reference_kl`` when reference logprobs are given; aggregated per
    ``spec.aggregation``.
    """
    ratio = torch.exp(logprobs - old_logprobs)
    clipped = torch.clamp(ratio, 1.0 - spec.clip_low, 1.0 + spec.clip_high)
    per_token = -torch.minimum(ratio * advantages, clipped * advantages)
    extra = {}
    if ref_logprobs is not None:
        kl = reference_kl(logprobs, ref_logprobs)
        per_token = per_token + spec.kl_coef * kl
        extra["kl_ref"] = aggregate(kl.detach(), mask, "token")
    loss = aggregate(per_token, mask, spec.aggregation)
    tokens = mask.sum().clamp(min=1.0)
    with torch.no_grad():
        clip_fraction = (((ratio - clipped).abs() > 1e-12).float() * mask).sum() / tokens
        approx_kl = ((old_logprobs - logprobs) * mask).sum() / tokens
    return loss, {"clip_fraction": clip_fraction, "approx_kl": approx_kl, **extra}
