"""What one rank of a role holds in device memory: the terms of the memory plan.

Each term is bytes with the formula's source. The trainer's follow Megatron-core's layout
(``trainer/model.py``): parameters in the trainer's dtype; DDP's contiguous gradient buffer in
fp32 (``grad_reduce_in_fp32`` under bf16; fp32 anyway); under bf16 fp32 master weights; Adam's
two fp32 moments; the last two sharded over the data-parallel ranks by the distributed
optimizer, or moved to host memory by optimizer offload. Activations are what autograd keeps
between a micro-batch's forward and backward pass, per token: the tensors the trainer's layers
save, counted from their code and measured tensor by tensor on the CPU
(tests/trainer/test_memory_estimate_cpu.py), times the micro-batches a pipeline keeps in
flight; the logits are the cross entropy's peak. An engine's follow SGLang: weights per TP/PP
shard, the KV pool, and the workspace SGLang reserves outside ``mem_fraction_static`` (its
``arg_groups/memory_hook.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from relax_launch.models.sizes import ModelSize

if TYPE_CHECKING:
    from relax_launch.config.job import JobConfig
    from relax_launch.placement.plan import EnginePlan

BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "half": 2, "auto": 2}
MIB = 1024**2
# What a process holds before any model. GPU: a CUDA context, cuBLAS/NCCL workspaces (not
# measurable on the CPU; CUDA graphs and NCCL buffers are in SGLang's reserve, below). CPU,
# measured by tests/trainer/test_memory_estimate_cpu.py on a 2-core EPYC, torch 2.13: a trainer
# rank with torch, Megatron-core and the job's modules imported and its process group up holds
# 0.35 GB of its own (anonymous) memory. Its resident set is larger by the libraries' code
# pages (0.15-0.25 GB: how many the kernel maps depends on what other processes left in the page
# cache), which are shared by every rank of a host and reclaimable, so not planned per rank. An
# SGLang engine's processes (server, scheduler, detokenizer) ready with a 2-layer model of ~0
# bytes: 1.97 GB resident together. Neither counts what an allocator keeps freed but cached
# (glibc's heap: the trainer's peak is up to 10 % above its tensors' peak plus this runtime; on
# GPUs the CUDA caching allocator's).
RUNTIME_BYTES = {
    ("cuda", "trainer"): 1.0e9,
    ("cuda", "engine"): 1.5e9,
    ("cpu", "trainer"): 0.35e9,
    ("cpu", "engine"): 2.0e9,
}


@dataclass(frozen=True)
class Term:
    """One consumer of a device's memory."""

    name: str
    bytes: float
    source: str = ""
    host: bool = False  # held in host memory on this rank's behalf, not on the device


def trainer_terms(job: JobConfig, size: ModelSize, pp_rank: int, ranks: dict) -> list[Term]:
    """The model state and activations of one trainer rank at pipeline stage ``pp_rank``;
    ``ranks`` holds the layout's tp, pp, dp, cp and ep sizes."""
    t = job.trainer
    tp, pp, dp, cp, ep = (ranks[k] for k in ("tp", "pp", "dp", "cp", "ep"))
    dense, experts = stage_params(size, pp_rank, pp, tp, ep)
    trainable_dense, trainable_experts = dense, experts
    if t.freeze_vision and pp_rank == 0:  # the tower stays resident, without gradients
        trainable_dense -= size.vision_params
    if t.lora is not None:
        trainable_dense, trainable_experts = lora_params(size, t, pp, tp), 0.0
    weight = BYTES[t.dtype]
    shard = dp * cp if t.distributed_optimizer else 1
    expert_shard = max(dp * cp // ep, 1) if t.distributed_optimizer else 1
    optimizer_elements = trainable_dense / shard + trainable_experts / expert_shard
    master = 4 * optimizer_elements if t.dtype == "bfloat16" else 0.0
    sharded = f" / {shard} DP ranks" if t.distributed_optimizer else ""
    terms = [
        Term(
            "parameters",
            (dense + experts) * weight,
            f"{t.dtype}, / TP {tp} x PP {pp}{_tower(size)}",
        ),
        Term("gradients", (trainable_dense + trainable_experts) * 4, "fp32 grad buffer"),
    ]
    if master:
        terms.append(Term("master weights", master, f"fp32{sharded}", t.optimizer_offload))
    adam = "Adam moments, fp32" + sharded
    terms.append(Term("optimizer state", 8 * optimizer_elements, adam, t.optimizer_offload))
    if job.algorithm.kl_coef > 0 and t.lora is None:
        terms.append(Term("KL reference", (dense + experts) * weight, "frozen initial policy"))
    terms += activation_terms(job, size, pp_rank, ranks)
    return terms


def stage_params(size: ModelSize, pp_rank: int, pp: int, tp: int, ep: int) -> tuple[float, float]:
    """(non-expert, expert) parameters one trainer rank of stage ``pp_rank`` holds."""
    layers = size.num_layers // pp
    moe = round(size.moe_layers * layers / size.num_layers)
    per_layer = size.attention_params / tp + 2 * size.hidden_size
    dense = layers * per_layer + (layers - moe) * size.dense_mlp_params / tp
    dense += moe * size.moe_shared_params
    first, last = pp_rank == 0, pp_rank == pp - 1
    embedding = size.embedding_params / tp
    dense += embedding * first + (embedding * last if not size.tied_embeddings or pp > 1 else 0)
    dense += size.vision_params * first  # a vision tower: replicated on every TP rank
    experts = moe * size.expert_params / (ep * tp)
    return dense, experts


def _tower(size: ModelSize) -> str:
    return f" (vision tower {size.vision_params / 1e6:.0f}M, whole)" if size.vision else ""


def lora_params(size: ModelSize, t: object, pp: int, tp: int) -> float:
    """The adapters of one stage: rank x (inputs + outputs) of every targeted linear."""
    h, q = size.hidden_size, size.num_heads * size.head_dim
    shapes = {
        "linear_qkv": (h, q + 2 * size.num_kv_heads * size.head_dim),
        "linear_proj": (q, h),
        "linear_fc1": (h, 2 * size.ffn_hidden_size),
        "linear_fc2": (size.ffn_hidden_size, h),
    }
    per_layer = sum(sum(shapes[m]) for m in t.lora.target_modules) * t.lora.rank / tp
    return per_layer * size.num_layers / pp


def micro_batch_tokens(job: JobConfig) -> int:
    """The most tokens one micro-batch computes on one rank."""
    t, data = job.trainer, job.data
    if t.max_tokens_per_micro_batch is not None:
        tokens = t.max_tokens_per_micro_batch
    else:
        tokens = t.sequences_per_micro_batch * (data.max_prompt_tokens + data.max_response_tokens)
    return math.ceil(tokens / t.cp_size)


def activation_terms(job: JobConfig, size: ModelSize, pp_rank: int, ranks: dict) -> list[Term]:
    """What a micro-batch keeps for its backward pass, times the micro-batches in flight, and
    the last stage's logits."""
    t = job.trainer
    pp = ranks["pp"]
    tokens = micro_batch_tokens(job)
    kept = LayerActivations(size, t.dtype, job.cluster.device, ranks["tp"], t.lora is None)
    layers = size.num_layers // pp
    moe = round(size.moe_layers * layers / size.num_layers)
    mlps = moe * kept.moe_mlp() + (layers - moe) * kept.dense_mlp()
    in_flight = min(pp - pp_rank, _micro_batches(job, ranks)) if pp > 1 else 1
    if t.recompute == "full":  # each layer's input, and one layer recomputed at a time
        largest = kept.moe_mlp() if moe else kept.dense_mlp()
        per_token = layers * in_flight * kept.layer_input() + kept.attention(False) + largest
        how = "layer inputs (full recomputation) + one layer"
    else:
        per_token = in_flight * (layers * kept.attention(t.recompute == "selective") + mlps)
        how = f"{layers} layers x {in_flight} micro-batch(es) in flight"
    last = pp_rank == pp - 1
    if last:  # the final norm, and its output: the output layer's input
        per_token += kept.norm(size.hidden_size / kept.sp) + kept.b * size.hidden_size / kept.sp
    terms = [Term("activations", tokens * per_token, f"{tokens} tokens/micro-batch, {how}")]
    if last:
        logits = logits_bytes(tokens, size, t.dtype, ranks["tp"], t.lora is None)
        terms.append(Term("logits", logits, f"{tokens} tokens x vocab {size.vocab_size} / TP"))
    return terms


@dataclass(frozen=True)
class LayerActivations:
    """Bytes per token that one layer of one trainer rank keeps for the backward pass, by part:
    the tensors autograd saves in the trainer's Megatron-core layers (local spec, torch's
    RMSNorm, Megatron's unfused RoPE and SwiGLU, the trainer's SDPA attention, SequentialMLP
    experts), as tests/trainer/test_memory_estimate_cpu.py measures them tensor by tensor."""

    size: ModelSize
    dtype: str
    device: str
    tp: int
    trainable_norms: bool  # LoRA freezes the norms' weights: x/rms is then not kept

    @property
    def b(self) -> int:
        return BYTES[self.dtype]

    @property
    def sp(self) -> int:
        """How many TP ranks split the sequence (sequence parallelism: MoE under TP)."""
        return self.tp if self.size.num_experts and self.tp > 1 else 1

    @property
    def fused_norm(self) -> bool:
        # torch's fused RMSNorm kernel runs on CUDA when input and weight share a dtype: fp32
        # (torch.nn.RMSNorm's weight is fp32; a bf16 input takes the composite form)
        return self.device == "cuda" and self.dtype == "float32"

    def norm(self, width: float, groups: float = 1) -> float:
        """What an RMSNorm over ``width`` keeps, its output aside: the fused kernel its input
        and 1/rms (the backward of _fused_rms_norm); the composite form its input upcast to
        fp32, 1/rms, and x/rms in fp32 for the weight's gradient."""
        if self.fused_norm:
            return self.b * width + 4 * groups
        return 4 * width + 4 * groups + 4 * width * self.trainable_norms

    def layer_input(self) -> float:
        return self.b * self.size.hidden_size / self.sp

    def attention(self, selective: bool) -> float:
        """Both norms of a layer with their outputs (the next linears' inputs), RoPE, the q/k
        norms and the core attention."""
        s, b = self.size, self.b
        h = s.hidden_size / self.sp
        q, kv = s.num_heads * s.head_dim / self.tp, s.num_kv_heads * s.head_dim / self.tp
        kept = 2 * (self.norm(h) + b * h)
        kept += 4 * b * s.head_dim  # RoPE's cos and sin, of q and of k
        if s.qk_norm:
            kept += self.qk_norms(q, kv)
        if selective:  # the checkpoint's inputs q, k, v (v a view: all of qkv) and the context
            return kept + b * (3 * q + 3 * kv)
        # SDPA keeps q, k and v repeated to every query head (grouped queries), its output
        # (the projection's input) and the fp32 log-sum-exp per head
        return kept + 4 * b * q + 4 * s.num_heads / self.tp

    def qk_norms(self, q: float, kv: float) -> float:
        """Qwen3's per-head q and k norms: q's input is a copy out of the fused qkv output;
        k's a view of it, which keeps all of it (unless upcast: a copy in fp32)."""
        heads = (self.size.num_heads + self.size.num_kv_heads) / self.tp
        k_input = 4 * (q + 2 * kv) if self.b == 4 else 4 * kv
        normalized = 0 if self.fused_norm else 4 * (q + kv) * self.trainable_norms
        return 4 * q + k_input + 4 * heads + normalized

    def dense_mlp(self) -> float:
        """fc1's output (gate and up), silu(gate), up + glu_linear_offset (a new tensor) and
        their product (fc2's input)."""
        return 5 * self.b * self.size.ffn_hidden_size / self.tp

    def moe_mlp(self) -> float:
        """The router (its input in fp32, which stands for the norm's output ``attention``
        counts; each expert's probability and routing bit), and per routed copy of the token:
        its hidden state (fc1's input), fc1's output, silu(gate), up + offset, their product
        and that scaled by the routing probability (fc2's input); a shared expert as a dense
        MLP."""
        s, b = self.size, self.b
        router = ((4 - b) * s.hidden_size + 5 * s.num_experts) / self.sp
        routed = s.experts_per_token * b * (s.hidden_size + 6 * s.expert_ffn_size / self.tp)
        return router + routed + 5 * b * s.shared_expert_size / self.tp


def logits_bytes(
    tokens: int, size: ModelSize, dtype: str, tp: int, output_trained: bool = True
) -> float:
    """The last stage's peak for the logits. The loss (trainer/cross_entropy.py, Megatron's
    fused pieces) turns an fp32 copy of the logits (in fp32, the logits themselves) into the
    softmax in place and keeps it; the forward holds bf16 logits beside that copy; the backward
    computes the gradient in the softmax and casts it to the logits' dtype (a bf16 copy under
    bf16, nothing in fp32). Then the output layer's backward holds that gradient and, unless
    LoRA freezes it, its weight's (a new tensor, added to main_grad after)."""
    b, vocab = BYTES[dtype], size.vocab_size / tp
    copy = 0 if b == 4 else b  # the bf16 logits beside the fp32 softmax, then the bf16 gradient
    cross_entropy = tokens * vocab * (4 + copy)
    weight_grad = size.hidden_size * vocab * b if output_trained else 0
    return max(cross_entropy, tokens * vocab * b + weight_grad)


def _micro_batches(job: JobConfig, ranks: dict) -> int:
    per_rank = job.data.prompts_per_step * job.algorithm.n_samples_per_prompt // ranks["dp"]
    return max(per_rank // job.trainer.sequences_per_micro_batch, 1)


def kv_bytes_per_token(size: ModelSize, engine: EnginePlan, dtype: str) -> float:
    """One token's keys and values on one rank of ``engine`` (heads replicated past TP =
    KV heads, as SGLang does)."""
    heads = max(size.num_kv_heads / engine.tp_size, 1)
    return 2 * size.num_layers / engine.pp_size * heads * size.head_dim * BYTES[dtype]


def engine_weight_bytes(size: ModelSize, engine: EnginePlan, dtype: str) -> float:
    return size.total_params / (engine.tp_size * engine.pp_size) * BYTES[dtype]


def sglang_reserve_bytes(capacity: float, engine: EnginePlan, settings: dict) -> float:
    """The workspace SGLang keeps outside ``mem_fraction_static`` (activations of a prefill
    chunk, CUDA graphs), by SGLang's own rule for a device of ``capacity`` bytes."""
    mib = capacity / MIB
    big = mib >= 60 * 1024
    chunk = settings.get("chunked_prefill_size") or (8192 if big else 4096)
    if settings.get("disable_cuda_graph"):
        max_bs = 0
    else:
        max_bs = settings.get("cuda_graph_max_bs") or (
            (256 if engine.tp_size < 4 else 512) if big else 32
        )
    reserve = 512 + max(chunk, 2048) * 1.5 + engine.tp_size * engine.pp_size / 8 * 1024
    reserve += max_bs * 2
    return (max(reserve, 10 * 1024) if big else reserve) * MIB
