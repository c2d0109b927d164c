"""Hugging Face Llama/Qwen2/Qwen3 <-> Megatron-core GPT parameter conversion, shard by shard.

Megatron fuses q/k/v into ``linear_qkv`` grouped per key/value head ([q heads of group, k, v] for
each group) and gate/up into ``linear_fc1``, and shards along the vocabulary (embeddings, output
layer), the fused output rows (qkv, fc1) or the input columns (proj, fc2). Tensor-parallel shards
of the grouped qkv split along whole groups, and each fc1 shard is [gate shard; up shard].
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from relax_launch.models.registry import rope_type, trainable_problem


@dataclass(frozen=True)
class ModelShape:
    """The architecture facts the conversion and the Megatron config need.

    One decoder family covers Llama (1-3), Qwen2/Qwen2.5 (q/k/v biases) and Qwen3 (q/k RMSNorm
    over each head, ``head_dim`` free of hidden / heads).
    """

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    tie_embeddings: bool
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    qkv_bias: bool = False
    qk_norm: bool = False
    rope_type: str = "default"

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> ModelShape:
        """The shape of a Hugging Face config.json; refuses what the conversion cannot map."""
        problem = trainable_problem(cfg)
        if problem:
            raise ValueError(problem)
        heads = cfg["num_attention_heads"]
        rope = cfg.get("rope_parameters") or {}
        architecture = cfg["architectures"][0]
        return cls(
            num_layers=cfg["num_hidden_layers"],
            hidden_size=cfg["hidden_size"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            ffn_hidden_size=cfg["intermediate_size"],
            vocab_size=cfg["vocab_size"],
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=rope.get("rope_theta", cfg.get("rope_theta", 10000.0)),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            qkv_bias=architecture == "Qwen2ForCausalLM",
            qk_norm=architecture == "Qwen3ForCausalLM",
            rope_type=rope_type(cfg),
        )


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
_TOP_PARAMS = {
    "embedding.word_embeddings.weight": ("model.embed_tokens.weight", 0),
    "decoder.final_layernorm.weight": ("model.norm.weight", None),
    "output_layer.weight": ("lm_head.weight", 0),
}


def _layer_params(shape: ModelShape) -> dict[str, tuple[str | None, int | None]]:
    """The per-layer parameters a model of ``shape`` has."""
    absent = set()
    if not shape.qkv_bias:
        absent.add("self_attention.linear_qkv.bias")
    if not shape.qk_norm:
        absent |= {"self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight"}
    return {k: v for k, v in _LAYER_PARAMS.items() if k not in absent}


def hf_names(shape: ModelShape) -> set[str]:
    """Every tensor name a Hugging Face checkpoint of ``shape`` holds (and the load consumes)."""
    per_layer = ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"]
    per_layer += ["mlp.gate_proj.weight", "mlp.up_proj.weight"]
    if shape.qkv_bias:
        per_layer += ["self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"]
    per_layer += [hf for hf, _ in _layer_params(shape).values() if hf is not None]
    names = {f"model.layers.{i}.{s}" for i in range(shape.num_layers) for s in per_layer}
    names |= {"model.embed_tokens.weight", "model.norm.weight"}
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
    return _LAYER_PARAMS[megatron_name.split(".", 3)[3]][1]


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
) -> dict[str, torch.Tensor]:
    """The Megatron state dict (local layer numbering) of one TP rank of one PP stage."""
    out: dict[str, torch.Tensor] = {}

    def shard(tensor: torch.Tensor, dim: int | None) -> torch.Tensor:
        return tensor if dim is None else tensor.chunk(tp_size, dim=dim)[tp_rank].contiguous()

    for local, layer in enumerate(stage_layers(shape, pp_rank, pp_size)):
        src, dst = f"model.layers.{layer}.", f"decoder.layers.{local}."
        for kind in ("weight", "bias") if shape.qkv_bias else ("weight",):
            q, k, v = (hf[f"{src}self_attn.{p}_proj.{kind}"] for p in "qkv")
            out[f"{dst}self_attention.linear_qkv.{kind}"] = shard(_fuse_qkv(shape, q, k, v), 0)
        gate, up = hf[src + "mlp.gate_proj.weight"], hf[src + "mlp.up_proj.weight"]
        out[dst + "mlp.linear_fc1.weight"] = torch.cat([shard(gate, 0), shard(up, 0)])
        for name, (hf_suffix, dim) in _layer_params(shape).items():
            if hf_suffix is not None:
                out[dst + name] = shard(hf[src + hf_suffix], dim)
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
) -> Iterator[tuple[str, torch.Tensor]]:
    """HF (name, tensor) pairs of one TP-gathered Megatron parameter of a PP stage.

    ``full`` is the concatenation of the TP shards along ``tp_split_dim(name)``. With ``fused``,
    q/k/v and gate/up come as the serving engine's fused parameters (``qkv_proj`` = [q; k; v],
    ``gate_up_proj`` = [gate; up]), the layout an engine with one TP rank holds, so it can
    receive them in place; with a single trainer TP rank, ``gate_up_proj`` is ``full`` itself.
    """
    if name in _TOP_PARAMS:
        if not (name == "output_layer.weight" and shape.tie_embeddings):
            yield _TOP_PARAMS[name][0], full
        return
    _, _, local, suffix = name.split(".", 3)
    prefix = f"model.layers.{int(local) + layer_offset}."
    if suffix.startswith("self_attention.linear_qkv."):
        kind = suffix.rsplit(".", 1)[1]  # weight or bias
        q, k, v = _unfuse_qkv(shape, full)
        if fused:
            yield f"{prefix}self_attn.qkv_proj.{kind}", torch.cat([q, k, v])
            return
        for part, tensor in zip("qkv", (q, k, v), strict=True):
            yield f"{prefix}self_attn.{part}_proj.{kind}", tensor
    elif suffix == "mlp.linear_fc1.weight":
        halves = full.view(tp_size, 2, -1, full.shape[-1])
        gate = halves[:, 0].reshape(-1, full.shape[-1])
        up = halves[:, 1].reshape(-1, full.shape[-1])
        if fused:
            yield (
                prefix + "mlp.gate_up_proj.weight",
                full if tp_size == 1 else torch.cat([gate, up]),
            )
            return
        yield prefix + "mlp.gate_proj.weight", gate
        yield prefix + "mlp.up_proj.weight", up
    else:
        yield prefix + _LAYER_PARAMS[suffix][0], full


def fuse_for_engine(hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF tensors in the layout a one-rank SGLang engine holds (``qkv_proj`` weight and bias,
    ``gate_up_proj``): what ``megatron_to_hf(fused=True)`` yields, from an HF state dict."""
    out = {}
    for name, tensor in hf.items():
        base, _, kind = name.rpartition(".")
        if base.endswith("q_proj"):
            stem = base.removesuffix("q_proj")
            out[f"{stem}qkv_proj.{kind}"] = torch.cat([hf[f"{stem}{p}_proj.{kind}"] for p in "qkv"])
        elif base.endswith("gate_proj"):
            stem = base.removesuffix("gate_proj")
            out[f"{stem}gate_up_proj.{kind}"] = torch.cat([tensor, hf[f"{stem}up_proj.{kind}"]])
        elif not base.endswith(("k_proj", "v_proj", "up_proj")):
            out[name] = tensor
    return out
