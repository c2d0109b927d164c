"""TokenBatch: the trainer's input, sequences with a loss mask and a weight per token.

A batch splits into one shard per data-parallel rank (``shards``) and travels packed into two
flat tensors (``pack``/``unpack``): what a receiver allocates for them is its ``ShardShape``.
A mixture-of-experts policy's batch may carry the experts the rollout engine routed each token
to (routing replay, ``trainer/moe.py``); a vision-language policy's, each row's images (their
patches and grids, ``RowImages``), which travel as a third tensor.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate, chain, pairwise

import torch


@dataclass(frozen=True)
class RowImages:
    """One sequence's images, in the order of its image placeholder tokens: their patches
    [patches, channels x temporal x patch²] (float32 as the prompts make them; unpacked on a
    trainer rank, in the pixel dtype they travelled in, ``TokenBatch.pack``) and patch grids
    int64 [images, 3] (t, h, w)."""

    pixel_values: torch.Tensor
    grids: torch.Tensor


@dataclass(frozen=True)
class ShardShape:
    """The sizes of a packed batch: ``ids`` is int64 [sequences + tokens + routed] (each
    sequence's length, every token id, then with routed experts each input token's
    [routed_layers, topk] expert ids), ``values`` float32 [fields, tokens] (mask, weights and,
    with old logprobs, those)."""

    sequences: int
    tokens: int
    old_logprobs: bool
    routed_layers: int = 0  # MoE layers whose routing the batch carries (0: none)
    topk: int = 0
    # images (``RowImages``): their count and patches; ``patch_dim`` 0 when the batch has none
    images: int = 0
    patches: int = 0
    patch_dim: int = 0

    @property
    def routed(self) -> int:
        """Expert ids in the batch: one [layers, topk] row per input token (all but the last
        token of each sequence)."""
        return (self.tokens - self.sequences) * self.routed_layers * self.topk

    @property
    def vision(self) -> int:
        """Ids describing the images: each sequence's image count, then every image's grid."""
        return self.sequences + 3 * self.images if self.patch_dim else 0

    @property
    def fields(self) -> int:
        return 3 if self.old_logprobs else 2

    def empty(
        self, device: torch.device | str = "cpu", pixel_dtype: torch.dtype = torch.float32
    ) -> tuple[torch.Tensor, ...]:
        """Buffers a packed batch of this shape is received into (a third for the patches, in
        the ``pixel_dtype`` they were packed in)."""
        ids = self.sequences + self.tokens + self.routed + self.vision
        out = (
            torch.empty(ids, dtype=torch.long, device=device),
            torch.empty(self.fields, self.tokens, dtype=torch.float32, device=device),
        )
        if self.patch_dim:
            patches = torch.empty(self.patches, self.patch_dim, dtype=pixel_dtype, device=device)
            out += (patches,)
        return out


@dataclass(frozen=True)
class TokenBatch:
    """Sequences of token ids (prompt + response) and, per token, whether it is trained on.

    ``loss_mask[i][t]`` and ``token_weights[i][t]`` refer to predicting token ``t`` from the
    tokens before it, so position 0 is never trained on.
    """

    tokens: tuple[tuple[int, ...], ...]
    loss_mask: tuple[tuple[float, ...], ...]
    token_weights: tuple[tuple[float, ...], ...]
    # Logprobs of the tokens when they were sampled; with them the loss is PPO-clip (weights are
    # then the per-token advantages), without them it is weighted next-token likelihood.
    old_logprobs: tuple[tuple[float, ...], ...] | None = None
    # Per sequence, the experts the rollout engine routed each input token to, int
    # [len(tokens) - 1, MoE layers, top-k] (routing replay).
    routed_experts: tuple[torch.Tensor, ...] | None = None
    # Per sequence, its images (None: text only), for a vision-language policy.
    images: tuple[RowImages | None, ...] | None = None

    def __post_init__(self) -> None:
        old = self.old_logprobs or self.token_weights
        for i, (t, m, w, o) in enumerate(
            zip(self.tokens, self.loss_mask, self.token_weights, old, strict=True)
        ):
            if not len(t) == len(m) == len(w) == len(o) or len(t) < 2:
                raise ValueError(
                    f"sequence {i}: tokens, loss_mask, token_weights (and old_logprobs) need one "
                    f"entry per token and at least 2 tokens (got {len(t)}, {len(m)}, {len(w)})"
                )

    @classmethod
    def next_token(cls, tokens: list[list[int]], prompt_lengths: list[int]) -> TokenBatch:
        """Plain next-token training on the tokens after each prompt, weight 1."""
        masks = tuple(
            tuple(float(j >= n) for j in range(len(t)))
            for t, n in zip(tokens, prompt_lengths, strict=True)
        )
        return cls(tuple(map(tuple, tokens)), masks, tuple(tuple(1.0 for _ in t) for t in tokens))

    def __len__(self) -> int:
        return len(self.tokens)

    def select(self, indices: range) -> TokenBatch:
        def pick(rows):
            return None if rows is None else tuple(rows[i] for i in indices)

        return TokenBatch(
            pick(self.tokens),
            pick(self.loss_mask),
            pick(self.token_weights),
            pick(self.old_logprobs),
            pick(self.routed_experts),
            pick(self.images),
        )

    def shards(self, count: int) -> list[TokenBatch]:
        """``count`` equal contiguous shards, one per data-parallel rank, in rank order."""
        if len(self) % count:
            raise ValueError(
                f"batch of {len(self)} sequences does not split over {count} data-parallel ranks"
            )
        size = len(self) // count
        return [self.select(range(i * size, (i + 1) * size)) for i in range(count)]

    @classmethod
    def join(cls, parts: list[TokenBatch]) -> TokenBatch:
        """``parts``' rows, in order, as one batch (``shards``' inverse). Rows of a text-only
        part get no images beside a part with images; old logprobs and routed experts, which
        have no such stand-in, must be on every part or on none."""
        if not parts:
            raise ValueError("no batches to join")

        def rows(name: str) -> tuple | None:
            found = [getattr(part, name) for part in parts]
            if all(f is None for f in found):
                return None
            if name == "images":  # a text-only part's rows: no images
                found = [
                    (None,) * len(p) if f is None else f for p, f in zip(parts, found, strict=True)
                ]
            elif any(f is None for f in found):
                raise ValueError(f"joined batches must all carry {name}, or none of them")
            return tuple(chain.from_iterable(found))

        fields = ("tokens", "loss_mask", "token_weights", "old_logprobs", "routed_experts")
        return cls(*(rows(name) for name in fields), images=rows("images"))

    def _images(self) -> list[RowImages]:
        return [row for row in self.images or () if row is not None]

    def shape(self) -> ShardShape:
        routed = self.routed_experts[0].shape[1:] if self.routed_experts else (0, 0)
        images = self._images()
        return ShardShape(
            len(self),
            sum(len(t) for t in self.tokens),
            self.old_logprobs is not None,
            *routed,
            images=sum(len(r.grids) for r in images),
            patches=sum(len(r.pixel_values) for r in images),
            patch_dim=images[0].pixel_values.shape[1] if images else 0,
        )

    def pack(self, pixel_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, ...]:
        """The batch as two flat tensors, no padding, and a third of patches in ``pixel_dtype``
        when it has images (see ``ShardShape``)."""
        lengths = [len(t) for t in self.tokens]
        ids = torch.tensor(list(chain(lengths, *self.tokens)), dtype=torch.long)
        if self.routed_experts:
            ids = torch.cat([ids, *(r.reshape(-1).long() for r in self.routed_experts)])
        fields = [self.loss_mask, self.token_weights]
        if self.old_logprobs is not None:
            fields.append(self.old_logprobs)
        values = torch.tensor([list(chain.from_iterable(f)) for f in fields], dtype=torch.float32)
        images = self._images()
        if not images:
            return ids, values
        counts = torch.tensor([0 if r is None else len(r.grids) for r in self.images or ()])
        grids = [r.grids.reshape(-1).long() for r in images]
        pixels = torch.cat([r.pixel_values.to(pixel_dtype) for r in images])
        return torch.cat([ids, counts, *grids]), values, pixels

    @classmethod
    def unpack(
        cls,
        ids: torch.Tensor,
        values: torch.Tensor,
        shape: ShardShape,
        pixels: torch.Tensor | None = None,
    ) -> TokenBatch:
        """The batch ``pack`` made, from its tensors (on any device)."""
        flat_ids = ids[: shape.sequences + shape.tokens].tolist()
        spans = list(pairwise(accumulate(flat_ids[: shape.sequences], initial=0)))

        def rows(flat: list) -> tuple[tuple, ...]:
            return tuple(tuple(flat[start:end]) for start, end in spans)

        fields = [rows(v) for v in values.tolist()]
        old = fields[2] if shape.old_logprobs else None
        tokens_end = shape.sequences + shape.tokens
        routed = None
        if shape.routed:
            per_token = shape.routed_layers * shape.topk
            inputs = [end - start - 1 for start, end in spans]
            flat = ids[tokens_end:].cpu().split([n * per_token for n in inputs])
            routed = tuple(
                r.view(n, shape.routed_layers, shape.topk)
                for r, n in zip(flat, inputs, strict=True)
            )
        tokens = rows(flat_ids[shape.sequences : tokens_end])
        images = None
        if shape.patch_dim:
            images = unpack_images(ids[tokens_end + shape.routed :].cpu(), pixels, shape)
        return cls(tokens, fields[0], fields[1], old, routed, images)

    def tensors(self, pad_id: int = 0, multiple: int = 1) -> dict[str, torch.Tensor]:
        """Right-padded inputs, targets, mask and weights, each [batch, longest - 1], the
        length rounded up to a ``multiple`` (sequence parallelism splits it over TP ranks)."""
        longest = -(-(max(len(t) for t in self.tokens) - 1) // multiple) * multiple + 1

        def pad(
            rows: tuple[tuple[float, ...], ...], value: float, dtype: torch.dtype
        ) -> torch.Tensor:
            return torch.tensor([list(r) + [value] * (longest - len(r)) for r in rows], dtype=dtype)

        tokens = pad(self.tokens, pad_id, torch.long)
        out = {
            "inputs": tokens[:, :-1].contiguous(),
            "targets": tokens[:, 1:].contiguous(),
            "mask": pad(self.loss_mask, 0.0, torch.float32)[:, 1:].contiguous(),
            "weights": pad(self.token_weights, 0.0, torch.float32)[:, 1:].contiguous(),
        }
        if self.old_logprobs is not None:
            out["old_logprobs"] = pad(self.old_logprobs, 0.0, torch.float32)[:, 1:].contiguous()
        out["valid"] = pad(tuple((1.0,) * len(t) for t in self.tokens), 0.0, torch.float32)[:, 1:]
        if self.routed_experts:
            out["routed_experts"] = padded_routing(self.routed_experts, longest - 1)
        return out


def unpack_images(
    ids: torch.Tensor, pixels: torch.Tensor, shape: ShardShape
) -> tuple[RowImages | None, ...]:
    """Each sequence's images from the packed image ids (counts, then grids) and patches."""
    counts = ids[: shape.sequences].tolist()
    grids = ids[shape.sequences :].view(-1, 3)
    rows: list[RowImages | None] = []
    image = patch = 0
    for count in counts:
        if not count:
            rows.append(None)
            continue
        grid = grids[image : image + count]
        size = int(grid.prod(-1).sum())
        rows.append(RowImages(pixels[patch : patch + size], grid))
        image, patch = image + count, patch + size
    return tuple(rows)


def padded_routing(routed: tuple[torch.Tensor, ...], length: int) -> torch.Tensor:
    """Each sequence's routing [inputs, layers, k], right-padded to ``length`` inputs with
    experts 0..k-1 (padding is computed, never trained on), stacked [batch, length, layers, k]."""
    layers, k = routed[0].shape[1:]
    out = torch.arange(k).expand(len(routed), length, layers, k).clone()
    for row, experts in zip(out, routed, strict=True):
        row[: len(experts)] = experts
    return out
