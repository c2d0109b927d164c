"""What a train step reports, and what the mismatch guard's ``skip`` decides from it before the
optimizer's step: the global batch's loss and per-token diagnostics, from every micro-batch's
sums on every data-parallel rank (``trainer/losses.py`` returns sums, so the figures do not
depend on how the batch was split), and whether they are beyond the guard's bounds."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from relax_launch.trainer.losses import MAX_REDUCED

SUMMED = ("loss_sum", "count", "tokens", "clipped", "approx_kl", "mismatch_kl", "is_cut", "kl_ref")
SUMMED += ("masked_sequences", "sequences")  # the control's sequence mask, when engaged
SUMMED += ("cispo_capped", "sapo_gate", "m2", "m2po_masked")  # trainer/surrogates.py's
PER_TOKEN = {  # token sums reported as per-token means, under these names
    "clipped": "clip_fraction",
    "approx_kl": "approx_kl",
    "mismatch_kl": "mismatch_kl",
    "is_cut": "is_cut_fraction",
    "kl_ref": "kl_ref",
    "cispo_capped": "cispo_capped_fraction",
    "sapo_gate": "sapo_gate_mean",
    "m2": "m2po_m2",
    "m2po_masked": "m2po_masked_fraction",
}


def batch_metrics(outputs: list[dict[str, torch.Tensor]], dp: Any) -> dict[str, float]:
    """The global batch's loss and per-token diagnostics (the last pipeline stage's micro-batch
    outputs, summed over the data-parallel group ``dp``; the largest values by max)."""
    keys = tuple(k for k in SUMMED if k in outputs[0])
    total = dp_sums(outputs, keys, dp)
    tokens = max(total["tokens"], 1.0)
    metrics = {"loss": total["loss_sum"] / max(total["count"], 1.0)}
    metrics.update({PER_TOKEN[k]: total[k] / tokens for k in keys if k in PER_TOKEN})
    if "sequences" in total:  # share of the sequences the control's mask dropped
        metrics["control/masked_sequences"] = total["masked_sequences"] / max(total["sequences"], 1)
    for key in (k for k in MAX_REDUCED if k in outputs[0]):
        largest = torch.stack([o[key].float() for o in outputs]).max()
        dist.all_reduce(largest, op=dist.ReduceOp.MAX, group=dp)
        metrics[key] = float(largest)
    return metrics


def dp_sums(
    outputs: list[dict[str, torch.Tensor]], keys: tuple[str, ...], dp: Any
) -> dict[str, float]:
    """Each of ``keys`` summed over the micro-batches and the data-parallel group ``dp``: one
    all-reduce of them packed into one tensor (the policy's and the critic's steps)."""
    totals = torch.stack([sum(o[k].float() for o in outputs) for k in keys])
    dist.all_reduce(totals, group=dp)
    return dict(zip(keys, totals.tolist(), strict=True))


def beyond_bounds(
    metrics: dict[str, float],
    bounds: tuple[tuple[str, float], ...],
    last_stage: bool,
    trainer_group: Any,
    device: torch.device | str,
) -> bool:
    """Whether the batch's metrics (known on the last pipeline stage) are beyond a bound (a NaN
    is), agreed by every rank of ``trainer_group`` so that all of them skip the update or none."""
    beyond = last_stage and any(not metrics.get(name, 0.0) <= bound for name, bound in bounds)
    flag = torch.tensor(float(beyond), device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=trainer_group)
    return bool(flag.item())
