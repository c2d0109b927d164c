"""HF Llama/Qwen2/Qwen3 <-> Megatron conversion: every TP/PP split round-trips exactly, and a
checkpoint whose tensors the conversion would not all read is refused."""

from __future__ import annotations

import re

import pytest
import torch

from relax_launch.trainer.hf_conversion import (
    check_checkpoint,
    fuse_for_engine,
    hf_to_megatron,
    megatron_to_hf,
    stage_layers,
    tp_split_dim,
)
from relax_launch.trainer.model_shape import ModelShape

SHAPE = ModelShape(
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
QWEN2 = ModelShape(**{**SHAPE.__dict__, "qkv_bias": True, "tie_embeddings": True})
QWEN3 = ModelShape(**{**SHAPE.__dict__, "qk_norm": True, "head_dim": 8})  # != 32 / 8 heads
FAMILIES = pytest.mark.parametrize("shape", [SHAPE, QWEN2, QWEN3], ids=["llama", "qwen2", "qwen3"])


def random_hf(shape: ModelShape) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    h, hd = shape.hidden_size, shape.head_dim
    sd = {
        "model.embed_tokens.weight": torch.randn(shape.vocab_size, h, generator=g),
        "model.norm.weight": torch.randn(h, generator=g),
    }
    if not shape.tie_embeddings:
        sd["lm_head.weight"] = torch.randn(shape.vocab_size, h, generator=g)
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
        if shape.qkv_bias:
            sd |= {
                p + "self_attn.q_proj.bias": torch.randn(shape.num_heads * hd, generator=g),
                p + "self_attn.k_proj.bias": torch.randn(shape.num_kv_heads * hd, generator=g),
                p + "self_attn.v_proj.bias": torch.randn(shape.num_kv_heads * hd, generator=g),
            }
        if shape.qk_norm:
            sd |= {
                p + "self_attn.q_norm.weight": torch.randn(hd, generator=g),
                p + "self_attn.k_norm.weight": torch.randn(hd, generator=g),
            }
    return sd


@FAMILIES
@pytest.mark.parametrize("tp_size", [1, 2, 4])
@pytest.mark.parametrize("pp_size", [1, 2])
def test_round_trip_through_every_shard(shape, tp_size, pp_size):
    hf = random_hf(shape)
    check_checkpoint(hf, shape)
    back: dict[str, torch.Tensor] = {}
    for pp in range(pp_size):
        shards = [
            hf_to_megatron(hf, shape, tp_rank=r, tp_size=tp_size, pp_rank=pp, pp_size=pp_size)
            for r in range(tp_size)
        ]
        offset = stage_layers(shape, pp, pp_size).start
        for name in shards[0]:
            dim = tp_split_dim(name)
            full = shards[0][name] if dim is None else torch.cat([s[name] for s in shards], dim)
            back.update(megatron_to_hf(name, full, shape, tp_size=tp_size, layer_offset=offset))
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
    tied = ModelShape(**{**SHAPE.__dict__, "tie_embeddings": True})
    assert "output_layer.weight" not in hf_to_megatron(random_hf(SHAPE), tied, tp_rank=0, tp_size=1)


@FAMILIES
@pytest.mark.parametrize("tp_size", [1, 2])
def test_fused_export_is_the_engines_layout_of_the_hf_tensors(shape, tp_size):
    hf = random_hf(shape)
    fused = {}
    for tp_rank in range(tp_size):
        shard = hf_to_megatron(hf, shape, tp_rank=tp_rank, tp_size=tp_size)
        for name, tensor in shard.items():
            fused.setdefault(name, []).append(tensor)
    exported = {}
    for name, parts in fused.items():
        dim = tp_split_dim(name)
        full = parts[0] if dim is None else torch.cat(parts, dim=dim)
        exported.update(
            megatron_to_hf(name, full, shape, tp_size=tp_size, layer_offset=0, fused=True)
        )
    expected = fuse_for_engine(hf)
    assert exported.keys() == expected.keys()
    assert all(torch.equal(exported[n], expected[n]) for n in expected)


def test_qkv_biases_are_grouped_like_the_weight_rows():
    hf = random_hf(QWEN2)
    bias = hf_to_megatron(hf, QWEN2, tp_rank=0, tp_size=1)[
        "decoder.layers.0.self_attention.linear_qkv.bias"
    ]
    hd, per_group = QWEN2.head_dim, QWEN2.num_heads // QWEN2.num_kv_heads
    k = hf["model.layers.0.self_attn.k_proj.bias"]
    assert torch.equal(bias[per_group * hd : (per_group + 1) * hd], k[:hd])


@pytest.mark.parametrize(
    ("checkpoint", "shape", "named"),
    [
        (QWEN3, SHAPE, "unread keys ['model.layers.0.self_attn.k_norm.weight'"),  # norms dropped
        (QWEN2, SHAPE, "unread keys ['model.layers.0.self_attn.k_proj.bias'"),  # biases dropped
        (SHAPE, QWEN3, "missing keys ['model.layers.0.self_attn.k_norm.weight'"),
    ],
)
def test_a_checkpoint_with_keys_the_shape_does_not_read_or_lacks_is_refused(
    checkpoint, shape, named
):
    hf = random_hf(checkpoint)
    hf.setdefault("lm_head.weight", hf["model.embed_tokens.weight"].clone())
    with pytest.raises(ValueError, match=re.escape(named)):
        check_checkpoint(hf, shape)


def test_a_tied_checkpoint_may_keep_its_copy_of_the_embeddings():
    hf = random_hf(QWEN2)
    hf["lm_head.weight"] = hf["model.embed_tokens.weight"].clone()
    check_checkpoint(hf, QWEN2)
    hf["lm_head.weight"] += 1.0  # not a copy: a head the tied model would drop
    with pytest.raises(ValueError, match="unread keys \\['lm_head.weight'\\]"):
        check_checkpoint(hf, QWEN2)


def hf_config(**overrides) -> dict:
    base = {
        "architectures": ["Qwen3ForCausalLM"],
        "num_hidden_layers": 2,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "intermediate_size": 128,
        "vocab_size": 320,
    }
    return {**base, **overrides}


def test_shapes_of_each_family_from_their_configs():
    qwen3 = ModelShape.from_hf_config(hf_config())
    assert (qwen3.qk_norm, qwen3.qkv_bias, qwen3.head_dim) == (True, False, 32)
    qwen2 = ModelShape.from_hf_config(hf_config(architectures=["Qwen2ForCausalLM"], head_dim=None))
    assert (qwen2.qk_norm, qwen2.qkv_bias, qwen2.head_dim) == (False, True, 16)
    rope = {"rope_type": "llama3", "factor": 8.0, "rope_theta": 5e5}
    llama = ModelShape.from_hf_config(
        hf_config(architectures=["LlamaForCausalLM"], rope_parameters=rope)
    )
    assert (llama.rope_type, llama.rope_theta) == ("llama3", 5e5)


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        ({"architectures": ["MixtralForCausalLM"]}, "architecture MixtralForCausalLM"),
        ({"rope_scaling": {"type": "yarn", "factor": 4.0}}, "RoPE scaling 'yarn'"),
        ({"rope_parameters": {"rope_type": "dynamic"}}, "RoPE scaling 'dynamic'"),
        ({"attention_bias": True}, "attention_bias=true"),
        ({"use_sliding_window": True}, "use_sliding_window=true"),
    ],
)
def test_what_the_conversion_cannot_map_exactly_is_refused(overrides, named):
    with pytest.raises(ValueError, match=re.escape(named)):
        ModelShape.from_hf_config(hf_config(**overrides))
