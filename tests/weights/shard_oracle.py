"""What SGLang's own ``weight_loader`` puts into each TP rank's parameter, for
``test_engine_shards.py``: run in a process of its own (SGLang's CPU engine is chosen at its
import), it builds each layer as TP rank k of ``tp_size`` would (SGLang's parallel context
overridden, no process group), loads whole checkpoint tensors through the layer's loader and
saves every rank's parameter to the file named by its argument."""

from __future__ import annotations

import sys

import torch

from relax_launch import platform

sys.path.insert(0, str(platform.STAND_INS_DIR))  # SGLang's imports on the CPU


def qkv(heads: int, kv_heads: int, head_dim: int, bias: bool, whole: dict) -> dict:
    from sglang.srt.layers.linear import QKVParallelLinear

    layer = QKVParallelLinear(64, head_dim, heads, kv_heads, bias=bias, params_dtype=torch.float32)
    out = {}
    for kind, suffix in (("weight", ""), ("bias", "b")) if bias else (("weight", ""),):
        param = getattr(layer, kind)
        for shard in "qkv":
            param.weight_loader(param, whole[shard + suffix], shard)
        out[kind] = param.data.clone()
    return out


def gate_up(size: int, whole: dict) -> dict:
    from sglang.srt.layers.linear import MergedColumnParallelLinear

    layer = MergedColumnParallelLinear(64, [size, size], bias=False, params_dtype=torch.float32)
    layer.weight.weight_loader(layer.weight, whole["gate"], 0)
    layer.weight.weight_loader(layer.weight, whole["up"], 1)
    return {"weight": layer.weight.data.clone()}


def down(size: int, whole: dict) -> dict:
    from sglang.srt.layers.linear import RowParallelLinear

    layer = RowParallelLinear(size, 64, bias=False, params_dtype=torch.float32)
    layer.weight.weight_loader(layer.weight, whole["down"])
    return {"weight": layer.weight.data.clone()}


def vocab(vocab_size: int, whole: dict) -> dict:
    from sglang.srt.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    out = {}
    for name, kind in (("embed", VocabParallelEmbedding), ("head", ParallelLMHead)):
        layer = kind(vocab_size, 64, params_dtype=torch.float32)
        layer.weight.weight_loader(layer.weight, whole["embed"])
        out[name] = layer.weight.data.clone()
    return out


def experts(size: int, whole: dict) -> dict:
    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE

    layer = FusedMoE(2, 64, size, layer_id=0, top_k=1, params_dtype=torch.float32)
    for e in range(2):
        for shard, part in (("w1", "gate"), ("w3", "up")):
            layer.weight_loader(layer.w13_weight, whole[part][e], "w13_weight", shard, e)
        layer.weight_loader(layer.w2_weight, whole["down"][e], "w2_weight", "w2", e)
    return {"w13": layer.w13_weight.data.clone(), "w2": layer.w2_weight.data.clone()}


def main(cases_path: str, out_path: str, model: str) -> None:
    from sglang.srt.runtime_context import get_parallel, publish
    from sglang.srt.server_args import ServerArgs

    cases = torch.load(cases_path)
    results = {}
    for name, (layer, args, whole, tp_size) in cases.items():
        # an engine of tp_size ranks (the MoE layer reads the published configuration)
        publish(ServerArgs(model_path=model, device="cpu", tp_size=tp_size), role="oracle")
        for rank in range(tp_size):
            values = {"tp_rank": rank, "attn_tp_rank": rank, "moe_tp_rank": rank}
            with get_parallel().override(**values, moe_ep_rank=0):
                results[name, rank] = globals()[layer](*args, whole)
    torch.save(results, out_path)


if __name__ == "__main__":
    main(*sys.argv[1:])
