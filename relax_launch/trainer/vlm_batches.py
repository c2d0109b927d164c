"""A vision-language policy's micro-batches: the padded or packed micro-batches of
``micro_batches.py`` with multimodal RoPE positions ([3, rows, length]: temporal, height, width;
``mrope_positions``) and their sequences' image patches and grids, in order (the model replaces
the image placeholder tokens' embeddings by the images' features in that order).

Each sequence's positions start at 0, in a packed row as in a padded one: a sequence starts
where all three are 0. A padded row's padding continues its positions; a packed row's tail (up
to the length multiple) is one more sequence from 0, never trained on. Where each sequence
spans (``sequence_spans``) is read from the positions here, on the CPU, and given to the
model's forward, which attends within each (``trainer/attention.py``) without reading its
device positions back.
"""

from __future__ import annotations

from typing import Any

import torch

from relax_launch.trainer.batch import TokenBatch
from relax_launch.trainer.vlm_conversion import VLShape
from relax_launch.trainer.vlm_model import mrope_positions, spans_of, vision_layout

NO_IMAGES = torch.zeros(0, 3, dtype=torch.long)


def add_vision_inputs(
    batches: list[dict[str, torch.Tensor]], shard: TokenBatch, shape: VLShape
) -> None:
    """Give each micro-batch of ``shard`` (padded or packed) its multimodal positions, its
    ``sequence_spans`` (None: one sequence per row) and, when its sequences show images,
    ``pixel_values``, ``image_grid_thw``, ``image_mask`` and ``image_layout`` (the tower's
    ``VisionLayout``, from the grids here on the CPU) (the model's keyword arguments)."""
    for batch in batches:
        _add_positions(batch, shard, shape)
        batch["sequence_spans"] = spans_of(batch["positions"])  # on the CPU: no host sync


def _add_positions(batch: dict, shard: TokenBatch, shape: VLShape) -> None:
    """One micro-batch's multimodal positions and images (``add_vision_inputs``)."""
    inputs = batch["inputs"]
    if not batch["order"].numel():  # a micro-batch of padding alone: text positions
        batch["positions"] = batch["positions"].expand(3, *inputs.shape).contiguous()
        return
    packed = "gather" in batch
    positions = torch.empty(3, *inputs.shape, dtype=torch.long)
    mask = torch.zeros(inputs.shape, dtype=torch.bool)
    shown, ends = [], [0] * inputs.shape[0]  # each row's first position past its sequences
    for row, start, i in _sequences(batch, shard):
        row_images = shard.images[i] if shard.images else None
        grids = NO_IMAGES if row_images is None else row_images.grids
        span = slice(start, start + len(shard.tokens[i]) - 1)
        positions[:, row, span] = mrope_positions(inputs[row, span], grids, shape)
        mask[row, span] = image_tokens(inputs[row, span], grids, shape)
        ends[row] = span.stop
        shown += [] if row_images is None else [row_images]
    for row, end in enumerate(ends):  # the tail: one more sequence packed, else padding
        first = 0 if packed else int(positions[:, row, :end].max()) + 1
        positions[:, row, end:] = first + torch.arange(inputs.shape[1] - end)
    batch["positions"] = positions
    if shown:
        _check_image_tokens(mask, shown, shape)
        batch["pixel_values"] = tuple(row.pixel_values for row in shown)  # joined in forward
        batch["image_grid_thw"] = torch.cat([row.grids for row in shown])
        batch["image_mask"] = mask
        batch["image_layout"] = vision_layout(batch["image_grid_thw"], shape)


def _sequences(batch: dict[str, torch.Tensor], shard: TokenBatch) -> list[tuple[int, int, int]]:
    """(row, first column, index in ``shard``) of each sequence of a micro-batch, in the order
    its images' features fill the rows: one per row padded, end to end in row 0 packed."""
    order = batch["order"].tolist()
    if "gather" not in batch:
        return [(row, 0, i) for row, i in enumerate(order)]
    starts = torch.tensor([0] + [len(shard.tokens[i]) - 1 for i in order]).cumsum(0)
    return [(0, int(start), i) for start, i in zip(starts, order, strict=False)]


def _check_image_tokens(mask: torch.Tensor, shown: list, shape: VLShape) -> None:
    """The micro-batch's ``mask`` (on the CPU) marks one token per image feature: the model's
    forward scatters the features there without counting them on the device."""
    merge = shape.spatial_merge_size**2
    features = sum(int(row.grids.prod(-1).sum()) // merge for row in shown)
    if int(mask.sum()) != features:
        raise ValueError(
            f"{int(mask.sum())} image placeholder tokens for {features} image features"
        )


def image_tokens(ids: torch.Tensor, grids: torch.Tensor, shape: VLShape) -> torch.Tensor:
    """Which of a row's ``ids`` the images' features replace: its first placeholders, as many
    as its images have tokens (a sampled response may hold the placeholder id: text there, as
    for the engine)."""
    count = int(grids.prod(-1).sum()) // shape.spatial_merge_size**2
    placeholders = ids == shape.image_token_id
    return placeholders & (placeholders.cumsum(0) <= count)


VISION_ARGUMENTS = (
    "pixel_values",
    "image_grid_thw",
    "image_mask",
    "image_layout",
    "sequence_spans",
)


def vision_arguments(batch: dict[str, Any]) -> dict[str, Any]:
    """The vision-language model's keyword arguments of one micro-batch: its images (none for a
    text-only one) and its sequence spans; none for a text policy's micro-batch."""
    out = {k: batch[k] for k in VISION_ARGUMENTS if k in batch}
    if "pixel_values" in out:
        out["pixel_values"] = joined_pixels(out["pixel_values"])
    return out


def joined_pixels(parts: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """A micro-batch's sequences' patches end to end, as its forward takes them. A micro-batch
    keeps them as views of the shard's received buffer and joins them only here, one
    micro-batch at a time, so a trainer rank holds a step's pixel values once: a view of that
    buffer where they lie there in this order (consecutive sequences), else a copy for this
    forward (a token budget's or packing's length-sorted micro-batches)."""
    first = parts[0]
    offset, storage = first.storage_offset(), first.untyped_storage().data_ptr()
    for part in parts:
        same = part.untyped_storage().data_ptr() == storage and part.is_contiguous()
        if not same or part.storage_offset() != offset:
            return torch.cat(parts)
        offset += part.numel()
    rows = sum(len(part) for part in parts)
    return first.as_strided((rows, *first.shape[1:]), first.stride(), first.storage_offset())
