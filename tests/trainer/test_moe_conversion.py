"""HF Qwen3-MoE/Qwen2-MoE <-> Megatron conversion: every EP/TP/PP split round-trips exactly,
each expert lands at its own index on its own EP rank, and the engine's stacked-expert layout is
the HF experts' own."""

from __future__ import annotations

import pytest
import torch
from test_hf_conversion import SHAPE, hf_config, random_hf

from relax_launch.trainer.hf_conversion import (
    check_checkpoint,
    fuse_for_engine,
    hf_to_megatron,
    local_experts,
    megatron_to_hf,
    stage_layers,
    tp_split_dim,
)
from relax_launch.trainer.model_shape import ModelShape, MoeShape

MOE = MoeShape(num_experts=4, topk=2, ffn_hidden_size=16, layers=(1, 3), norm_topk_prob=True)
QWEN3_MOE = ModelShape(**{**SHAPE.__dict__, "qk_norm": True, "head_dim": 8, "moe": MOE})
QWEN2_MOE = ModelShape(
    **{
        **SHAPE.__dict__,
        "qkv_bias": True,
        "moe": MoeShape(
            **{
                **MOE.__dict__,
                "layers": (0, 1, 2, 3),
                "norm_topk_prob": False,
                "shared_expert_size": 24,
            }
        ),
    }
)
MOE_FAMILIES = pytest.mark.parametrize(
    "shape", [QWEN3_MOE, QWEN2_MOE], ids=["qwen3moe", "qwen2moe"]
)


def random_moe_hf(shape: ModelShape) -> dict[str, torch.Tensor]:
    """A dense checkpoint of ``shape`` with each MoE layer's MLP replaced by its experts."""
    g = torch.Generator().manual_seed(1)
    hf = random_hf(shape)
    h, moe = shape.hidden_size, shape.moe
    for layer in moe.layers:
        p = f"model.layers.{layer}.mlp."
        for part in ("gate_proj", "up_proj", "down_proj"):
            del hf[f"{p}{part}.weight"]
        hf[p + "gate.weight"] = torch.randn(moe.num_experts, h, generator=g)
        for e in range(moe.num_experts):
            hf[f"{p}experts.{e}.gate_proj.weight"] = torch.randn(
                moe.ffn_hidden_size, h, generator=g
            )
            hf[f"{p}experts.{e}.up_proj.weight"] = torch.randn(moe.ffn_hidden_size, h, generator=g)
            hf[f"{p}experts.{e}.down_proj.weight"] = torch.randn(
                h, moe.ffn_hidden_size, generator=g
            )
        if moe.shared_expert_size:
            size = moe.shared_expert_size
            hf[p + "shared_expert.gate_proj.weight"] = torch.randn(size, h, generator=g)
            hf[p + "shared_expert.up_proj.weight"] = torch.randn(size, h, generator=g)
            hf[p + "shared_expert.down_proj.weight"] = torch.randn(h, size, generator=g)
            hf[p + "shared_expert_gate.weight"] = torch.randn(1, h, generator=g)
    return hf


def export(shape, hf, tp_size, pp_size, ep_size, fused=False) -> dict[str, torch.Tensor]:
    """HF tensors back from every (PP, EP) source's TP-gathered shards; replicated (non-expert)
    tensors must agree across EP ranks."""
    back: dict[str, torch.Tensor] = {}
    for pp in range(pp_size):
        offset = stage_layers(shape, pp, pp_size).start
        for ep in range(ep_size):
            shards = [
                hf_to_megatron(
                    hf,
                    shape,
                    tp_rank=r,
                    tp_size=tp_size,
                    pp_rank=pp,
                    pp_size=pp_size,
                    ep_rank=ep,
                    ep_size=ep_size,
                )
                for r in range(tp_size)
            ]
            experts = local_experts(shape, ep, ep_size)
            for name in shards[0]:
                dim = tp_split_dim(name)
                full = shards[0][name] if dim is None else torch.cat([s[name] for s in shards], dim)
                for hf_name, tensor in megatron_to_hf(
                    name,
                    full,
                    shape,
                    tp_size=tp_size,
                    layer_offset=offset,
                    expert_offset=experts.start,
                    fused=fused,
                ):
                    assert hf_name not in back or torch.equal(back[hf_name], tensor), hf_name
                    back[hf_name] = tensor
    return back


@MOE_FAMILIES
@pytest.mark.parametrize(
    ("tp_size", "pp_size", "ep_size"), [(1, 1, 1), (1, 1, 2), (2, 1, 1), (2, 2, 2), (1, 2, 4)]
)
def test_round_trip_through_every_shard(shape, tp_size, pp_size, ep_size):
    hf = random_moe_hf(shape)
    check_checkpoint(hf, shape)
    back = export(shape, hf, tp_size, pp_size, ep_size)
    assert back.keys() == hf.keys()
    for name, tensor in hf.items():
        assert torch.equal(back[name], tensor), name


@MOE_FAMILIES
@pytest.mark.parametrize("tp_size", [1, 2])
def test_fused_export_is_the_engines_stacked_expert_layout(shape, tp_size):
    hf = random_moe_hf(shape)
    exported = export(shape, hf, tp_size, 1, 2, fused=True)
    expected = fuse_for_engine(hf)
    assert exported.keys() == expected.keys()
    assert all(torch.equal(exported[n], expected[n]) for n in expected)
    w13 = expected["model.layers.1.mlp.experts.w13_weight[3]"]
    assert torch.equal(
        w13[: MOE.ffn_hidden_size], hf["model.layers.1.mlp.experts.3.gate_proj.weight"]
    )


def test_each_ep_rank_holds_its_own_block_of_experts():
    hf = random_moe_hf(QWEN3_MOE)
    second = hf_to_megatron(hf, QWEN3_MOE, tp_rank=0, tp_size=1, ep_rank=1, ep_size=2)
    local = second["decoder.layers.1.mlp.experts.local_experts.0.linear_fc2.weight"]
    assert torch.equal(local, hf["model.layers.1.mlp.experts.2.down_proj.weight"])
    assert "decoder.layers.1.mlp.experts.local_experts.2.linear_fc2.weight" not in second
    assert "decoder.layers.0.mlp.linear_fc1.weight" in second  # layer 0 is dense
    ((name, _),) = megatron_to_hf(
        "decoder.layers.1.mlp.experts.local_experts.1.linear_fc2.weight",
        local,
        QWEN3_MOE,
        tp_size=1,
        layer_offset=0,
        expert_offset=2,
    )
    assert name == "model.layers.1.mlp.experts.3.down_proj.weight"


def test_moe_shapes_from_their_configs():
    moe = {"num_local_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 16}
    qwen3 = ModelShape.from_hf_config(
        hf_config(
            architectures=["Qwen3MoeForCausalLM"],
            num_hidden_layers=4,
            mlp_only_layers=[0],
            decoder_sparse_step=1,
            norm_topk_prob=True,
            **moe,
        )
    )
    assert (qwen3.qk_norm, qwen3.qkv_bias, qwen3.moe.layers, qwen3.moe.num_experts) == (
        True,
        False,
        (1, 2, 3),
        8,
    )
    qwen2 = ModelShape.from_hf_config(
        hf_config(
            architectures=["Qwen2MoeForCausalLM"],
            num_hidden_layers=4,
            decoder_sparse_step=2,
            shared_expert_intermediate_size=32,
            num_experts=8,
            **{k: v for k, v in moe.items() if k != "num_local_experts"},
        )
    )
    assert (
        qwen2.qkv_bias,
        qwen2.moe.layers,
        qwen2.moe.shared_expert_size,
        qwen2.moe.norm_topk_prob,
    ) == (True, (1, 3), 32, False)
