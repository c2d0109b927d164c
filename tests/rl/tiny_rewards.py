"""A reward the random tiny Llama can earn, so its groups have reward variance (and gradient):
the share of even token ids in a response. Async and batched, as user reward functions may be."""

from __future__ import annotations


async def even_tokens(samples) -> list[float]:
    return [sum(t % 2 == 0 for t in s.response_ids) / max(1, len(s.response_ids)) for s in samples]


def even_tokens_for_odd_sums(samples) -> list[float]:
    """even_tokens where the prompt's answer is odd; 0 for every sample of an even one, so those
    groups carry no signal (what dynamic sampling drops)."""
    return [
        sum(t % 2 == 0 for t in s.response_ids) / max(1, len(s.response_ids))
        if int(s.label) % 2
        else 0.0
        for s in samples
    ]
