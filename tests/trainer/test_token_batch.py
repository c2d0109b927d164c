"""``TokenBatch.join``: batches' rows in order as one batch, every field (``shards``' inverse);
a text-only part beside one with images gets rows without images; a field with no stand-in
(old logprobs, routed experts) on some parts only is refused."""

from __future__ import annotations

import pytest
import torch

from relax_launch.trainer.batch import RowImages, TokenBatch


def full_batch(rows: int) -> TokenBatch:
    """Rows with every field: old logprobs, routed experts, and images on every other row."""
    tokens = tuple(tuple(range(10 * i, 10 * i + 3 + i % 2)) for i in range(rows))
    plain = TokenBatch.next_token([list(t) for t in tokens], [1] * rows)
    routed = tuple(torch.full((len(t) - 1, 2, 1), i) for i, t in enumerate(tokens))
    images = tuple(
        RowImages(torch.rand(4, 6), torch.tensor([[1, 2, 2]])) if i % 2 else None
        for i in range(rows)
    )
    old = tuple(tuple(-0.1 * j for j in range(len(t))) for t in tokens)
    return TokenBatch(plain.tokens, plain.loss_mask, plain.token_weights, old, routed, images)


FIELDS = ("tokens", "loss_mask", "token_weights", "old_logprobs", "routed_experts", "images")


def same_rows(a: TokenBatch, b: TokenBatch) -> bool:
    """Every field row for row (the tensors themselves: a join copies none)."""
    return all(
        len(getattr(a, f)) == len(getattr(b, f))
        and all(x is y or x == y for x, y in zip(getattr(a, f), getattr(b, f), strict=True))
        for f in FIELDS
    )


def test_joining_the_shards_gives_the_batch_back_with_every_field() -> None:
    batch = full_batch(6)
    joined = TokenBatch.join(batch.shards(3))
    assert same_rows(joined, batch)
    assert joined.shape() == batch.shape()  # images and routing travel as before


def test_a_text_only_part_joined_with_an_image_part_has_rows_without_images() -> None:
    text = TokenBatch.next_token([[1, 2, 3], [4, 5]], [1, 1])
    image = full_batch(2)
    image = TokenBatch(image.tokens, image.loss_mask, image.token_weights, images=image.images)
    joined = TokenBatch.join([text, image])
    assert joined.tokens == text.tokens + image.tokens
    assert joined.images[:2] == (None, None) and joined.images[2:] == image.images
    assert joined.old_logprobs is None and joined.routed_experts is None
    shape = joined.shape()
    back = TokenBatch.unpack(*joined.pack()[:2], shape, joined.pack()[2])
    assert back.images[:3] == (None, None, None) and torch.equal(
        back.images[3].pixel_values, image.images[1].pixel_values
    )


@pytest.mark.parametrize("field", ["old_logprobs", "routed_experts"])
def test_a_field_on_some_parts_only_is_refused(field: str) -> None:
    whole = full_batch(2)
    bare = TokenBatch(whole.tokens, whole.loss_mask, whole.token_weights)
    part = TokenBatch(
        whole.tokens, whole.loss_mask, whole.token_weights, **{field: getattr(whole, field)}
    )
    with pytest.raises(ValueError, match=f"must all carry {field}"):
        TokenBatch.join([part, bare])


def test_nothing_to_join_is_refused() -> None:
    with pytest.raises(ValueError, match="no batches to join"):
        TokenBatch.join([])
