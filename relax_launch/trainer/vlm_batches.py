"""A vision-language policy's micro-batches: the padded micro-batches of ``micro_batches.py``
with multimodal RoPE positions ([3, rows, length]: temporal, height, width; ``mrope_positions``)
and their rows' image patches and grids, in row order (the model replaces the image
placeholder tokens' embeddings by the images' features in that order).

Packed rows are refused: the multimodal positions of a packed row's later sequences do not
restart at 0, from which the attention knows where a sequence starts (``trainer/attention.py``).
"""

from __future__ import annotations

import torch

from relax_launch.trainer.batch import TokenBatch
from relax_launch.trainer.vlm_conversion import VLShape
from relax_launch.trainer.vlm_model import mrope_positions

PACKING_REFUSED = (
    "trainer.pack_sequences: a vision-language policy trains on padded micro-batches (its "
    "multimodal positions do not restart at each packed sequence); set it to false"
)
NO_IMAGES = torch.zeros(0, 3, dtype=torch.long)


def add_vision_inputs(
    batches: list[dict[str, torch.Tensor]], shard: TokenBatch, shape: VLShape
) -> None:
    """Give each padded micro-batch of ``shard`` its multimodal positions and, when its rows
    show images, ``pixel_values`` and ``image_grid_thw`` (the model's keyword arguments)."""
    for batch in batches:
        rows = batch["order"].tolist()
        inputs = batch["inputs"]
        if not rows:  # a micro-batch of padding alone: text positions
            batch["positions"] = batch["positions"].expand(3, *inputs.shape).contiguous()
            continue
        images = [shard.images[i] if shard.images else None for i in rows]
        positions = torch.empty(3, *inputs.shape, dtype=torch.long)
        mask = torch.zeros(inputs.shape, dtype=torch.bool)
        for r, (i, row_images) in enumerate(zip(rows, images, strict=True)):
            length = len(shard.tokens[i]) - 1
            grids = NO_IMAGES if row_images is None else row_images.grids
            ours = mrope_positions(inputs[r, :length], grids, shape)
            positions[:, r, :length] = ours
            tail = inputs.shape[1] - length  # padding: the positions after the row's last
            positions[:, r, length:] = int(ours.max()) + 1 + torch.arange(tail)
            mask[r] = image_tokens(inputs[r], grids, shape)
        batch["positions"] = positions
        shown = [row for row in images if row is not None]
        if shown:
            _check_image_tokens(mask, shown, shape)
            batch["pixel_values"] = torch.cat([row.pixel_values for row in shown])
            batch["image_grid_thw"] = torch.cat([row.grids for row in shown])
            batch["image_mask"] = mask


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


def vision_arguments(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The model's image keyword arguments of one micro-batch (none for a text-only one)."""
    return {k: batch[k] for k in ("pixel_values", "image_grid_thw", "image_mask") if k in batch}
