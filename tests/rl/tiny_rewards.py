"""A reward the random tiny Llama can earn, so its groups have reward variance (and gradient):
the share of even token ids in a response. Async and batched, as user reward functions may be."""

from __future__ import annotations


async def even_tokens(samples) -> list[float]:
    return [sum(t % 2 == 0 for t in s.response_ids) / max(1, len(s.response_ids)) for s in samples]
