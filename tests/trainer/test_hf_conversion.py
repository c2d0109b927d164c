"""HF Llama <-> Megatron conversion: every TP/PP split round-trips exactly."""

from __future__ import annotations

import pytest
import torch

from relax_launch.trainer.hf_conversion import (
    LlamaShape,
    fuse_for_engine,
    hf_to_megatron,
    megatron_to_hf,
    stage_layers,
    tp_split_dim,
)

SHAPE = LlamaShape(
    num_layers=4,
    hidden_size=32,
    num_heads=8,
    num_kv_heads=4,
    head_dim=4,
    ffn_hidden_size=48,
    vocab_size=64,
    tie_embeddings=False,
    rms_norm_eps=1e-6,
    rope_theta=1e4,
    max_position_embeddings=128,
)


def random_hf(shape: LlamaShape) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    h, hd = shape.hidden_size, shape.head_dim
    sd = {
        "model.embed_tokens.weight": torch.randn(shape.vocab_size, h, generator=g),
        "model.norm.weight": torch.randn(h, generator=g),
        "lm_head.weight": torch.randn(shape.vocab_size, h, generator=g),
    }
    for i in range(shape.num_layers):
        p = f"model.layers.{i}."
        sd |= {
            p + "input_layernorm.weight": torch.randn(h, generator=g),
            p + "post_attention_layernorm.weight": torch.randn(h, generator=g),
            p + "self_attn.q_proj.weight": torch.randn(shape.num_heads * hd, h, generator=g),
            p + "self_attn.k_proj.weight": torch.randn(shape.num_kv_heads * hd, h, generator=g),
            p + "self_attn.v_proj.weight": torch.randn(shape.num_kv_heads * hd, h, generator=g),
            p + "self_attn.o_proj.weight": torch.randn(h, shape.num_heads * hd, generator=g),
            p + "mlp.gate_proj.weight": torch.randn(shape.ffn_hidden_size, h, generator=g),
            p + "mlp.up_proj.weight": torch.randn(shape.ffn_hidden_size, h, generator=g),
            p + "mlp.down_proj.weight": torch.randn(h, shape.ffn_hidden_size, generator=g),
        }
    return sd


@pytest.mark.parametrize("tp_size", [1, 2, 4])
@pytest.mark.parametrize("pp_size", [1, 2])
def test_round_trip_through_every_shard(tp_size, pp_size):
    hf = random_hf(SHAPE)
    back: dict[str, torch.Tensor] = {}
    for pp in range(pp_size):
        shards = [
            hf_to_megatron(hf, SHAPE, tp_rank=r, tp_size=tp_size, pp_rank=pp, pp_size=pp_size)
            for r in range(tp_size)
        ]
        offset = stage_layers(SHAPE, pp, pp_size).start
        for name in shards[0]:
            dim = tp_split_dim(name)
            full = shards[0][name] if dim is None else torch.cat([s[name] for s in shards], dim)
            back.update(megatron_to_hf(name, full, SHAPE, tp_size=tp_size, layer_offset=offset))
    assert back.keys() == hf.keys()
    for name, tensor in hf.items():
        assert torch.equal(back[name], tensor), name


def test_qkv_is_grouped_per_kv_head_and_split_by_group():
    hf = random_hf(SHAPE)
    full = hf_to_megatron(hf, SHAPE, tp_rank=0, tp_size=1)[
        "decoder.layers.0.self_attention.linear_qkv.weight"
    ]
    hd, per_group = SHAPE.head_dim, SHAPE.num_heads // SHAPE.num_kv_heads
    q = hf["model.layers.0.self_attn.q_proj.weight"]
    k = hf["model.layers.0.self_attn.k_proj.weight"]
    # Group 0 = its query heads, then k head 0, then v head 0.
    assert torch.equal(full[: per_group * hd], q[: per_group * hd])
    assert torch.equal(full[per_group * hd : (per_group + 1) * hd], k[:hd])
    shard1 = hf_to_megatron(hf, SHAPE, tp_rank=1, tp_size=2)[
        "decoder.layers.0.self_attention.linear_qkv.weight"
    ]
    assert torch.equal(shard1, full[full.shape[0] // 2 :])


def test_fc1_shard_is_gate_then_up():
    hf = random_hf(SHAPE)
    shard = hf_to_megatron(hf, SHAPE, tp_rank=1, tp_size=2)[
        "decoder.layers.0.mlp.linear_fc1.weight"
    ]
    gate = hf["model.layers.0.mlp.gate_proj.weight"].chunk(2)[1]
    up = hf["model.layers.0.mlp.up_proj.weight"].chunk(2)[1]
    assert torch.equal(shard, torch.cat([gate, up]))


def test_tied_embeddings_have_no_output_layer():
    tied = LlamaShape(**{**SHAPE.__dict__, "tie_embeddings": True})
    assert "output_layer.weight" not in hf_to_megatron(random_hf(SHAPE), tied, tp_rank=0, tp_size=1)


@pytest.mark.parametrize("tp_size", [1, 2])
def test_fused_export_is_the_engines_layout_of_the_hf_tensors(tp_size):
    hf = random_hf(SHAPE)
    fused = {}
    for tp_rank in range(tp_size):
        shard = hf_to_megatron(hf, SHAPE, tp_rank=tp_rank, tp_size=tp_size)
        for name, tensor in shard.items():
            fused.setdefault(name, []).append(tensor)
    exported = {}
    for name, parts in fused.items():
        dim = tp_split_dim(name)
        full = parts[0] if dim is None else torch.cat(parts, dim=dim)
        exported.update(
            megatron_to_hf(name, full, SHAPE, tp_size=tp_size, layer_offset=0, fused=True)
        )
    expected = fuse_for_engine(hf)
    assert exported.keys() == expected.keys()
    assert all(torch.equal(exported[n], expected[n]) for n in expected)
