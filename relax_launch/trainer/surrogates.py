"""The policy-gradient surrogates the policy loss chooses from (``algorithm.policy_loss``). Each
maps the per-token importance ratio ``r`` and advantage ``A`` to a per-token loss, plus its own
diagnostics as detached token sums (zero outside ``mask``):

- ``ppo``: PPO-clip, ``-min(r A, clip(r, 1 - lo, 1 + hi) A)``.
- ``cispo``: CISPO (MiniMax-M1, arXiv:2506.13585): ``-sg(min(r, 1 + hi)) A log p``, REINFORCE
  with the importance weight capped and without gradient, so no token loses its gradient to a
  clip (PPO's clip zeroes it); no lower bound, as the paper.
- ``sapo``: SAPO (Gao et al., "Soft Adaptive Policy Optimization", arXiv:2511.20347):
  ``-f(r) A`` with the soft gate ``f(r) = 4/tau * sigmoid(tau (r - 1))``, ``tau`` = tau_pos
  where A > 0, else tau_neg. Its gradient weight ``4 s (1 - s)`` (``s`` the sigmoid) is 1 at
  r = 1 and fades smoothly as r leaves 1, instead of PPO's hard cut.
- ``m2po``: M2PO (Zheng et al., "Prosperity before Collapse", arXiv:2510.01161): ``-M r A``
  without a clip; ``M`` masks the tokens with the largest squared log-ratio until the second
  moment of the kept ones is within the threshold (``second_moment_mask``).

Pure functions of tensors, tested against hand-computed values in tests/rl/test_policy_losses.py.
"""

from __future__ import annotations

import torch

Sums = dict[str, torch.Tensor]


def _on(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.where(mask > 0, values, torch.zeros_like(values))


def ppo_clip(
    ratio: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, low: float, high: float
) -> tuple[torch.Tensor, Sums]:
    """PPO-clip per token, and the tokens whose ratio the clip moved ("clipped")."""
    clipped = torch.clamp(ratio, 1.0 - low, 1.0 + high)
    per_token = -torch.minimum(ratio * advantages, clipped * advantages)
    moved = ((ratio - clipped).abs() > 1e-12).float()
    return per_token, {"clipped": _on(moved, mask).sum().detach()}


def cispo(
    ratio: torch.Tensor,
    logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    high: float,
) -> tuple[torch.Tensor, Sums]:
    """CISPO per token, and the tokens whose weight the cap lowered ("cispo_capped")."""
    weight = ratio.detach().clamp(max=1.0 + high)
    capped = (ratio.detach() > 1.0 + high).float()
    return -weight * advantages * logprobs, {"cispo_capped": _on(capped, mask).sum()}


def sapo(
    ratio: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    tau_pos: float,
    tau_neg: float,
) -> tuple[torch.Tensor, Sums]:
    """SAPO per token, and the sum of the gates' gradient weights ("sapo_gate", 1 per token on
    policy, less where the gate softens the update)."""
    tau = torch.where(
        advantages > 0, torch.full_like(ratio, tau_pos), torch.full_like(ratio, tau_neg)
    )
    sigmoid = torch.sigmoid(tau * (ratio - 1.0))
    gate = sigmoid * 4.0 / tau
    weight = (4.0 * sigmoid * (1.0 - sigmoid)).detach()  # d gate / d ratio
    return -gate * advantages, {"sapo_gate": _on(weight, mask).sum()}


def second_moment_mask(
    log_ratio: torch.Tensor, mask: torch.Tensor, threshold: float
) -> torch.Tensor:
    """M2PO's mask (1 keep, 0 drop) over ``mask``'s tokens: drop the tokens of largest squared
    log-ratio, one by one, until the mean squared log-ratio of those kept is at most
    ``threshold`` (all of them dropped if even the smallest is above it).

    Without a host sync (no boolean indexing, ``nonzero`` or ``.item()``: each is a stall per
    micro-batch on an accelerator): the masked-out tokens rank last (-1 below every square), so
    the stable sort orders the trained ones as sorting them alone would, and the count to drop
    stays a tensor."""
    on = (mask > 0).flatten()
    squares = log_ratio.detach().pow(2).flatten()
    ranked, order = torch.sort(torch.where(on, squares, -1.0), descending=True, stable=True)
    trained = on.sum()
    rank = torch.arange(len(ranked), device=ranked.device)
    # kept_mean[k]: the mean of the trained tokens left after dropping the k largest
    suffix = torch.where(rank < trained, ranked, 0.0).flip(0).cumsum(0).flip(0)
    kept_mean = suffix / (trained - rank).clamp(min=1).to(ranked.dtype)
    within = (kept_mean <= threshold) & (rank < trained)
    dropped = torch.minimum((within.cumsum(0) == 0).sum(), trained)
    keep_ranked = ((rank >= dropped) & (rank < trained)).to(log_ratio.dtype)
    keep = torch.zeros_like(keep_ranked).scatter(0, order, keep_ranked)
    return keep.reshape(log_ratio.shape)


def m2po(
    ratio: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, threshold: float
) -> tuple[torch.Tensor, Sums]:
    """M2PO per token, with the tokens' squared log-ratios before the mask ("m2"), the tokens it
    dropped ("m2po_masked") and the kept tokens' second moment ("m2po_m2_kept_max": reduced by
    max over micro-batches, each within the threshold, so the batch's is too)."""
    log_ratio = torch.log(ratio.detach())
    keep = second_moment_mask(log_ratio, mask, threshold)
    squares = _on(log_ratio.pow(2), mask)
    kept = keep.sum()
    sums = {
        "m2": squares.sum(),
        "m2po_masked": mask.sum() - kept,
        "m2po_m2_kept_max": (squares * keep).sum() / kept.clamp(min=1.0),
    }
    return -keep * ratio * advantages, sums
