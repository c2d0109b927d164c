"""The policy's per-token loss (-logprob) over tensor-parallel vocabulary slices, with the
logits' gradient in the logits' own dtype.

Megatron-core's fused ('native') cross entropy casts the logits' gradient to bf16 whatever the
model's dtype (``fused_cross_entropy.calculate_gradients``), so an fp32 trainer's every gradient
carried bf16 rounding (up to 1.5e-3 of the largest gradient of a weight). This is the same
computation, from the same fused pieces, with the gradient cast back to the logits' dtype: a
bf16 model gets what it got before, an fp32 model the exact gradient.
"""

from __future__ import annotations

import types
from typing import Any

import torch
import torch.distributed as dist
from megatron.core.fusions import fused_cross_entropy as fused
from megatron.core.tensor_parallel.cross_entropy import VocabParallelCrossEntropy
from megatron.core.tensor_parallel.utils import VocabUtility


class _CrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, target: torch.Tensor, tp_group: Any) -> Any:
        ctx.logits_dtype = logits.dtype
        logits, logits_max = fused.calculate_logits_max(logits)
        dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=tp_group)
        start, end = VocabUtility.vocab_range_from_per_partition_vocab_size(
            logits.size(-1), tp_group.rank(), tp_group.size()
        )
        target_mask, masked_target, predicted_and_sums, exp_logits = (
            fused.calculate_predicted_logits(logits, target, logits_max, start, end)
        )
        dist.all_reduce(predicted_and_sums, op=dist.ReduceOp.SUM, group=tp_group)
        softmax, loss = fused.calculate_cross_entropy_loss(exp_logits, predicted_and_sums)
        ctx.save_for_backward(softmax, target_mask, masked_target)
        return loss

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        softmax, target_mask, masked_target = ctx.saved_tensors
        grad_2d, arange, softmax_update, grad_input = (
            VocabParallelCrossEntropy.prepare_gradient_calculation_operands(softmax, target_mask)
        )
        grad_input = VocabParallelCrossEntropy.calculate_gradients(
            grad_2d, arange, masked_target, softmax_update, grad_input, grad_output
        )
        return grad_input.to(ctx.logits_dtype), None, None


def token_losses(logits: torch.Tensor, target: torch.Tensor, tp_group: Any) -> torch.Tensor:
    """-logprob of ``target`` [s, b] under ``logits`` [s, b, vocab / tp] (this rank's slice)."""
    return _CrossEntropy.apply(logits, target, tp_group)


def use_exact_cross_entropy(model: Any) -> None:
    """Make the GPTModel ``model`` compute its labels' loss with ``token_losses``."""

    def compute_language_model_loss(self: Any, labels: torch.Tensor, logits: torch.Tensor):
        loss = token_losses(logits, labels.transpose(0, 1).contiguous(), self.pg_collection.tp)
        return loss.transpose(0, 1).contiguous()  # [s, b] -> [b, s], as Megatron's

    model.compute_language_model_loss = types.MethodType(compute_language_model_loss, model)
