"""The policy's per-token loss: -logprob of the targets, and its logits' gradient in the
logits' own dtype (Megatron's fused loss rounds it to bf16 whatever the model's dtype)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core.fusions.fused_cross_entropy import fused_vocab_parallel_cross_entropy

from relax_launch.trainer.cross_entropy import token_losses


@pytest.fixture
def one_rank_group() -> Iterator[object]:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def losses_and_grad(loss_fn, logits: torch.Tensor, target: torch.Tensor, group):
    logits = logits.detach().clone().requires_grad_(True)
    losses = loss_fn(logits, target, group)
    (losses * torch.linspace(0.5, 2.0, losses.numel()).view_as(losses)).sum().backward()
    return losses.detach(), logits.grad


def reference(logits: torch.Tensor, target: torch.Tensor, _group):
    flat = F.cross_entropy(logits.float().flatten(0, 1), target.flatten(), reduction="none")
    return flat.view_as(target)


def test_fp32_losses_and_gradient_are_exact_where_megatrons_fused_loss_rounds(one_rank_group):
    torch.manual_seed(0)
    logits = torch.randn(7, 3, 50) * 4  # [sequence, batch, vocabulary]
    target = torch.randint(0, 50, (7, 3))
    want_losses, want_grad = losses_and_grad(reference, logits, target, None)
    losses, grad = losses_and_grad(token_losses, logits, target, one_rank_group)
    assert grad.dtype == torch.float32
    assert torch.allclose(losses, want_losses, atol=1e-6, rtol=0)
    assert (grad - want_grad).abs().max() <= 1e-6  # fp32 rounding: an ulp or so
    _, fused_grad = losses_and_grad(
        fused_vocab_parallel_cross_entropy, logits, target, one_rank_group
    )
    assert (fused_grad.float() - want_grad).abs().max() > 1e-4  # what this module corrects


def test_bf16_logits_get_a_bf16_gradient(one_rank_group):
    torch.manual_seed(1)
    logits = (torch.randn(5, 2, 40) * 4).bfloat16()
    target = torch.randint(0, 40, (5, 2))
    _, want_grad = losses_and_grad(reference, logits, target, None)
    _, grad = losses_and_grad(token_losses, logits, target, one_rank_group)
    assert grad.dtype == torch.bfloat16
    assert (grad.float() - want_grad.float()).abs().max() <= 1e-2
