"""The trainer's attention: every token rotated by its own position id, and attention that
never crosses a sequence's boundary, in padded rows, packed rows and context-parallel slices.

A micro-batch gives the model each token's position (``trainer/micro_batches.py``); a position
0 starts a sequence. From them (``use_position_ids``, once per forward):

- the rotary embedding rotates each token by its position, not its index in the row (Megatron's
  assumes index = position, and with context parallelism its own split of the sequence);
- ``CoreAttention`` (in place of Megatron's local ``DotProductAttention``) attends causally
  within each sequence of a row: torch's fused scaled-dot-product attention, once for a batch of
  one sequence per row, else once per sequence of a packed row, so a packed row costs the sum
  of its sequences' squares, not the square of its length;
- with context parallelism (the all-gather form of it: Megatron's local attention has none)
  each rank keeps the queries of its contiguous slice, gathers every rank's keys and values,
  and masks what a query may not see (another sequence, or later) from the gathered positions.
"""

from __future__ import annotations

import math
from contextvars import ContextVar
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

MASKED = -10000.0  # as Megatron's local attention: finite, so a fully masked row is no NaN
Spans = list[list[tuple[int, int]]]  # per row, (start, end) of each of its sequences


@dataclass(frozen=True)
class Positions:
    """The position ids of the forward being computed, and what attention derives from them."""

    ids: torch.Tensor  # [batch, sequence] of this rank's slice
    # per row, (start, end) of each sequence; None: one sequence per row (the fast path)
    sequences: Spans | None
    masked: torch.Tensor | None = None  # context parallel: [batch, 1, local, whole] True = masked


_POSITIONS: ContextVar[Positions] = ContextVar("positions")


class _GatherSequence(torch.autograd.Function):
    """All-gather along ``dim`` over a group; the gradient of each rank's slice is the sum of
    every rank's gradient for it (all-reduce, which every backend has, then the slice)."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: Any, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim, ctx.rank = group, dim, dist.get_rank(group)
        parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, tensor.contiguous(), group=group)
        return torch.cat(parts, dim=dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad.chunk(dist.get_world_size(ctx.group), dim=ctx.dim)[ctx.rank], None, None


def gather_sequence(tensor: torch.Tensor, group: Any, dim: int) -> torch.Tensor:
    """Every context-parallel rank's slice of ``tensor`` along ``dim``, in rank order (which is
    the sequence's order: each rank holds a contiguous slice)."""
    return _GatherSequence.apply(tensor, group, dim)


def positions_of(ids: torch.Tensor, cp: Any) -> Positions:
    """What attention needs from this forward's position ids (one host read per forward)."""
    if cp.size() > 1:
        whole = gather_sequence(ids, cp, dim=1)
        sequence = (whole == 0).cumsum(1)  # which sequence of the row each token is in
        local = slice(cp.rank() * ids.shape[1], (cp.rank() + 1) * ids.shape[1])
        index = torch.arange(whole.shape[1], device=ids.device)
        later = index[None, :] > index[local, None]
        other = sequence[:, local, None] != sequence[:, None, :]
        return Positions(ids, None, (later[None] | other)[:, None])
    return Positions(ids, sequence_spans(ids == 0))


def sequence_spans(starts: torch.Tensor) -> Spans | None:
    """Per row of ``starts`` ([batch, sequence], True where a sequence starts), (start, end)
    of each sequence; None when every row holds one (the fast path)."""
    if not bool(starts[:, 1:].any()):
        return None
    rows = [[*row.nonzero()[:, 0].tolist(), starts.shape[1]] for row in starts]
    return [list(pairwise(row)) for row in rows]


def set_positions(positions: Positions) -> None:
    """The positions ``CoreAttention`` attends by in the forward being computed (a model that
    derives them itself: the vision-language model's, from its multimodal positions)."""
    _POSITIONS.set(positions)


def use_position_ids(model: Any) -> None:
    """Make ``model`` (a GPTModel with ``CoreAttention``) rotate and attend by the position ids
    given to its forward."""
    rotary, cp = model.rotary_pos_emb, model.pg_collection.cp

    def remember(module: Any, args: tuple, kwargs: dict) -> None:
        ids = kwargs.get("position_ids", args[1] if len(args) > 1 else None)
        _POSITIONS.set(positions_of(ids, cp))

    def per_token(max_seq_len: int, *args: Any, **kwargs: Any) -> torch.Tensor:
        ids = _POSITIONS.get().ids
        table = rotary.get_emb(ids.shape[1] * cp.size())[:, 0]  # [row length, 1, dim]
        return table[ids.t()]  # [sequence, batch, 1, dim]

    model.register_forward_pre_hook(remember, with_kwargs=True)
    rotary.forward = per_token  # Megatron's would also slice it for context parallelism


class CoreAttention(torch.nn.Module):
    """Causal attention within each sequence (see the module docstring); takes the place of
    Megatron's ``DotProductAttention`` in the layer spec, with its signature."""

    def __init__(
        self,
        config: Any,
        layer_number: int,
        attn_mask_type: Any,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: Any = None,
    ) -> None:
        super().__init__()
        self.cp = pg_collection.cp
        self.scale = softmax_scale or 1.0 / math.sqrt(config.kv_channels)
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout:
            raise ValueError("the trainer's attention has no dropout (the trainer sets 0)")

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Any = None,
        attn_mask_type: Any = None,
        attention_bias: Any = None,
        packed_seq_params: Any = None,
    ) -> torch.Tensor:
        """[sequence, batch, heads, dim] queries, keys and values (this rank's slice) ->
        [sequence, batch, heads * dim]."""
        positions = _POSITIONS.get()
        if positions.masked is not None:
            key, value = (gather_sequence(t, self.cp, 0) for t in (key, value))
        repeat = query.shape[2] // key.shape[2]  # grouped-query attention
        key, value = (t.repeat_interleave(repeat, dim=2) for t in (key, value))
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, seq, dim]
        if positions.masked is not None:
            context = self._masked(q, k, v, positions.masked)
        elif positions.sequences is None:
            context = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
        else:
            context = torch.cat(
                [self._row(q, k, v, r, s) for r, s in enumerate(positions.sequences)]
            )
        return context.permute(2, 0, 1, 3).flatten(2)

    def _row(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, row: int, spans: list) -> Any:
        parts = [
            F.scaled_dot_product_attention(
                *(t[row : row + 1, :, start:end] for t in (q, k, v)),
                is_causal=True,
                scale=self.scale,
            )
            for start, end in spans
        ]
        return torch.cat(parts, dim=2)

    def _masked(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, masked: Any) -> Any:
        scores = torch.matmul(q, k.transpose(-1, -2)).float() * self.scale
        probs = scores.masked_fill(masked, MASKED).softmax(-1).to(v.dtype)
        return torch.matmul(probs, v)
