"""Build the Megatron-core GPT for a Hugging Face Llama/Qwen checkpoint, load it, and its
optimizer.

Everything takes the trainer's ProcessGroupCollection (``runtime/groups.py``): Megatron's global
``parallel_state`` groups are never initialised, because they would span inference ranks too.
"""

from __future__ import annotations

import contextlib
import copy
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from relax_launch.trainer.attention import CoreAttention, use_position_ids
from relax_launch.trainer.config import TrainerConfig
from relax_launch.trainer.hf_conversion import (
    check_checkpoint,
    hf_to_megatron,
    stage_layers,
)
from relax_launch.trainer.hf_dir import read_weights
from relax_launch.trainer.lora import apply_lora, is_adapter
from relax_launch.trainer.model_shape import ModelShape
from relax_launch.trainer.optimizer_offload import offload_optimizer
from relax_launch.trainer.recompute import inputs_need_grad, recompute_config
from relax_launch.trainer.recompute import install as install_recompute

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def read_shape(model_dir: Path) -> ModelShape:
    """The shape of the HF model in ``model_dir``; a ValueError naming the directory when the
    trainer cannot convert it."""
    try:
        return ModelShape.from_hf_config(json.loads((model_dir / "config.json").read_text()))
    except ValueError as error:
        raise ValueError(f"{model_dir}: {error}") from None


def transformer_config(shape: ModelShape, section: TrainerConfig) -> Any:
    """Megatron's TransformerConfig for a model of ``shape`` under ``section``'s parallelism.

    The loss is per token (``calculate_per_token_loss``): each micro-batch returns its loss sum
    and token count, and the gradients are divided by the global batch's token count, so the
    result does not depend on micro-batching or data parallelism.
    """
    from megatron.core.transformer import TransformerConfig

    dtype = DTYPES[section.dtype]
    config = TransformerConfig(
        num_layers=shape.num_layers,
        hidden_size=shape.hidden_size,
        num_attention_heads=shape.num_heads,
        num_query_groups=shape.num_kv_heads,
        kv_channels=shape.head_dim,
        ffn_hidden_size=shape.ffn_hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=shape.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=shape.qkv_bias,
        qk_layernorm=shape.qk_norm,
        calculate_per_token_loss=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_dropout_fusion=False,
        use_cpu_initialization=True,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        tensor_model_parallel_size=section.tp_size,
        pipeline_model_parallel_size=section.pp_size,
        context_parallel_size=section.cp_size,
        cp_comm_type="all_gather",  # trainer/attention.py's form of it
        # micro-batches differ in shape (token budgets, packed rows): stages exchange shapes
        variable_seq_lengths=section.pp_size > 1,
        moe_token_dispatcher_type="alltoall",  # the one that takes them (a dense model: inert)
        **(moe_config(shape, section) if shape.moe is not None else {}),
        **recompute_config(section.recompute),
    )
    return config


def moe_config(shape: ModelShape, section: TrainerConfig) -> dict[str, Any]:
    """Megatron's MoE fields that compute what the Hugging Face model computes: a softmax router
    in fp32 whose top-k weights are renormalised (``norm_topk_prob``: top-k of the logits, then
    a softmax over them) or not (a softmax over every expert, then top-k), experts as a
    sequence of MLPs (no grouped GEMM, which needs a GPU kernel), Qwen2-MoE's shared expert
    behind its sigmoid gate. The load-balancing loss is off: the policy is trained by the RL
    loss alone, and the step metrics report the balance (``trainer/moe.py``)."""
    moe = shape.moe
    return {
        "num_moe_experts": moe.num_experts,
        "moe_router_topk": moe.topk,
        "moe_ffn_hidden_size": moe.ffn_hidden_size,
        "moe_layer_freq": [int(shape.is_moe_layer(i)) for i in range(shape.num_layers)],
        "moe_router_score_function": "softmax",
        "moe_router_pre_softmax": not moe.norm_topk_prob,
        "moe_router_dtype": "fp32",
        "moe_shared_expert_intermediate_size": moe.shared_expert_size or None,
        "moe_shared_expert_gate": bool(moe.shared_expert_size),
        "moe_grouped_gemm": False,
        "moe_router_load_balancing_type": "none",
        "moe_aux_loss_coeff": 0.0,
        "moe_permute_fusion": False,
        "moe_router_fusion": False,
        "moe_enable_routing_replay": True,  # inert until a batch brings the engine's routing
        "expert_model_parallel_size": section.ep_size,
        "expert_tensor_parallel_size": section.tp_size,
        # Megatron trains MoE layers under TP only with the sequence split over the TP ranks
        "sequence_parallel": section.tp_size > 1,
    }


def build_gpt(
    shape: ModelShape, section: TrainerConfig, pgc: Any, device: str, model_dir: Path
) -> Any:
    """A DDP-wrapped GPTModel for this rank's pipeline stage, on torch ``device``."""
    model = build_gpt_module(shape, section, pgc, device, model_dir)
    if section.lora is not None:  # before DDP, which buckets only the trainable parameters
        offset = stage_layers(shape, pgc.pp.rank(), pgc.pp.size()).start
        apply_lora(model, section.lora, pgc.tp, offset, section.seed)
        if section.recompute == "full":  # the embedding is frozen (see inputs_need_grad)
            inputs_need_grad(model)
    return wrap_ddp(model, section, pgc)


def wrap_ddp(model: Any, section: TrainerConfig, pgc: Any) -> Any:
    """``model`` (its trainable parameters as they are now) under Megatron's DDP."""
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )

    ddp = DistributedDataParallel(
        config=model.config,
        module=model,
        pg_collection=pgc,
        ddp_config=DistributedDataParallelConfig(
            overlap_grad_reduce=False,
            use_distributed_optimizer=section.distributed_optimizer,
            # bf16 gradients summed over many ranks lose the small ones: reduce in fp32.
            grad_reduce_in_fp32=section.dtype == "bfloat16",
        ),
    )
    model.config.finalize_model_grads_func = finalize_model_grads  # DP all-reduce, tied embeddings
    model.config.no_sync_func = ddp.no_sync
    return ddp


def build_gpt_module(
    shape: ModelShape, section: TrainerConfig, pgc: Any, device: str, model_dir: Path
) -> Any:
    """The bare GPTModel of this rank's pipeline stage (no DDP), on torch ``device``."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_decoder_block_spec,
        get_gpt_layer_local_spec,
    )
    from megatron.core.pipeline_parallel.utils import is_pp_first_stage, is_pp_last_stage

    from relax_launch.trainer.cross_entropy import use_exact_cross_entropy

    if parallel_state._GLOBAL_MEMORY_BUFFER is None:  # attention scratch space; no collectives
        parallel_state._set_global_memory_buffer()
    config = transformer_config(shape, section)
    if shape.moe is None:
        spec = get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=shape.qk_norm)
    else:  # MoE and dense layers, per layer (moe_layer_freq), for this stage
        spec = get_gpt_decoder_block_spec(
            config, use_transformer_engine=False, normalization="RMSNorm", pp_rank=pgc.pp.rank()
        )
        if config.sequence_parallel:
            spec = sequence_parallel_norms(spec)
    spec = with_core_attention(spec)
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=shape.vocab_size,
        max_sequence_length=shape.max_position_embeddings,
        position_embedding_type="rope",
        rotary_base=int(shape.rope_theta),
        share_embeddings_and_output_weights=shape.tie_embeddings,
        pre_process=is_pp_first_stage(pgc.pp),
        post_process=is_pp_last_stage(pgc.pp),
        pg_collection=pgc,
    )
    if shape.rope_type != "default":
        model.rotary_pos_emb.inv_freq = scaled_rope_frequencies(model_dir)
    use_position_ids(model)
    use_exact_cross_entropy(model)  # the labels' loss: trainer/cross_entropy.py
    if config.recompute_granularity is not None:
        install_recompute()  # recomputes in its forward's context (positions, routing)
    return model.to(device)  # built on the CPU (use_cpu_initialization)


class SequenceParallelRMSNorm:
    """torch's RMSNorm in a sequence-parallel layer, which Megatron's own torch norm refuses:
    each TP rank normalises its part of the sequence, so the weight is marked for
    ``finalize_model_grads`` to sum its gradient over the TP ranks."""

    def __new__(cls, config: Any, hidden_size: int, eps: float = 1e-5, **_: Any) -> Any:
        norm = torch.nn.RMSNorm(normalized_shape=hidden_size, eps=eps)
        norm.weight.sequence_parallel = True
        return norm


def sequence_parallel_norms(spec: Any) -> Any:
    """A copy of the block ``spec`` with every norm a ``SequenceParallelRMSNorm``."""
    spec = copy.deepcopy(spec)
    spec.layer_norm = SequenceParallelRMSNorm
    for layer in spec.layer_specs:
        layer.submodules.input_layernorm = SequenceParallelRMSNorm
        layer.submodules.pre_mlp_layernorm = SequenceParallelRMSNorm
        attention = layer.submodules.self_attention.submodules
        if getattr(attention.q_layernorm, "__name__", "IdentityOp") != "IdentityOp":
            attention.q_layernorm = attention.k_layernorm = SequenceParallelRMSNorm
    return spec


def with_core_attention(spec: Any) -> Any:
    """A copy of the layer or block ``spec`` whose attention is the trainer's ``CoreAttention``
    (by position ids: padded, packed and context-parallel rows)."""
    spec = copy.deepcopy(spec)
    for layer in getattr(spec, "layer_specs", [spec]):
        layer.submodules.self_attention.submodules.core_attention = CoreAttention
    return spec


def scaled_rope_frequencies(model_dir: Path) -> torch.Tensor:
    """The rotary inverse frequencies of a scaled RoPE (linear, llama3), computed by transformers
    from the model's own config, exactly as the Hugging Face model and the engines use them."""
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = AutoConfig.from_pretrained(model_dir)
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS[config.rope_parameters["rope_type"]](config)
    if attention_factor != 1.0:  # preflight admits only types that leave attention unscaled
        raise ValueError(f"{model_dir}: RoPE attention factor {attention_factor} is not supported")
    return inv_freq.float()


def load_hf_checkpoint(module: Any, model_dir: Path, shape: ModelShape, pgc: Any) -> None:
    """Load this rank's shard of the HF safetensors in ``model_dir`` into the bare GPTModel."""
    hf = read_weights(model_dir)
    try:
        check_checkpoint(hf, shape)
    except ValueError as error:
        raise ValueError(f"{model_dir}: {error}") from None
    shard = hf_to_megatron(
        hf,
        shape,
        tp_rank=pgc.tp.rank(),
        tp_size=pgc.tp.size(),
        pp_rank=pgc.pp.rank(),
        pp_size=pgc.pp.size(),
        ep_rank=pgc.ep.rank() if shape.moe is not None else 0,
        ep_size=pgc.ep.size() if shape.moe is not None else 1,
    )
    params = {k: v for k, v in module.named_parameters() if not is_adapter(k)}
    copy_shard(shard, params, model_dir)


def copy_shard(shard: dict[str, torch.Tensor], params: dict[str, Any], model_dir: Path) -> None:
    """Copy a converted checkpoint shard into the model's parameters of the same names, refusing
    a shard that does not fit them name for name."""
    missing = sorted(set(params) - set(shard))
    unexpected = sorted(set(shard) - set(params))
    if missing or unexpected:
        raise ValueError(
            f"{model_dir}: checkpoint does not fit the model (missing {missing[:4]}, "
            f"unexpected {unexpected[:4]})"
        )
    with torch.no_grad():
        for name, tensor in shard.items():
            params[name].copy_(tensor.to(params[name].dtype))


class WorldOfGroup:
    """``torch.distributed`` with ``group=None`` meaning ``group`` for the two calls Megatron's
    optimizer factory makes without a group; everything else is torch's own."""

    def __init__(self, group: Any) -> None:
        self.group = group

    def get_world_size(self, group: Any = None) -> int:
        return dist.get_world_size(self.group if group is None else group)

    def all_gather_object(self, out: list, obj: Any, group: Any = None) -> None:
        dist.all_gather_object(out, obj, group=self.group if group is None else group)

    def __getattr__(self, name: str) -> Any:
        return getattr(dist, name)


class TorchOfGroup:
    """``torch`` as one module sees it while its ``distributed`` is ``WorldOfGroup``."""

    def __init__(self, group: Any) -> None:
        self.distributed = WorldOfGroup(group)

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


@contextlib.contextmanager
def optimizer_factory_world(group: Any) -> Iterator[None]:
    """While it is open, Megatron's optimizer factory (``megatron.core.optimizer``, and only
    that module) gathers its parameter groups over ``group``, the trainer's ranks.

    Megatron 0.16's ``_get_param_groups`` sizes and gathers them over the default world, which
    spans the inference ranks too: it would wait on them forever. The rest of the process, its
    other threads included, keeps torch's own ``torch.distributed``.
    """
    import megatron.core.optimizer as factory

    real, factory.torch = factory.torch, TorchOfGroup(group)
    try:
        yield
    finally:
        factory.torch = real


def build_optimizer(model: Any, section: TrainerConfig, pgc: Any) -> Any:
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    bf16 = section.dtype == "bfloat16"
    config = OptimizerConfig(
        optimizer="adam",
        lr=section.lr,
        weight_decay=section.weight_decay,
        bf16=bf16,
        fp16=False,
        use_distributed_optimizer=section.distributed_optimizer,
        clip_grad=section.clip_grad,
    )
    if section.optimizer_offload:
        offload_optimizer(config)
    with optimizer_factory_world(pgc.trainer):
        return get_megatron_optimizer(
            config, [model], use_gloo_process_groups=False, pg_collection=pgc
        )
