"""How a data-parallel shard becomes micro-batches: grouping, padding or packing, and the
context-parallel split.

A sequence of ``n`` tokens trains on ``n - 1`` (input, target) pairs, its *length* here.

- **Grouping.** A fixed ``micro_batch_size`` takes the sequences in order; a token budget
  (``max_tokens``) sorts them by length and fills each micro-batch while the tokens it computes
  (padding included) stay within the budget, so the count per micro-batch varies.
- **Padded** micro-batches hold one sequence per row, right-padded to the longest. **Packed**
  ones hold their sequences end to end in one row, positions restarting at each; the
  attention (``trainer/attention.py``) reads where each sequence starts from the positions and
  never crosses a boundary, and no padding is computed but the row's tail up to the length
  multiple (itself one more sequence, never trained on).
- **Context parallelism** gives each of ``cp`` ranks a contiguous slice of every row; the
  model's per-token output is gathered back before the loss.

Each micro-batch is a dict of tensors in two layouts. The model's, [rows, length]: ``inputs``,
``targets``, ``positions``, ``valid``, ``trained`` and with routing replay
``routed_experts``. The loss's, [sequences, longest]:
``mask``, ``weights``, ``old_logprobs`` and ``order`` (each row's index in the shard); packed,
``gather`` indexes the model's flattened output for each of them.
"""

from __future__ import annotations

import torch

from relax_launch.trainer.batch import TokenBatch, padded_routing


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def group_sequences(
    lengths: list[int],
    *,
    micro_batch_size: int,
    max_tokens: int | None,
    packed: bool,
    multiple: int = 1,
) -> list[list[int]]:
    """Indices of the sequences of each micro-batch. ``lengths`` are trained tokens per
    sequence; a budget counts the tokens a micro-batch computes (rows x longest padded, or the
    packed row), each rounded up to ``multiple``."""
    if max_tokens is None:
        return [
            list(range(i, min(i + micro_batch_size, len(lengths))))
            for i in range(0, len(lengths), micro_batch_size)
        ]
    longest = max(lengths)
    if round_up(longest, multiple) > max_tokens:
        raise ValueError(
            f"a sequence of {longest + 1} tokens does not fit "
            f"trainer.max_tokens_per_micro_batch={max_tokens} (rounded to a multiple of "
            f"{multiple}): raise the budget to at least {round_up(longest, multiple)}, or "
            "shorten the rollout's prompts and answers"
        )
    ordered = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    if not packed:  # longest first: a micro-batch's first sequence sets its padded length
        groups: list[list[int]] = []
        for i in ordered:
            if (
                groups
                and (len(groups[-1]) + 1) * round_up(lengths[groups[-1][0]], multiple) <= max_tokens
            ):
                groups[-1].append(i)
            else:
                groups.append([i])
        return groups
    bins: list[tuple[int, list[int]]] = []  # first fit, longest first
    for i in ordered:
        for b, (used, members) in enumerate(bins):
            if round_up(used + lengths[i], multiple) <= max_tokens:
                bins[b] = (used + lengths[i], [*members, i])
                break
        else:
            bins.append((lengths[i], [i]))
    return [members for _, members in bins]


def split_to(groups: list[list[int]], count: int) -> list[list[int]]:
    """``groups`` split (largest first) into ``count`` micro-batches, for ranks that must run
    as many as their peers (expert parallelism exchanges tokens in every micro-batch); with
    fewer sequences than ``count``, the rest are empty (computed, never trained on)."""
    groups = [list(g) for g in groups]
    while len(groups) < count:
        largest = max(range(len(groups)), key=lambda i: len(groups[i]))
        if len(groups[largest]) < 2:
            groups.extend([] for _ in range(count - len(groups)))
            break
        members = groups.pop(largest)
        half = len(members) // 2
        groups[largest:largest] = [members[:half], members[half:]]
    return groups


def build(
    shard: TokenBatch,
    groups: list[list[int]],
    *,
    packed: bool,
    multiple: int = 1,
    cp: tuple[int, int] = (0, 1),
) -> list[dict[str, torch.Tensor]]:
    """The micro-batches of ``groups`` (see the module docstring), this CP rank's slice
    (``cp`` = (rank, size); ``multiple`` must count the CP size)."""
    make = _packed if packed else _padded
    return [_context_slice(make(shard, group, multiple), cp) for group in groups]


def _padded(shard: TokenBatch, group: list[int], multiple: int) -> dict[str, torch.Tensor]:
    if not group:
        return _empty(shard, multiple)
    part = shard.select(group)
    out = part.tensors(0, multiple)
    length = out["inputs"].shape[1]
    out["positions"] = torch.arange(length).expand(len(group), length).contiguous()
    out["trained"] = out["mask"]
    out["order"] = torch.tensor(group)
    return out


def _packed(shard: TokenBatch, group: list[int], multiple: int) -> dict[str, torch.Tensor]:
    if not group:
        return _empty(shard, multiple)
    part = shard.select(group)
    lengths = [len(t) - 1 for t in part.tokens]
    total = round_up(sum(lengths), multiple)
    padded = part.tensors()  # [sequences, longest]: the loss's layout
    real = padded["valid"] > 0
    starts = torch.tensor([0, *lengths]).cumsum(0)[:-1]
    gather = (starts[:, None] + torch.arange(real.shape[1])[None]).where(real, 0)
    positions = torch.cat([torch.arange(n) for n in [*lengths, total - sum(lengths)]])

    def flat(values: torch.Tensor) -> torch.Tensor:
        out = torch.zeros((1, total, *values.shape[2:]), dtype=values.dtype)
        out[0, gather[real]] = values[real]
        return out

    out = {
        "inputs": flat(padded["inputs"]),
        "targets": flat(padded["targets"]),
        "positions": positions[None],
        "valid": flat(padded["valid"]),
        "trained": flat(padded["mask"]),
        "gather": gather,
        "order": torch.tensor(group),
    }
    if part.routed_experts:
        routed = flat(padded_routing(part.routed_experts, real.shape[1]))
        routed[0, sum(lengths) :] = torch.arange(routed.shape[-1])  # padding: experts 0..k-1
        out["routed_experts"] = routed
    out |= {k: padded[k] for k in ("mask", "weights", "old_logprobs") if k in padded}
    return out


def _empty(shard: TokenBatch, multiple: int) -> dict[str, torch.Tensor]:
    """A micro-batch of padding alone (``split_to``): computed, never trained on."""
    zeros = torch.zeros(1, multiple)
    out = {
        "inputs": zeros.long(),
        "targets": zeros.long(),
        "positions": torch.arange(multiple)[None],
        "valid": zeros,
        "trained": zeros,
        "mask": zeros,
        "weights": zeros,
        "order": torch.zeros(0, dtype=torch.long),
    }
    if shard.old_logprobs is not None:
        out["old_logprobs"] = zeros
    if shard.routed_experts:
        layers, k = shard.routed_experts[0].shape[1:]
        out["routed_experts"] = torch.arange(k).expand(1, multiple, layers, k).clone()
    return out


MODEL_LAYOUT = ("inputs", "targets", "positions", "valid", "trained", "routed_experts")


def _context_slice(batch: dict[str, torch.Tensor], cp: tuple[int, int]) -> dict[str, torch.Tensor]:
    """This CP rank's contiguous slice of the model's layout."""
    rank, size = cp
    if size == 1:
        return batch
    length = batch["inputs"].shape[1] // size
    local = slice(rank * length, (rank + 1) * length)
    out = dict(batch)
    for key in (k for k in MODEL_LAYOUT if k in batch):
        out[key] = batch[key][:, local]
    return out
