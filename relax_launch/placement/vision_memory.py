"""What a vision-language model (Qwen2.5-VL) adds to the memory plan: the trainer's vision tower
activations and a step's pixel values, and an engine's multimodal cache and image-encoder
headroom. The language model's terms are the text families' (``placement/memory.py``).

How many image patches a micro-batch holds: each sequence's image tokens are part of its
prompt, so at most ``data.max_prompt_tokens``; the built-in visual task shows one image of
known size per prompt. Each image token is merge² patches (2 x 2 for Qwen2.5-VL).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from relax_launch.models.sizes import ModelSize
from relax_launch.models.vision_sizes import VisionSize
from relax_launch.placement.memory import BYTES, MIB, Term, micro_batch_tokens

if TYPE_CHECKING:
    from relax_launch.config.job import JobConfig

# images of the built-in visual tasks, in pixels (rl/visual_tasks.py: one 84 x 84 image a prompt)
BUILTIN_IMAGE_PIXELS = {"builtin:shape_counting": 84 * 84}
# SGLang 0.5.23's multimodal embedding cache: SGLANG_VLM_CACHE_SIZE_MB = EnvInt(100)
# (sglang/srt/environ.py), an LRU of image features created after the KV pool is sized, whose
# budget is reserved out of the KV pool's (mem_cache/kv_cache_configurator.py,
# mm_runtime_reservation_gb)
VLM_CACHE_BYTES = 100 * MIB
# SGLang's ViT of reference in adjust_mem_fraction_for_vlm (arg_groups/memory_hook.py): 24
# layers of 1024 (ViT-L/14); it reads the vision config's num_hidden_layers, which Qwen2.5-VL's
# has not (``depth``), so 24
SGLANG_VIT_LAYERS, SGLANG_VIT_HIDDEN = 24, 1024


def image_tokens_per_sequence(job: JobConfig, vision: VisionSize) -> tuple[int, str]:
    """The most image tokens one sequence holds, and the assumption that gives it."""
    prompt = job.data.max_prompt_tokens
    pixels = BUILTIN_IMAGE_PIXELS.get(job.data.dataset)
    if pixels is not None:
        tokens = min(vision.image_tokens(pixels), prompt)
        return tokens, f"one image of {pixels} pixels a prompt ({job.data.dataset})"
    return prompt, f"every prompt token an image's (data.max_prompt_tokens={prompt})"


def vision_trainer_terms(job: JobConfig, size: ModelSize, trained: bool, dp: int) -> list[Term]:
    """The pixel values of a step's images and, when the tower trains, what its forward keeps
    for the backward pass over one micro-batch's patches (a frozen tower's forward keeps
    nothing).

    Pixel values: the DP rank's shard as received, once; its micro-batches are views of it,
    joined one micro-batch at a time in the forward (``vlm_batches.joined_pixels``). They travel
    in the trainer's dtype, which the tower casts them to anyway. Rank 0 sends the other DP
    ranks' shards one at a time before its own step and keeps none on its device once sent
    (``ShardChannel.start``): the bytes of one such shard, never beside its own, so this term
    bounds them too."""
    vision, data = size.vision, job.data
    tokens, assumed = image_tokens_per_sequence(job, vision)
    patches = tokens * vision.merge_size**2  # of one sequence
    sequences = max(
        micro_batch_tokens(job) // (data.max_prompt_tokens + data.max_response_tokens), 1
    )
    share = data.prompts_per_step * job.algorithm.n_samples_per_prompt // dp
    how = f"{patches} patches a sequence: {tokens} image tokens ({assumed})"
    dtype = job.trainer.dtype
    b = BYTES[dtype]
    pixels = share * patches * vision.patch_values * b
    terms = [
        Term(
            "pixel values", pixels, f"{dtype}, once (rank 0: or a shard it sends), {share} x {how}"
        )
    ]
    if trained:
        # the patch embedding keeps its input: a view of the received pixel values in order, a
        # joined copy else (counted: it is the micro-batch's)
        kept = TowerActivations(vision, b).per_patch() + vision.patch_values * b
        what = f"{vision.depth} blocks, {sequences} x {how}"
        terms.append(Term("vision activations", sequences * patches * kept, what))
    return terms


class TowerActivations:
    """Bytes per patch that transformers' Qwen2.5-VL vision tower keeps for its backward pass
    in dtype of ``b`` bytes (SDPA attention), counted from its code."""

    def __init__(self, vision: VisionSize, b: int) -> None:
        self.vision, self.b = vision, b

    def norm(self) -> float:
        """Qwen2_5_VLRMSNorm: its input in fp32 (a copy unless fp32), 1/rms, and x/rms in the
        dtype (the fp32 product itself in fp32, else its cast), which the weight multiplies."""
        return (4 + self.b) * self.vision.hidden_size + 4

    def block(self) -> float:
        """Both norms and their outputs (the linears' inputs); the fused qkv output (v is a view
        of it), q and k after the rotary embedding, SDPA's output and log-sum-exp, the
        projection's input; the MLP's gate and up outputs, silu(gate) and their product."""
        v, b = self.vision, self.b
        h = v.hidden_size
        attention = 7 * b * h + 4 * v.num_heads
        return 2 * (self.norm() + b * h) + attention + 4 * b * v.intermediate_size

    def per_patch(self) -> float:
        """Every block, the rotary embedding's cos and sin (fp32, shared by the blocks), and
        the merger: its norm, then per patch its first linear's input, output and GELU's."""
        v = self.vision
        rotary = 2 * 4 * (v.hidden_size // v.num_heads)
        merger = self.norm() + 3 * self.b * v.hidden_size
        return v.depth * self.block() + rotary + merger


def sglang_vlm_factor(vision: VisionSize) -> float:
    """What SGLang multiplies its default ``mem_fraction_static`` by for a vision-language model
    (``adjust_mem_fraction_for_vlm``): 0.95, and 10 % less per 100 % more ViT weights than
    ViT-L/14's, clamped to 0.8-1.05. The memory left outside is the image encoder's."""
    ratio = SGLANG_VIT_LAYERS * vision.hidden_size**2 / (SGLANG_VIT_LAYERS * SGLANG_VIT_HIDDEN**2)
    return 0.95 * max(0.8, min(1.05, 1.0 - 0.1 * (ratio - 1.0)))


def vision_engine_terms(
    vision: VisionSize | None, fraction: float | None, source: str, capacity: float
) -> tuple[float | None, list[Term]]:
    """An engine's ``mem_fraction_static`` as SGLang adjusts it for a vision-language model
    (its own default only: a configured one stands) and the terms that adds: the multimodal
    cache (out of the KV pool's budget) and the image encoder's headroom (outside f)."""
    if vision is None:
        return fraction, []
    terms = [Term("multimodal cache", VLM_CACHE_BYTES, "SGLANG_VLM_CACHE_SIZE_MB=100")]
    if fraction is None or source == "config":
        return fraction, terms
    factor = sglang_vlm_factor(vision)
    encoder = fraction * (1 - factor) * capacity
    why = f"SGLang's f x {factor:.3f} for the image encoder (adjust_mem_fraction_for_vlm)"
    return fraction * factor, [*terms, Term("encoder workspace", encoder, why)]
