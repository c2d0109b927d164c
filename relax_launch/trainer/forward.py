"""One micro-batch through the model: its inputs, the per-token output back in the loss's
layout (gathered over context-parallel ranks, unpacked), and the loss Megatron's schedule sums.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from relax_launch.trainer.attention import gather_sequence
from relax_launch.trainer.losses import LossSpec, likelihood_loss, policy_loss
from relax_launch.trainer.moe import MoeRouting
from relax_launch.trainer.vlm_batches import vision_arguments


def step_inputs(batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, None]:
    """The model's inputs for one micro-batch: token ids and their positions (from which the
    attention knows each sequence, ``trainer/attention.py``; no mask)."""
    return batch["inputs"], batch["positions"], None


def loss_layout(per_token: torch.Tensor, batch: dict[str, torch.Tensor], cp: Any) -> torch.Tensor:
    """The model's per-token output for this CP rank's slice of the rows -> one row per
    sequence. Every CP rank then computes the whole loss, its gradient summed back onto each
    slice, and reports the whole count, so Megatron's sums over DP x CP stay in ratio."""
    if cp.size() > 1:
        per_token = gather_sequence(per_token, cp, dim=1)
    if "gather" in batch:  # packed rows
        per_token = per_token.reshape(-1)[batch["gather"]]
    return per_token


def micro_batch_loss(
    batch: dict[str, torch.Tensor], logprobs: torch.Tensor, spec: LossSpec
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """(loss sum, count, detached token sums) of one micro-batch: PPO-clip when it has old
    logprobs, else weighted likelihood. Megatron adds the sums and counts over micro-batches and
    data-parallel ranks and divides once (``calculate_per_token_loss``)."""
    mask = batch["mask"]
    if "old_logprobs" not in batch:
        loss_sum, count = likelihood_loss(logprobs, batch["weights"], mask)
        return loss_sum, count, {"tokens": mask.sum()}
    return policy_loss(
        logprobs,
        batch["old_logprobs"],
        batch["weights"],
        mask,
        spec,
        ref_logprobs=batch.get("ref_logprobs"),
    )


def forward_step(
    data_iterator: Iterator[dict[str, torch.Tensor]],
    model: Any,
    spec: LossSpec,
    moe: MoeRouting | None,
    train: bool,
    cp: Any,
) -> tuple[Any, Any]:
    batch = next(data_iterator)
    if moe is not None:  # the engine's routing replayed, the training forward's observed
        moe.prepare(model, batch, train)
    # -logprob; a vision-language policy's micro-batches carry their images
    token_loss = model(*step_inputs(batch), labels=batch["targets"], **vision_arguments(batch))

    def loss_fn(output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
        logprobs = -loss_layout(output.float(), batch, cp)
        loss_sum, count, sums = micro_batch_loss(batch, logprobs, spec)
        report = {"loss_sum": loss_sum.detach().clone(), "count": count.detach().clone()}
        report.update(sums, logprobs=logprobs.detach())
        # Megatron sums the counts in an int tensor: a sequence count is whole, a token count too
        return loss_sum, count.round().int(), report

    return token_loss, loss_fn
