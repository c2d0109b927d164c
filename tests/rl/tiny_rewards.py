"""A reward the random tiny Llama can earn, so its groups have reward variance (and gradient):
the share of even token ids in a response. Async and batched, as user reward functions may be."""

from __future__ import annotations


async def even_tokens(samples) -> list[float]:
    return [sum(t % 2 == 0 for t in s.response_ids) / max(1, len(s.response_ids)) for s in samples]


def alternating(samples) -> list[float]:
    """1, 0, 1, 0, ... down the batch: every group of two or more samples has signal, whatever
    the random model wrote (for tests that assert a gradient)."""
    return [float(i % 2 == 0) for i in range(len(samples))]


def alternating_for_odd_sums(samples) -> list[float]:
    """``alternating`` where the prompt's answer is odd; 0 for every sample of an even one, so
    exactly those groups carry no signal (what dynamic sampling drops)."""
    return [float(i % 2 == 0) if int(s.label) % 2 else 0.0 for i, s in enumerate(samples)]
