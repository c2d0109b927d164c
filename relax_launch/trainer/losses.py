"""The policy loss the trainer computes: PPO-clip (or GSPO's sequence ratio) over per-token
logprobs, with the KL penalty to the initial (reference) policy and the rollout correction
(truncated or masked importance sampling between the engine that sampled and the trainer).

Pure functions of tensors (unit-tested against hand-computed values). Each returns a loss *sum*
and the count it is a mean over: the trainer adds both up over every micro-batch and
data-parallel rank and divides once (Megatron's per-token loss), so the loss of a batch does not
depend on how it is split. Log-ratios are zeroed outside the mask and clamped to
``±LOG_RATIO_LIMIT`` inside it, so no position can overflow ``exp`` into Inf or NaN.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from relax_launch.trainer import surrogates
from relax_launch.trainer.sequence_mask import sequence_mask

LOG_RATIO_LIMIT = 20.0  # exp(20) ~ 5e8: far past any clip, still finite in fp32 and bf16
KL_LIMIT = 10.0  # the k3 estimate's cap (as verl's low_var_kl), so one token cannot dominate
# Token sums the trainer reduces with a max over micro-batches and ranks (the others add up).
MAX_REDUCED = ("is_ratio_max", "logprob_diff_max", "sequence_ratio_max", "m2po_m2_kept_max")


@dataclass(frozen=True)
class LossSpec:
    """The policy loss's settings, sent from the controller with each train step."""

    clip_low: float = 0.2
    clip_high: float = 0.2
    # "token": mean over all tokens; "sequence": per sequence first; "token_sum": every token's
    # loss summed per sequence over a constant max_response_tokens (Dr.GRPO), then averaged.
    aggregation: str = "token"
    kl_coef: float = 0.0  # > 0: the trainer scores the batch with the reference model too
    ratio: str = "token"  # "sequence": GSPO's length-normalised sequence ratio
    correction: str = "none"  # "token_tis" | "sequence_mis": importance weights engine->trainer
    correction_cap: float = 2.0
    max_response_tokens: int = 0  # token_sum's constant normaliser
    # the policy-gradient surrogate (``trainer/surrogates.py``): ppo | cispo | sapo | m2po
    surrogate: str = "ppo"
    cispo_clip_high: float = 0.2  # CISPO's weight cap is 1 + this
    sapo_tau_pos: float = 1.0  # SAPO's gate temperature where the advantage is positive
    sapo_tau_neg: float = 1.05  # and where it is not
    m2po_threshold: float = 0.04  # M2PO's bound on the kept tokens' mean squared log-ratio
    # the control's sequence mask (``trainer/sequence_mask.py``); None: no sequence dropped
    sequence_ratio_bound: float | None = None
    # MoE: replay the engine's routing a batch carries; False: only compared (the control's)
    routing_replay: bool = True
    # the mismatch guard's bounds (action skip): a batch metric above one withholds the update
    withhold_above: tuple[tuple[str, float], ...] = ()


def log_ratio(logprobs: torch.Tensor, other: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``other - logprobs`` on masked tokens, clamped to ±LOG_RATIO_LIMIT; 0 elsewhere."""
    delta = torch.where(mask > 0, other - logprobs, torch.zeros_like(logprobs))
    return delta.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)


def reference_kl(
    logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Per-token KL(policy || reference), the non-negative "k3" estimator of the sampled token:
    ``exp(d) - d - 1`` with ``d = ref - logprob`` (unbiased, lower variance than the log-ratio),
    capped at KL_LIMIT; 0 outside ``mask``. ``logprobs`` are those of the policy that sampled."""
    delta = log_ratio(logprobs, ref_logprobs, torch.ones_like(logprobs) if mask is None else mask)
    return (torch.exp(delta) - delta - 1.0).clamp(max=KL_LIMIT)


def aggregate(
    per_token: torch.Tensor, mask: torch.Tensor, aggregation: str, max_tokens: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum, count) whose ratio over the whole batch is the loss: the sum and number of masked
    tokens ("token"), of each sequence's token mean and the sequences ("sequence"), or the sum
    and sequences x ``max_tokens`` ("token_sum", Dr.GRPO's constant normaliser)."""
    masked = torch.where(mask > 0, per_token, torch.zeros_like(per_token))
    if aggregation == "token":
        return masked.sum(), mask.sum()
    lengths = mask.sum(-1)
    sequences = (lengths > 0).sum().float()
    if aggregation == "sequence":
        return (masked.sum(-1) / lengths.clamp(min=1.0)).sum(), sequences
    if aggregation == "token_sum":
        if max_tokens < 1:
            raise ValueError("token_sum aggregation needs max_tokens >= 1")
        return masked.sum(), sequences * max_tokens
    raise ValueError(f"unknown loss aggregation {aggregation!r}")


def likelihood_loss(
    logprobs: torch.Tensor, weights: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Weighted next-token likelihood: ``-sum(weight * logprob)`` over masked tokens, and their
    count."""
    return aggregate(-weights * logprobs, mask, "token")


def policy_ratio(
    logprobs: torch.Tensor, base: torch.Tensor, mask: torch.Tensor, kind: str
) -> torch.Tensor:
    """Per-token importance ratio of the policy to ``base``: ``exp(logprob - base)`` ("token"),
    or GSPO's sequence ratio ``exp(mean_t(logprob - base))`` on every token of its sequence,
    carrying each token's own gradient (``sg[s] * p_t / sg[p_t]``)."""
    delta = -log_ratio(logprobs, base, mask)
    if kind == "token":
        return torch.exp(delta)
    if kind != "sequence":
        raise ValueError(f"unknown policy ratio {kind!r}")
    sequence = delta.detach().sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1.0)
    return torch.exp(sequence + logprobs - logprobs.detach())


def correction_weights(
    trainer_logprobs: torch.Tensor,
    engine_logprobs: torch.Tensor,
    mask: torch.Tensor,
    spec: LossSpec,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rollout correction (detached): per-token weights for the trainer-over-engine importance
    ratio, and (tokens whose weight was cut, largest ratio before the cut).

    "token_tis": each token's ratio truncated at ``correction_cap``. "sequence_mis": the
    sequence's ratio (product over its tokens) on every token, or 0 for the whole sequence when
    it exceeds the cap (masked importance sampling).
    """
    delta = -log_ratio(trainer_logprobs.detach(), engine_logprobs, mask)  # log(trainer/engine)
    on = mask > 0
    if spec.correction == "token_tis":
        ratio = torch.exp(delta)
        cut = on & (ratio > spec.correction_cap)
        weights = ratio.clamp(max=spec.correction_cap)
    elif spec.correction == "sequence_mis":
        sequence = delta.sum(-1, keepdim=True).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
        ratio = torch.exp(sequence).expand_as(delta)
        cut = on & (ratio > spec.correction_cap)
        weights = torch.where(cut, torch.zeros_like(ratio), ratio)
    else:
        raise ValueError(f"unknown rollout correction {spec.correction!r}")
    largest = torch.where(on, ratio, torch.zeros_like(ratio)).max()
    return torch.where(on, weights, torch.zeros_like(weights)), cut.float().sum(), largest


def surrogate(
    ratio: torch.Tensor,
    logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    spec: LossSpec,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The per-token policy-gradient term ``spec.surrogate`` chooses, and its diagnostics."""
    if spec.surrogate == "ppo":
        return surrogates.ppo_clip(ratio, advantages, mask, spec.clip_low, spec.clip_high)
    if spec.surrogate == "cispo":
        return surrogates.cispo(ratio, logprobs, advantages, mask, spec.cispo_clip_high)
    if spec.surrogate == "sapo":
        return surrogates.sapo(ratio, advantages, mask, spec.sapo_tau_pos, spec.sapo_tau_neg)
    if spec.surrogate == "m2po":
        return surrogates.m2po(ratio, advantages, mask, spec.m2po_threshold)
    raise ValueError(f"unknown policy loss {spec.surrogate!r}")


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    spec: LossSpec,
    ref_logprobs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """The policy loss over [batch, tokens]: (loss sum, count, detached token sums).

    ``old_logprobs`` are the sampling engine's. Without a correction the ratio is taken to them:
    ``ratio = exp(logprob - old)``, per token PPO-clip's ``-min(ratio * A, clip(ratio, 1 - lo,
    1 + hi) * A)`` or the surrogate ``spec.surrogate`` names (``trainer/surrogates.py``, with
    its own token sums). With one (``spec.correction``) the ratio is taken to the trainer's
    own logprobs at the start of the step (the proximal policy) and each token's term is
    multiplied by the importance weight of trainer over engine (``correction_weights``).
    Plus ``kl_coef * reference_kl`` when reference logprobs are given; summed per
    ``spec.aggregation``.

    The token sums ("tokens", the surrogate's (PPO's "clipped"), "approx_kl" = engine -
    trainer, "mismatch_kl" = k3 of KL(engine || trainer), "kl_ref", and with a correction
    "is_cut") divided by "tokens" are the batch's diagnostics; "is_ratio_max" is the largest
    importance ratio, "logprob_diff_max" the largest |trainer - engine| logprob and
    "sequence_ratio_max" the largest sequence ratio (reduced by max). With
    ``spec.sequence_ratio_bound`` the sequences beyond it are dropped from the loss
    (``trainer/sequence_mask.py``: "masked_sequences" of "sequences").
    """
    base = old_logprobs if spec.correction == "none" else logprobs.detach()
    ratio = policy_ratio(logprobs, base, mask, spec.ratio)
    per_token, surrogate_sums = surrogate(ratio, logprobs, advantages, mask, spec)
    with torch.no_grad():
        sums = surrogate_sums | {
            "tokens": mask.sum(),
            "approx_kl": log_ratio(logprobs, old_logprobs, mask).sum(),
            "mismatch_kl": aggregate(reference_kl(old_logprobs, logprobs, mask), mask, "token")[0],
            # trainer vs engine on every trained token: the sync's parity when on-policy
            "logprob_diff_max": torch.where(
                mask > 0, (logprobs.detach() - old_logprobs).abs(), torch.zeros_like(mask)
            ).max(),
        }
    if spec.correction != "none":
        weights, sums["is_cut"], sums["is_ratio_max"] = correction_weights(
            logprobs, old_logprobs, mask, spec
        )
        per_token = per_token * weights
    if ref_logprobs is not None:
        kl = reference_kl(logprobs, ref_logprobs, mask)
        per_token = per_token + spec.kl_coef * kl
        sums["kl_ref"] = aggregate(kl.detach(), mask, "token")[0]
    keep, sequence_sums = sequence_mask(logprobs, old_logprobs, mask, spec.sequence_ratio_bound)
    sums |= sequence_sums
    per_token = per_token * keep  # sequences the control's mask drops: no loss, same count
    loss_sum, count = aggregate(per_token, mask, spec.aggregation, spec.max_response_tokens)
    return loss_sum, count, sums
