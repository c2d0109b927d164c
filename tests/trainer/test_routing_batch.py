"""A batch carrying the engine's routing (routing replay): it travels packed and comes back
whole, splits with its sequences, pads its rows with experts that exist, and reaches Megatron's
routers in their token order (sequence-first)."""

from __future__ import annotations

import torch

from relax_launch.trainer.batch import TokenBatch
from relax_launch.trainer.moe import sequence_first


def routed_batch() -> TokenBatch:
    tokens = ((1, 2, 3, 4), (5, 6, 7), (8, 9, 10, 11, 12), (13, 14))
    masks = tuple(tuple(float(i > 0) for i in range(len(t))) for t in tokens)
    g = torch.Generator().manual_seed(0)
    routed = tuple(torch.randint(0, 8, (len(t) - 1, 3, 2), generator=g) for t in tokens)
    return TokenBatch(tokens, masks, masks, masks, routed)


def test_routing_travels_packed_and_splits_with_its_sequences():
    batch = routed_batch()
    shape = batch.shape()
    assert (shape.routed_layers, shape.topk, shape.routed) == (3, 2, (14 - 4) * 3 * 2)
    back = TokenBatch.unpack(*batch.pack(), shape)
    assert back.tokens == batch.tokens
    assert all(
        torch.equal(a, b) for a, b in zip(back.routed_experts, batch.routed_experts, strict=True)
    )
    second = batch.shards(2)[1]
    assert torch.equal(second.routed_experts[0], batch.routed_experts[2])
    ids, _ = second.shape().empty()
    assert ids.numel() == second.pack()[0].numel()  # a receiver allocates what is sent


def test_padded_routing_keeps_real_experts_and_megatron_order():
    batch = routed_batch()
    tensors = batch.tensors()
    routed = tensors["routed_experts"]
    assert routed.shape == (4, 4, 3, 2)  # [batch, longest - 1, layers, k]
    assert torch.equal(routed[1, :2], batch.routed_experts[1])
    assert torch.equal(routed[3, 1:], torch.arange(2).expand(3, 3, 2))  # padding: experts 0, 1
    assert tensors["valid"][3].tolist() == [1.0, 0.0, 0.0, 0.0]
    order = sequence_first(routed, 2)  # Megatron's router: token (s, b) at row s * batch + b
    assert torch.equal(order[1 * 4 + 2], routed[2, 1, 2])
