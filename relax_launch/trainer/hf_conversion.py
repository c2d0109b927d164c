"""Hugging Face Llama/Qwen2/Qwen3 (dense and MoE) <-> Megatron-core GPT parameter conversion,
shard by shard.

Megatron fuses q/k/v into ``linear_qkv`` grouped per key/value head ([q heads of group, k, v] for
each group) and gate/up into ``linear_fc1``, and shards along the vocabulary (embeddings, output
layer), the fused output rows (qkv, fc1) or the input columns (proj, fc2). Tensor-parallel shards
of the grouped qkv split along whole groups, and each fc1 shard is [gate shard; up shard].

A mixture-of-experts layer has a router (HF ``mlp.gate``), its experts (each an fc1/fc2 pair,
split over TP like a dense MLP; expert parallelism gives each EP rank a contiguous block of
experts, numbered from 0 on every rank) and, in Qwen2-MoE, a shared expert with a sigmoid gate.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import torch

from relax_launch.trainer.model_shape import ModelShape

# Megatron parameter suffix -> (HF suffix or None when fused, TP split dim or None if replicated)
_LAYER_PARAMS = {
    "input_layernorm.weight": ("input_layernorm.weight", None),
    "self_attention.linear_qkv.weight": (None, 0),
    "self_attention.linear_qkv.bias": (None, 0),  # qkv_bias
    "self_attention.q_layernorm.weight": ("self_attn.q_norm.weight", None),  # qk_norm
    "self_attention.k_layernorm.weight": ("self_attn.k_norm.weight", None),  # qk_norm
    "self_attention.linear_proj.weight": ("self_attn.o_proj.weight", 1),
    "pre_mlp_layernorm.weight": ("post_attention_layernorm.weight", None),
    "mlp.linear_fc1.weight": (None, 0),
    "mlp.linear_fc2.weight": ("mlp.down_proj.weight", 1),
}
# ... of a MoE layer, in place of the dense mlp.*; "*" stands for the local expert's index
_MOE_PARAMS = {
    "mlp.router.weight": ("mlp.gate.weight", None),
    "mlp.experts.local_experts.*.linear_fc1.weight": (None, 0),
    "mlp.experts.local_experts.*.linear_fc2.weight": ("mlp.experts.*.down_proj.weight", 1),
}
_SHARED_EXPERT_PARAMS = {
    "mlp.shared_experts.linear_fc1.weight": (None, 0),
    "mlp.shared_experts.linear_fc2.weight": ("mlp.shared_expert.down_proj.weight", 1),
    "mlp.shared_experts.gate_weight": ("mlp.shared_expert_gate.weight", None),
}
_ANY_LAYER_PARAMS = {**_LAYER_PARAMS, **_MOE_PARAMS, **_SHARED_EXPERT_PARAMS}
_EXPERT_INDEX = re.compile(r"(?<=local_experts\.)(\d+)(?=\.)")  # in a Megatron name
_TOP_PARAMS = {
    "embedding.word_embeddings.weight": ("model.embed_tokens.weight", 0),
    "decoder.final_layernorm.weight": ("model.norm.weight", None),
    "output_layer.weight": ("lm_head.weight", 0),
}


def _layer_params(shape: ModelShape, layer: int = -1) -> dict[str, tuple[str | None, int | None]]:
    """The per-layer parameters of global layer ``layer`` (-1: a dense layer) of ``shape``."""
    absent = set()
    if not shape.qkv_bias:
        absent.add("self_attention.linear_qkv.bias")
    if not shape.qk_norm:
        absent |= {"self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight"}
    params = {k: v for k, v in _LAYER_PARAMS.items() if k not in absent}
    if shape.is_moe_layer(layer):
        params = {k: v for k, v in params.items() if not k.startswith("mlp.")} | _MOE_PARAMS
        if shape.moe.shared_expert_size:
            params |= _SHARED_EXPERT_PARAMS
    return params


def _expand_experts(suffixes: list[str], num_experts: int) -> list[str]:
    """Suffixes with "*" written out for each expert."""
    return [
        s.replace("*", str(e)) for s in suffixes for e in (range(num_experts) if "*" in s else [0])
    ]


def hf_names(shape: ModelShape) -> set[str]:
    """Every tensor name a Hugging Face checkpoint of ``shape`` holds (and the load consumes)."""
    names = {"model.embed_tokens.weight", "model.norm.weight"}
    for layer in range(shape.num_layers):
        kinds = ("weight", "bias") if shape.qkv_bias else ("weight",)
        per_layer = [f"self_attn.{p}_proj.{kind}" for p in "qkv" for kind in kinds]
        params = _layer_params(shape, layer)
        per_layer += [hf for hf, _ in params.values() if hf is not None]
        if shape.is_moe_layer(layer):
            per_layer += ["mlp.experts.*.gate_proj.weight", "mlp.experts.*.up_proj.weight"]
            if shape.moe.shared_expert_size:
                per_layer += [f"mlp.shared_expert.{p}_proj.weight" for p in ("gate", "up")]
            per_layer = _expand_experts(per_layer, shape.moe.num_experts)
        else:
            per_layer += ["mlp.gate_proj.weight", "mlp.up_proj.weight"]
        names |= {f"model.layers.{layer}.{s}" for s in per_layer}
    return names if shape.tie_embeddings else names | {"lm_head.weight"}


def check_checkpoint(hf: dict[str, torch.Tensor], shape: ModelShape) -> None:
    """Refuse a checkpoint that does not hold exactly the tensors of ``shape``: a key the
    conversion would not read is a part of the model that would silently be dropped."""
    expected = hf_names(shape)
    unread = set(hf) - expected
    if shape.tie_embeddings and "lm_head.weight" in unread:  # a tied copy some checkpoints keep
        if torch.equal(hf["lm_head.weight"], hf["model.embed_tokens.weight"]):
            unread.discard("lm_head.weight")
    missing = expected - set(hf)
    if unread or missing:
        raise ValueError(
            f"the checkpoint does not match its config.json: unread keys {sorted(unread)[:6]}, "
            f"missing keys {sorted(missing)[:6]} ({len(unread)} and {len(missing)} in all); "
            "the config's architecture and flags must describe every tensor"
        )


def tp_split_dim(megatron_name: str) -> int | None:
    """The dimension along which a Megatron parameter is sharded over tensor parallelism."""
    if megatron_name in _TOP_PARAMS:
        return _TOP_PARAMS[megatron_name][1]
    suffix = _EXPERT_INDEX.sub("*", megatron_name.split(".", 3)[3])
    return _ANY_LAYER_PARAMS[suffix][1]


def is_expert(megatron_name: str) -> bool:
    """A routed expert's parameter: held by one expert-parallel rank, not replicated."""
    return ".mlp.experts." in megatron_name


def local_experts(shape: ModelShape, ep_rank: int, ep_size: int) -> range:
    """Global indices of the routed experts held by expert-parallel rank ``ep_rank``."""
    per_rank = shape.moe.num_experts // ep_size if shape.moe is not None else 0
    return range(ep_rank * per_rank, (ep_rank + 1) * per_rank)


def stage_layers(shape: ModelShape, pp_rank: int, pp_size: int) -> range:
    """Global layer indices held by pipeline stage ``pp_rank`` (layers split evenly)."""
    per_stage = shape.num_layers // pp_size
    return range(pp_rank * per_stage, (pp_rank + 1) * per_stage)


def _fuse_qkv(shape: ModelShape, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Megatron's grouped q/k/v rows (weights [rows, hidden] or biases [rows])."""
    groups, hd = shape.num_kv_heads, shape.head_dim
    per_group = shape.num_heads // groups
    rest = q.shape[1:]
    fused = torch.cat(
        [
            q.view(groups, per_group, hd, *rest),
            k.view(groups, 1, hd, *rest),
            v.view(groups, 1, hd, *rest),
        ],
        dim=1,
    )
    return fused.reshape(-1, *rest)


def _unfuse_qkv(shape: ModelShape, qkv: torch.Tensor) -> tuple[torch.Tensor, ...]:
    groups, hd = shape.num_kv_heads, shape.head_dim
    per_group = shape.num_heads // groups
    rest = qkv.shape[1:]
    grouped = qkv.view(groups, per_group + 2, hd, *rest)
    q = grouped[:, :per_group].reshape(-1, *rest)
    k, v = grouped[:, per_group].reshape(-1, *rest), grouped[:, per_group + 1].reshape(-1, *rest)
    return q, k, v


def hf_to_megatron(
    hf: dict[str, torch.Tensor],
    shape: ModelShape,
    *,
    tp_rank: int,
    tp_size: int,
    pp_rank: int = 0,
    pp_size: int = 1,
    ep_rank: int = 0,
    ep_size: int = 1,
) -> dict[str, torch.Tensor]:
    """The Megatron state dict (local layer and expert numbering) of one TP rank of one PP
    stage, holding the experts of EP rank ``ep_rank``."""
    out: dict[str, torch.Tensor] = {}

    def shard(tensor: torch.Tensor, dim: int | None) -> torch.Tensor:
        return tensor if dim is None else tensor.chunk(tp_size, dim=dim)[tp_rank].contiguous()

    def fc1(stem: str) -> torch.Tensor:
        gate, up = hf[stem + "gate_proj.weight"], hf[stem + "up_proj.weight"]
        return torch.cat([shard(gate, 0), shard(up, 0)])

    experts = local_experts(shape, ep_rank, ep_size)
    for local, layer in enumerate(stage_layers(shape, pp_rank, pp_size)):
        src, dst = f"model.layers.{layer}.", f"decoder.layers.{local}."
        for kind in ("weight", "bias") if shape.qkv_bias else ("weight",):
            q, k, v = (hf[f"{src}self_attn.{p}_proj.{kind}"] for p in "qkv")
            out[f"{dst}self_attention.linear_qkv.{kind}"] = shard(_fuse_qkv(shape, q, k, v), 0)
        if not shape.is_moe_layer(layer):
            out[dst + "mlp.linear_fc1.weight"] = fc1(src + "mlp.")
        else:
            for i, expert in enumerate(experts):
                out[f"{dst}mlp.experts.local_experts.{i}.linear_fc1.weight"] = fc1(
                    f"{src}mlp.experts.{expert}."
                )
            if shape.moe.shared_expert_size:
                out[dst + "mlp.shared_experts.linear_fc1.weight"] = fc1(src + "mlp.shared_expert.")
        for name, (hf_suffix, dim) in _layer_params(shape, layer).items():
            if hf_suffix is None:
                continue
            for i, expert in enumerate(experts if "*" in name else [None]):
                local_name = name.replace("*", str(i))
                out[dst + local_name] = shard(hf[src + hf_suffix.replace("*", str(expert))], dim)
    if pp_rank == 0:
        out["embedding.word_embeddings.weight"] = shard(hf["model.embed_tokens.weight"], 0)
    if pp_rank == pp_size - 1:
        out["decoder.final_layernorm.weight"] = hf["model.norm.weight"]
        if not shape.tie_embeddings:
            out["output_layer.weight"] = shard(hf["lm_head.weight"], 0)
        elif pp_size > 1:  # tied, but the last stage keeps its own copy of the embeddings
            out["output_layer.weight"] = shard(hf["model.embed_tokens.weight"], 0)
    return out


def megatron_to_hf(
    name: str,
    full: torch.Tensor,
    shape: ModelShape,
    *,
    tp_size: int,
    layer_offset: int,
    fused: bool = False,
    expert_offset: int = 0,
) -> Iterator[tuple[str, torch.Tensor]]:
    """HF (name, tensor) pairs of one TP-gathered Megatron parameter of a PP stage.

    ``full`` is the concatenation of the TP shards along ``tp_split_dim(name)``;
    ``expert_offset`` is the global index of this rank's local expert 0. With ``fused``, the
    tensors come in the layout a serving engine with one TP rank holds, so it can receive them
    in place: q/k/v and gate/up as ``qkv_proj`` = [q; k; v] and ``gate_up_proj`` = [gate; up]
    (with a single trainer TP rank, ``full`` itself), and a routed expert as its slice of the
    layer's stacked experts: ``experts.w13_weight[e]`` = [gate; up], ``experts.w2_weight[e]``.
    """
    if name in _TOP_PARAMS:
        if not (name == "output_layer.weight" and shape.tie_embeddings):
            yield _TOP_PARAMS[name][0], full
        return
    _, _, local, suffix = name.split(".", 3)
    prefix = f"model.layers.{int(local) + layer_offset}."
    expert = _EXPERT_INDEX.search(suffix)
    if expert is not None:
        index = int(expert.group(1)) + expert_offset
        suffix = _EXPERT_INDEX.sub("*", suffix)
        prefix += "mlp.experts."
        if fused:
            if suffix.endswith("linear_fc1.weight"):
                yield f"{prefix}w13_weight[{index}]", _gate_up(full, tp_size, fused=True)
            else:
                yield f"{prefix}w2_weight[{index}]", full
            return
        prefix += f"{index}."
    if suffix.startswith("self_attention.linear_qkv."):
        kind = suffix.rsplit(".", 1)[1]  # weight or bias
        q, k, v = _unfuse_qkv(shape, full)
        if fused:
            yield f"{prefix}self_attn.qkv_proj.{kind}", torch.cat([q, k, v])
            return
        for part, tensor in zip("qkv", (q, k, v), strict=True):
            yield f"{prefix}self_attn.{part}_proj.{kind}", tensor
    elif suffix.endswith("linear_fc1.weight"):
        stem = _FC1_STEMS[suffix]
        if fused:
            yield f"{prefix}{stem}gate_up_proj.weight", _gate_up(full, tp_size, fused=True)
            return
        gate, up = _gate_up(full, tp_size, fused=False)
        yield f"{prefix}{stem}gate_proj.weight", gate
        yield f"{prefix}{stem}up_proj.weight", up
    else:
        yield prefix + _ANY_LAYER_PARAMS[suffix][0].removeprefix("mlp.experts.*."), full


# the HF stem of each fc1 (gate/up pair); a routed expert's comes after mlp.experts.N.
_FC1_STEMS = {
    "mlp.linear_fc1.weight": "mlp.",
    "mlp.shared_experts.linear_fc1.weight": "mlp.shared_expert.",
    "mlp.experts.local_experts.*.linear_fc1.weight": "",
}


def _gate_up(full: torch.Tensor, tp_size: int, fused: bool) -> Any:
    """An fc1 gathered over TP ([gate shard; up shard] per rank) as [gate; up] (``fused``) or
    the pair (gate, up)."""
    if fused and tp_size == 1:
        return full
    halves = full.view(tp_size, 2, -1, full.shape[-1])
    gate = halves[:, 0].reshape(-1, full.shape[-1])
    up = halves[:, 1].reshape(-1, full.shape[-1])
    return torch.cat([gate, up]) if fused else (gate, up)


def fuse_for_engine(hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF tensors in the layout a one-rank SGLang engine holds (``qkv_proj`` weight and bias,
    ``gate_up_proj``, each routed expert's slice of ``w13_weight``/``w2_weight``): what
    ``megatron_to_hf(fused=True)`` yields, from an HF state dict."""
    out = {}
    for name, tensor in hf.items():
        base, _, kind = name.rpartition(".")
        expert = re.fullmatch(r"(.*\.experts\.)(\d+)\.(gate|down)_proj", base)
        if expert is not None:
            stem, index, part = expert.groups()
            if part == "gate":
                up = hf[f"{stem}{index}.up_proj.weight"]
                out[f"{stem}w13_weight[{index}]"] = torch.cat([tensor, up])
            else:
                out[f"{stem}w2_weight[{index}]"] = tensor
        elif ".experts." in base:
            continue  # an expert's up_proj, in its w13 slice
        elif base.endswith("q_proj"):
            stem = base.removesuffix("q_proj")
            out[f"{stem}qkv_proj.{kind}"] = torch.cat([hf[f"{stem}{p}_proj.{kind}"] for p in "qkv"])
        elif base.endswith("gate_proj"):
            stem = base.removesuffix("gate_proj")
            out[f"{stem}gate_up_proj.{kind}"] = torch.cat([tensor, hf[f"{stem}up_proj.{kind}"]])
        elif not base.endswith(("k_proj", "v_proj", "up_proj")):
            out[name] = tensor
    return out
