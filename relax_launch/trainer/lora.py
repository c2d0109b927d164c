"""LoRA on Megatron's parallel linears, tensor-parallel aware.

Each targeted linear keeps its frozen weight W and gains two parameters, ``lora_a`` (r x in) and
``lora_b`` (out x r), and a forward hook that adds scale·B(A(dropout(x))) to its output. Under
tensor parallelism an adapter is split like its layer:

- column-parallel (``linear_qkv``, ``linear_fc1``: output rows sharded): A is whole on every
  rank, B holds this rank's rows; the rank-r activation is copied into the tensor-parallel region
  (its gradient all-reduced, so every rank's A gets the whole gradient);
- row-parallel (``linear_proj``, ``linear_fc2``: input columns sharded): A holds this rank's
  columns, B is whole; the partial rank-r activations are summed over the ranks.

A shard merges on its own (W_shard + scale·B_shard·A_shard) in both cases, which is how the
weight sync and the export see a LoRA model: as its merged weights. A starts Kaiming-uniform
(drawn whole from a seed of the layer's name, then split: every TP size starts alike), B at
zero, so training starts from the base model.
"""

from __future__ import annotations

import contextlib
import math
import zlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F

from relax_launch.trainer.config import LoraConfig
from relax_launch.trainer.hf_conversion import megatron_to_hf
from relax_launch.trainer.model_shape import ModelShape

COLUMN, ROW = "column", "row"
SPLIT = {"linear_qkv": COLUMN, "linear_fc1": COLUMN, "linear_proj": ROW, "linear_fc2": ROW}
PARAMS = ("lora_a", "lora_b")
PEFT_PREFIX = "base_model.model."


def is_adapter(name: str) -> bool:
    """Whether a parameter name is an adapter's (``...linear_qkv.lora_a``)."""
    return name.rsplit(".", 1)[-1] in PARAMS


class Adapter:
    """The forward hook of one targeted linear: adds scale·B(A(dropout(x))) to its output."""

    def __init__(self, split: str, scale: float, dropout: float, tp_group: Any) -> None:
        self.split, self.scale, self.dropout, self.tp_group = split, scale, dropout, tp_group
        self.enabled = True

    def __call__(self, module: Any, args: tuple, output: tuple) -> tuple:
        if not self.enabled:
            return output
        from megatron.core.tensor_parallel import (
            copy_to_tensor_model_parallel_region,
            reduce_from_tensor_model_parallel_region,
        )

        out, bias = output
        x = F.dropout(args[0], self.dropout, module.training)
        low = F.linear(x, module.lora_a)
        if self.split == COLUMN:  # whole A on every rank: sum its gradient over the ranks
            low = copy_to_tensor_model_parallel_region(low, group=self.tp_group)
        else:  # each rank's A sees its input columns: sum the partial products
            low = reduce_from_tensor_model_parallel_region(low, group=self.tp_group)
        return out + self.scale * F.linear(low, module.lora_b), bias


def apply_lora(
    module: Any, config: LoraConfig, tp_group: Any, layer_offset: int, seed: int
) -> dict[str, Any]:
    """Freeze every parameter of the GPTModel ``module`` and add adapters to the targeted
    linears; returns ``targets_of(module)``."""
    from megatron.core.tensor_parallel import set_tensor_model_parallel_attributes

    module.requires_grad_(False)
    tp_size, tp_rank = tp_group.size(), tp_group.rank()
    for name, linear in module.named_modules():
        kind = name.rsplit(".", 1)[-1]
        if kind not in config.target_modules:
            continue
        weight = linear.weight
        split = SPLIT[kind]
        in_features = weight.shape[1] * (tp_size if split == ROW else 1)
        a = initial_a(config.rank, in_features, f"{seed}:{global_name(name, layer_offset)}")
        if split == ROW:
            a = a.chunk(tp_size, dim=1)[tp_rank]
        b = torch.zeros(weight.shape[0], config.rank)
        options = {"dtype": weight.dtype, "device": weight.device}
        linear.register_parameter("lora_a", torch.nn.Parameter(a.to(**options).contiguous()))
        linear.register_parameter("lora_b", torch.nn.Parameter(b.to(**options)))
        sharded = linear.lora_a if split == ROW else linear.lora_b
        set_tensor_model_parallel_attributes(sharded, True, 1 if split == ROW else 0, 1)
        linear.lora_adapter = Adapter(split, config.scale, config.dropout, tp_group)
        linear.register_forward_hook(linear.lora_adapter)
    return targets_of(module)


def targets_of(module: Any) -> dict[str, Any]:
    """{weight name: linear} of every linear of ``module`` that carries an adapter."""
    return {
        f"{name}.weight": linear
        for name, linear in module.named_modules()
        if hasattr(linear, "lora_adapter")
    }


def global_name(name: str, layer_offset: int) -> str:
    """``decoder.layers.{local}...`` with the model's global layer index."""
    parts = name.split(".")
    if len(parts) > 2 and parts[:2] == ["decoder", "layers"]:
        parts[2] = str(int(parts[2]) + layer_offset)
    return ".".join(parts)


def initial_a(rank: int, in_features: int, key: str) -> torch.Tensor:
    """A's start: Kaiming-uniform (PEFT's), from a generator seeded by ``key``."""
    generator = torch.Generator().manual_seed(zlib.crc32(key.encode()))
    bound = 1.0 / math.sqrt(in_features)  # kaiming_uniform_ with a=sqrt(5)
    return (torch.rand(rank, in_features, generator=generator) * 2 - 1) * bound


def merged(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """One shard's W + scale·BA, summed in fp32, in W's dtype."""
    return (weight.float() + scale * (b.float() @ a.float())).to(weight.dtype)


@contextlib.contextmanager
def adapters_off(targets: dict[str, Any]) -> Iterator[None]:
    """The base model: every adapter skipped (the reference policy of a LoRA run)."""
    for linear in targets.values():
        linear.lora_adapter.enabled = False
    try:
        yield
    finally:
        for linear in targets.values():
            linear.lora_adapter.enabled = True


def peft_tensors(
    linear: str,
    a: torch.Tensor,
    b: torch.Tensor,
    shape: ModelShape,
    tp_size: int,
    layer_offset: int,
) -> Iterator[tuple[str, torch.Tensor]]:
    """One linear's adapter (A and B whole over TP; B's rows in the gathered weight's layout)
    under PEFT's names: a fused q/k/v or gate/up adapter becomes one per projection, each with
    the shared A and its rows of B (the same product)."""
    for hf_name, rows in megatron_to_hf(
        f"{linear}.weight", b, shape, tp_size=tp_size, layer_offset=layer_offset
    ):
        stem = PEFT_PREFIX + hf_name.removesuffix(".weight")
        yield f"{stem}.lora_A.weight", a.clone()
        yield f"{stem}.lora_B.weight", rows


def peft_config(config: LoraConfig, base_model: str) -> dict[str, Any]:
    """PEFT's ``adapter_config.json`` for adapters of ``config`` on ``base_model``."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": config.rank,
        "lora_alpha": config.alpha or config.rank,
        "lora_dropout": config.dropout,
        "target_modules": config.hf_target_modules,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "inference_mode": True,
        "init_lora_weights": True,
    }
