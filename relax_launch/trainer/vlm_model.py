"""The trainer's Qwen2.5-VL: a Megatron-core GPT with multimodal RoPE for the language model,
and transformers' vision tower and patch merger, replicated on every rank.

Why not a bridge: mbridge 0.15.1 (the one that ships Qwen2.5-VL for Megatron-core) builds its
layers from Transformer Engine (absent here, and without a CPU build), reads Megatron's global
``parallel_state`` (which the trainer never initialises: its groups would span the inference
ranks) and transformers 4's config layout (``hf_config.rope_scaling``, gone in transformers 5).
See docs/vlm.md.

Why the vision tower is transformers' module: it is small beside the language model (675M of
Qwen2.5-VL-7B's 8.3B parameters), its window attention over packed images has no Megatron-core
counterpart without Transformer Engine, and as the same module it computes the same features.
Replicated over TP, each rank computes every image's features; their gradients agree on every TP
rank (the language model's first column-parallel layer all-reduces its input's gradient), so
data parallelism alone reduces them, as for the language model's norms.

A forward takes the row's token ids, their multimodal positions ([3, batch, sequence]:
temporal, height, width; ``mrope_positions``) and the images' patches and grids; the image
placeholder tokens' embeddings are replaced by the merged image features, in order. A row holds
one sequence (padded) or several end to end (packed), each one's positions starting at 0: the
attention (``trainer/attention.py``) never crosses from one to the next.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from relax_launch.trainer.attention import Positions, Spans, sequence_spans, set_positions
from relax_launch.trainer.config import TrainerConfig
from relax_launch.trainer.hf_dir import read_weights
from relax_launch.trainer.model import (
    DTYPES,
    copy_shard,
    transformer_config,
    with_core_attention,
)
from relax_launch.trainer.vlm_conversion import VLShape, check_vlm_checkpoint, vlm_hf_to_megatron


def read_vl_shape(model_dir: Path) -> VLShape:
    """The VLShape of the HF model in ``model_dir``; a ValueError naming the directory."""
    try:
        return VLShape.from_hf_config(json.loads((model_dir / "config.json").read_text()))
    except ValueError as error:
        raise ValueError(f"{model_dir}: {error}") from None


def mrope_positions(
    ids: torch.Tensor, grids: torch.Tensor, shape: VLShape, start: int = 0
) -> torch.Tensor:
    """Multimodal RoPE positions [3, len(ids)] of one sequence of token ids whose image
    placeholders belong, in order, to images of patch grids ``grids`` ([images, 3]: t, h, w).

    A text token takes the next position in all three; an image's tokens take the image's
    position plus their (t, h, w) index among its merged patches, and the text after it starts
    past the image's largest extent (Qwen2-VL's ``get_rope_index``). Placeholders past the last
    image's (a sampled response may hold the placeholder id) are text, as for the engine."""
    merge = shape.spatial_merge_size
    out = torch.empty(3, len(ids), dtype=torch.long)
    images, current, i = grids.tolist(), start, 0
    placeholders = (ids == shape.image_token_id).tolist()
    while i < len(ids):
        end = _next_placeholder(placeholders, i) if images else len(ids)
        if end > i:  # a text span: the next positions in all three
            out[:, i:end] = torch.arange(current, current + end - i)
            current, i = current + end - i, end
            continue
        t, h, w = images.pop(0)
        h, w = h // merge, w // merge
        grid = torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij")
        out[:, i : i + t * h * w] = torch.stack([g.flatten() for g in grid]) + current
        current, i = current + max(t, h, w), i + t * h * w
    return out


def _next_placeholder(placeholders: list[bool], start: int) -> int:
    """The index of the first placeholder at or after ``start``; past the end if none."""
    try:
        return placeholders.index(True, start)
    except ValueError:
        return len(placeholders)


@dataclass(frozen=True)
class VisionLayout:
    """What the vision tower derives from the images' grids: each patch's rotary (h, w), the
    patches' order in attention windows and the bounds of each image's and each window's
    patches. transformers derives them from ``grid_thw`` on every forward with ``.tolist()``
    and data-dependent ops (``repeat_interleave``, ``unique_consecutive``, host-built indices
    copied over), and each SDPA block reads its bounds back again: host syncs that stall the
    stream, when the grids are on the device. Computed once a micro-batch from the grids on
    the CPU (``vision_layout``), the tower reads none (docs/vlm.md#trainer-model)."""

    position_ids: torch.Tensor  # [patches, 2]
    window_index: torch.Tensor  # [merged patches]
    cu_seqlens: torch.Tensor  # [frames + 1]: the full-attention blocks' bounds
    cu_window_seqlens: torch.Tensor  # [windows + 1]: the window-attention blocks'

    def to(self, device: torch.device | str) -> VisionLayout:
        """On ``device``: what the tower computes with. The bounds stay on the CPU, where its
        SDPA attention reads them (to split the patches into images or windows)."""
        return replace(
            self,
            position_ids=self.position_ids.to(device),
            window_index=self.window_index.to(device),
        )


def vision_config(shape: VLShape) -> Any:
    """transformers' config of the tower of ``shape``."""
    from transformers import Qwen2_5_VLConfig

    return Qwen2_5_VLConfig(vision_config=shape.vision).vision_config


def vision_layout(grids: torch.Tensor, shape: VLShape) -> VisionLayout:
    """The VisionLayout of images of patch grids ``grids`` ([images, 3]: t, h, w; on the CPU),
    by transformers' own functions (what its tower's forward computes)."""
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
    from transformers.vision_utils import (
        get_vision_cu_seqlens,
        get_vision_position_ids,
        get_vision_window_index,
    )

    # the config's fields or the class's defaults: building the config takes tens of ms
    window, patch = (
        shape.vision.get(name, getattr(Qwen2_5_VLVisionConfig, name))
        for name in ("window_size", "patch_size")
    )
    merge = shape.spatial_merge_size
    window_index, cu_window_seqlens = get_vision_window_index(grids, merge, window, patch)
    return VisionLayout(
        position_ids=get_vision_position_ids(grids, merge),
        window_index=window_index,
        cu_seqlens=get_vision_cu_seqlens(grids),
        cu_window_seqlens=cu_window_seqlens,
    )


FROM_POSITIONS = "from position_ids"  # the forward's sequence_spans, unset


def spans_of(position_ids: torch.Tensor) -> Spans | None:
    """Each row's sequences of multimodal ``position_ids`` [3, batch, sequence]: one starts
    where its three positions are 0 (a packed row's sequences restart them; an image's later
    tokens never are all 0). A host read when they are on the device."""
    return sequence_spans((position_ids == 0).all(0))


class VisionLanguageModel(torch.nn.Module):
    """The trainer's Qwen2.5-VL (module docstring). ``config`` and the attribute lookups
    Megatron's schedules and DDP make are the language model's."""

    def __init__(self, language: Any, vision: torch.nn.Module, shape: VLShape) -> None:
        super().__init__()
        self.language, self.vision, self.shape = language, vision, shape
        self.config, self.model_type = language.config, language.model_type

    def set_input_tensor(self, tensor: Any) -> None:
        self.language.set_input_tensor(tensor)

    def image_features(
        self, pixel_values: torch.Tensor, grids: torch.Tensor, layout: VisionLayout | None
    ) -> torch.Tensor:
        """The merged features [image tokens, hidden] of the images' patches, in order.
        ``layout``: the grids' (``vision_layout``, on the patches' device); None: computed from
        ``grids`` read back to the host (a host sync: not training's)."""
        if layout is None:
            layout = vision_layout(grids.cpu(), self.shape).to(pixel_values.device)
        dtype = next(self.vision.parameters()).dtype
        # the tower takes what it would compute from grid_thw as keyword arguments
        tower = self.vision(pixel_values.to(dtype), grid_thw=grids, **vars(layout))
        return tower.pooler_output

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: Any = None,
        labels: torch.Tensor | None = None,
        pixel_values: torch.Tensor | None = None,
        image_grid_thw: torch.Tensor | None = None,
        image_mask: torch.Tensor | None = None,
        image_layout: VisionLayout | None = None,
        sequence_spans: Spans | None | str = FROM_POSITIONS,
    ) -> torch.Tensor:
        """Per-token losses [batch, sequence] (-logprob of ``labels``), or the logits (this TP
        rank's vocabulary slice) without labels. ``position_ids`` [3, batch, sequence], each
        sequence's from 0 (packed rows: several per row). ``image_mask`` [batch, sequence]:
        the tokens the image features replace (unset: every image placeholder).
        ``image_layout``: the images' ``VisionLayout`` (unset: read from ``image_grid_thw``).
        ``sequence_spans``: each row's (start, end) of its sequences, None for one a row
        (``attention.sequence_spans``; the trainer's micro-batches read them on the CPU,
        ``vlm_batches.add_vision_inputs``); unset, they are read from ``position_ids``, a
        host sync."""
        embeddings = self.language.embedding(input_ids=input_ids, position_ids=None)
        if pixel_values is not None:
            features = self.image_features(pixel_values, image_grid_thw, image_layout)
            if image_mask is not None:  # counted on the CPU (vlm_batches.add_vision_inputs)
                placeholders = image_mask.bool()
            else:
                placeholders = input_ids == self.shape.image_token_id  # [batch, sequence]
                if int(placeholders.sum()) != features.shape[0]:  # a host sync: not training's
                    raise ValueError(
                        f"{int(placeholders.sum())} image placeholder tokens for "
                        f"{features.shape[0]} image features"
                    )
            # features are in row order: scatter row by row ([batch, sequence, hidden])
            embeddings = (
                embeddings.transpose(0, 1)
                .masked_scatter(placeholders[..., None], features.to(embeddings.dtype))
                .transpose(0, 1)
            )
        if isinstance(sequence_spans, str):  # not the trainer's: read from the device
            sequence_spans = spans_of(position_ids)
        set_positions(Positions(position_ids[0], sequence_spans))
        return self.language(
            input_ids,
            position_ids,
            attention_mask,
            decoder_input=embeddings,
            labels=labels,
        )


def build_vlm_module(
    shape: VLShape, section: TrainerConfig, pgc: Any, device: str
) -> VisionLanguageModel:
    """The bare trainer Qwen2.5-VL (no DDP) on torch ``device``: one pipeline stage, no context
    parallelism (refused, naming the field)."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
        Qwen2_5_VisionTransformerPretrainedModel,
    )

    from relax_launch.trainer.cross_entropy import use_exact_cross_entropy

    for field in ("pp_size", "cp_size"):
        if getattr(section, field) != 1:
            raise ValueError(f"trainer.{field}: a vision-language model trains with 1 (for now)")
    if parallel_state._GLOBAL_MEMORY_BUFFER is None:  # attention scratch space; no collectives
        parallel_state._set_global_memory_buffer()
    config = transformer_config(shape.text, section)
    config.mrope_section = list(shape.mrope_section)
    language = GPTModel(
        config=config,
        transformer_layer_spec=with_core_attention(
            get_gpt_layer_local_spec(normalization="RMSNorm")
        ),
        vocab_size=shape.text.vocab_size,
        max_sequence_length=shape.text.max_position_embeddings,
        position_embedding_type="mrope",
        rotary_base=int(shape.text.rope_theta),
        share_embeddings_and_output_weights=shape.text.tie_embeddings,
        pg_collection=pgc,
    )
    use_exact_cross_entropy(language)
    vision = Qwen2_5_VisionTransformerPretrainedModel._from_config(
        vision_config(shape), attn_implementation="sdpa", dtype=DTYPES[section.dtype]
    )
    return VisionLanguageModel(language, vision, shape).to(device)


def load_vlm_checkpoint(module: VisionLanguageModel, model_dir: Path, pgc: Any) -> None:
    """Load this TP rank's shard of the HF safetensors in ``model_dir`` into ``module``."""
    hf = read_weights(model_dir)
    vision_names = {name for name, _ in module.vision.named_parameters()}
    try:
        check_vlm_checkpoint(hf, module.shape, vision_names)
    except ValueError as error:
        raise ValueError(f"{model_dir}: {error}") from None
    shard = vlm_hf_to_megatron(hf, module.shape, tp_rank=pgc.tp.rank(), tp_size=pgc.tp.size())
    copy_shard(shard, dict(module.named_parameters()), model_dir)
