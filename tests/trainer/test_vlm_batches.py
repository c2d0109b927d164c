"""A vision-language policy's batches: rows with images survive the shard channel's packing, and
padded micro-batches carry each row's multimodal positions and, in row order, its images."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from relax_launch.trainer import micro_batches, vlm_model
from relax_launch.trainer.attention import _POSITIONS as _positions
from relax_launch.trainer.batch import RowImages, TokenBatch
from relax_launch.trainer.model_shape import ModelShape
from relax_launch.trainer.vlm_batches import add_vision_inputs, vision_arguments
from relax_launch.trainer.vlm_conversion import VLShape
from relax_launch.trainer.vlm_model import mrope_positions

IMAGE = 9  # the image placeholder id of these rows


def shape() -> VLShape:
    text = ModelShape.from_hf_config(
        {
            "architectures": ["Qwen2ForCausalLM"],
            "num_hidden_layers": 1,
            "hidden_size": 64,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "intermediate_size": 128,
            "vocab_size": 100,
        }
    )
    return VLShape(text, {}, IMAGE, 2, (2, 3, 3))


def image(patches: int, grid: tuple[int, int, int], value: float) -> RowImages:
    return RowImages(torch.full((patches, 6), value), torch.tensor([grid]))


def batch() -> TokenBatch:
    """Three rows: one image of 2 x 4 patches (2 tokens), text only, two images (1 token each)."""
    tokens = (
        (1, 2, IMAGE, IMAGE, 3, 4, 5),
        (1, 2, 3),
        (1, IMAGE, 2, IMAGE, 3, 4),
    )
    masks = tuple(tuple(float(j >= len(t) - 2) for j in range(len(t))) for t in tokens)
    two = RowImages(torch.full((8, 6), 3.0), torch.tensor([[1, 2, 2], [1, 2, 2]]))
    images = (image(8, (1, 2, 4), 1.0), None, two)
    return TokenBatch(tokens, masks, masks, masks, None, images)


def test_rows_with_images_pack_and_unpack_bit_exact():
    original = batch()
    ids, values, pixels = original.pack()
    assert pixels.shape == (16, 6) and original.shape().images == 3
    back = TokenBatch.unpack(ids, values, original.shape(), pixels)
    assert back.tokens == original.tokens and back.loss_mask == original.loss_mask
    assert back.images[1] is None
    for ours, theirs in [
        (back.images[0], original.images[0]),
        (back.images[2], original.images[2]),
    ]:
        assert torch.equal(ours.pixel_values, theirs.pixel_values)
        assert torch.equal(ours.grids, theirs.grids)
    # the receiver allocates exactly what was sent
    buffers = original.shape().empty()
    assert [b.shape for b in buffers] == [ids.shape, values.shape, pixels.shape]
    # a DP shard keeps its rows' images
    assert original.select(range(1, 3)).shape().patches == 8


def test_padded_micro_batches_carry_multimodal_positions_and_images_in_row_order():
    shard = batch()
    groups = micro_batches.group_sequences(
        [len(t) - 1 for t in shard.tokens], micro_batch_size=2, max_tokens=None, packed=False
    )
    built = micro_batches.build(shard, groups, packed=False)
    add_vision_inputs(built, shard, shape())
    first, second = built
    assert first["positions"].shape == (3, 2, 6)
    ours = mrope_positions(torch.tensor(shard.tokens[0][:-1]), shard.images[0].grids, shape())
    assert torch.equal(first["positions"][:, 0], ours)
    # the image's tokens share a temporal position and spread over height and width
    assert first["positions"][:, 0, 2:4].tolist() == [[2, 2], [2, 2], [2, 3]]
    # text rows: one position in all three, the padding continuing after the row
    assert first["positions"][:, 1].tolist() == [[0, 1, 2, 3, 4, 5]] * 3
    assert torch.equal(vision_arguments(first)["pixel_values"], shard.images[0].pixel_values)
    assert vision_arguments(second)["image_grid_thw"].tolist() == [[1, 2, 2], [1, 2, 2]]
    # one sequence a row: the attention's fast path, known on the CPU (no host sync a forward)
    assert vision_arguments(first)["sequence_spans"] is None


def test_a_text_micro_batch_passes_no_image_arguments():
    assert vision_arguments({"inputs": torch.zeros(1, 2)}) == {}


@pytest.mark.parametrize("rows", [1, 3])
def test_every_row_count_round_trips(rows):
    part = batch().select(range(rows))
    packed = part.pack()
    assert TokenBatch.unpack(packed[0], packed[1], part.shape(), *packed[2:]).tokens == part.tokens


def test_a_placeholder_the_policy_sampled_is_text():
    """A random policy may sample the placeholder id: past the images' own tokens it is text
    (positions and embedding), as the engine treats it (step 3 of the job failed on it)."""
    tokens = ((1, IMAGE, IMAGE, 2, IMAGE, 3),)  # one 2-token image, then a sampled placeholder
    masks = ((0.0, 0.0, 0.0, 0.0, 1.0, 1.0),)
    shard = TokenBatch(tokens, masks, masks, masks, None, (image(8, (1, 2, 4), 1.0),))
    (built,) = micro_batches.build(shard, [[0]], packed=False)
    add_vision_inputs([built], shard, shape())
    assert built["image_mask"].tolist() == [[False, True, True, False, False]]
    assert built["positions"][:, 0].tolist() == [
        [0, 1, 1, 3, 4],
        [0, 1, 1, 3, 4],
        [0, 1, 2, 3, 4],
    ]


def per_token_positions(ids: list[int], grids: list[list[int]], pad: int, merge: int) -> list:
    """Qwen2-VL's get_rope_index, one token at a time (the reference for the vectorised one)."""
    out, images, current, i = [[], [], []], list(grids), 0, 0
    while i < len(ids):
        if not (ids[i] == pad and images):
            for axis in out:
                axis.append(current)
            current, i = current + 1, i + 1
            continue
        t, h, w = images.pop(0)
        h, w = h // merge, w // merge
        for a in range(t):
            for b in range(h):
                for c in range(w):
                    for axis, value in zip(out, (a, b, c), strict=True):
                        axis.append(current + value)
        current, i = current + max(t, h, w), i + t * h * w
    return out


def test_multimodal_positions_match_the_per_token_rule():
    s = shape()
    pad, merge = s.image_token_id, s.spatial_merge_size
    grids = [[1, 2 * merge, merge], [1, merge, 3 * merge]]
    # text, an image (2 tokens), text, an image (3 tokens), a placeholder past the last image
    ids = [5, 6, pad, pad, 7, pad, pad, pad, 9, pad, 4]
    ours = mrope_positions(torch.tensor(ids), torch.tensor(grids), s)
    assert ours.tolist() == per_token_positions(ids, grids, pad, merge)
    text = mrope_positions(torch.tensor([5, 6, 7]), torch.zeros(0, 3, dtype=torch.long), s, 4)
    assert text.tolist() == [[4, 5, 6]] * 3


def test_a_row_missing_image_placeholders_is_refused_on_the_cpu():
    # the model's forward scatters the features without counting them on the device
    tokens = ((1, IMAGE, 2, 3),)  # one placeholder for a 2-token image
    masks = ((0.0, 0.0, 1.0, 1.0),)
    shard = TokenBatch(tokens, masks, masks, masks, None, (image(8, (1, 2, 4), 1.0),))
    (built,) = micro_batches.build(shard, [[0]], packed=False)
    with pytest.raises(ValueError, match="1 image placeholder tokens for 2 image features"):
        add_vision_inputs([built], shard, shape())


def test_packed_micro_batches_restart_each_sequences_positions_and_keep_image_order():
    shard = batch()
    built = micro_batches.build(shard, [[2, 0, 1]], packed=True, multiple=4)
    add_vision_inputs(built, shard, shape())
    (packed,) = built
    lengths = [len(shard.tokens[i]) - 1 for i in (2, 0, 1)]  # 5, 6, 2: 13 tokens, 3 of tail
    assert packed["positions"].shape == (3, 1, 16)
    start = 0
    for i, length in zip((2, 0, 1), lengths, strict=True):
        ours = mrope_positions(torch.tensor(shard.tokens[i][:-1]), _grids(shard, i), shape())
        assert torch.equal(packed["positions"][:, 0, start : start + length], ours)
        start += length
    # the tail is one more sequence from 0; a sequence starts where all three positions are 0
    assert packed["positions"][:, 0, 13:].tolist() == [[0, 1, 2]] * 3
    starts = (packed["positions"] == 0).all(0)[0].nonzero()[:, 0].tolist()
    assert starts == [0, 5, 11, 13]
    # images in the row's order: row 2's two images, then row 0's
    arguments = vision_arguments(packed)
    assert arguments["image_grid_thw"].tolist() == [[1, 2, 2], [1, 2, 2], [1, 2, 4]]
    assert arguments["pixel_values"][:, 0].tolist() == [3.0] * 8 + [1.0] * 8
    assert arguments["image_mask"][0].nonzero()[:, 0].tolist() == [1, 3, 7, 8]
    # the tower's layout, from the grids on the CPU: three images of 4, 4, 8 patches
    assert arguments["image_layout"].cu_seqlens.tolist() == [0, 4, 8, 16]
    # where each sequence spans, read on the CPU and given to the model's forward
    assert arguments["sequence_spans"] == [[(0, 5), (5, 11), (11, 13), (13, 16)]]


class Language:
    """The language model's stand-in: it returns the positions the attention would read."""

    def embedding(self, input_ids, position_ids):
        return None

    def __call__(self, *args, **kwargs):
        return _positions.get()


def test_the_forward_attends_by_the_given_spans_without_reading_its_positions(monkeypatch):
    """The trainer's micro-batches give their spans: the forward reads nothing off the device
    (``spans_of`` is the host read); other callers' spans are read from the positions."""
    calls = []
    monkeypatch.setattr(vlm_model, "spans_of", lambda ids: calls.append(ids) or [[(0, 2)]])
    model = SimpleNamespace(language=Language())
    ids, positions = torch.zeros(1, 4, dtype=torch.long), torch.zeros(3, 1, 4, dtype=torch.long)
    spans = [[(0, 1), (1, 4)]]
    seen = vlm_model.VisionLanguageModel.forward(model, ids, positions, sequence_spans=spans)
    assert seen.sequences == spans and calls == []
    assert vlm_model.VisionLanguageModel.forward(model, ids, positions).sequences == [[(0, 2)]]
    assert len(calls) == 1


def _grids(shard: TokenBatch, i: int) -> torch.Tensor:
    images = shard.images[i]
    return torch.zeros(0, 3, dtype=torch.long) if images is None else images.grids


@pytest.mark.parametrize("groups", [[[0, 1], [2]], [[2, 0], [1]]])
def test_micro_batches_hold_no_copy_of_the_received_pixel_values(groups):
    """A trainer rank's micro-batches keep views of the shard's received patches (one copy of
    a step's pixel values), joined one micro-batch at a time in its forward: a view where the
    rows lie in order (consecutive sequences), a copy for that forward else."""
    ids, values, pixels = batch().pack()
    shard = TokenBatch.unpack(ids, values, batch().shape(), pixels)  # as received
    built = micro_batches.build(shard, groups, packed=False)
    add_vision_inputs(built, shard, shape())
    received = pixels.untyped_storage().data_ptr()
    for micro_batch in (b for b in built if "pixel_values" in b):
        parts = micro_batch["pixel_values"]
        assert all(p.untyped_storage().data_ptr() == received for p in parts)
        joined = vision_arguments(micro_batch)["pixel_values"]
        assert torch.equal(joined, torch.cat(parts))
    first = vision_arguments(built[0])["pixel_values"]  # rows 0 and 1 (text): in order
    assert (first.untyped_storage().data_ptr() == received) == (groups[0] == [0, 1])
