"""The order of one weight update's broadcasts, computed alike by the sender
(``weights/sync.py``) and each engine rank (``weights/receiver.py``) from the update's manifest
and the sender's bucketing, which travels in the request's ``load_format`` so the two can never
disagree. No torch at import: the receiver plugin loads it in every SGLang process."""

from __future__ import annotations

import math
from dataclasses import dataclass

IN_PLACE = "relax_in_place"  # the load_format prefix the receiver takes


def in_place_format(pack_below: int, bucket_bytes: int) -> str:
    """The ``load_format`` of a broadcast update this receiver takes: ``IN_PLACE`` and the
    sender's bucketing, so the engine follows the sender's plan rather than assuming it."""
    return f"{IN_PLACE}:{pack_below}:{bucket_bytes}"


def bucketing(load_format: str | None) -> tuple[int, int] | None:
    """``in_place_format``'s bucketing back; None for a format that is not this receiver's."""
    name, _, sizes = (load_format or "").partition(":")
    if name != IN_PLACE or not sizes:
        return None
    pack_below, bucket_bytes = (int(size) for size in sizes.split(":"))
    return pack_below, bucket_bytes


@dataclass(frozen=True)
class Broadcast:
    """One broadcast of an update:

    - a tensor alone (``bucket`` False), received in place where it fits a parameter; one
      larger than a bucket goes in parts, ``rows`` [begin, end) of its first dimension each;
    - a bucket of small tensors of one dtype, end to end, copied out once received; where they
      are consecutive slices ``NAME[i]`` of one stacked parameter (a MoE layer's routed
      experts), ``stacked`` names it and the bucket is received straight into its slices."""

    indices: tuple[int, ...]  # into the update's manifest
    dtype: str
    bucket: bool
    rows: tuple[int, int] | None = None
    stacked: str | None = None


OPEN_RUNS = 2  # stacked runs filling at once (a MoE layer's w13 and w2 experts interleave)


def stacked_slice(name: str) -> tuple[str, int] | None:
    """``NAME[i]`` as (NAME, i); None for a name that is not a slice of a stacked tensor."""
    stem, _, index = name.partition("[")
    return (stem, int(index[:-1])) if index[:-1].isdigit() and index[-1:] == "]" else None


def broadcast_plan(
    names: list[str],
    dtypes: list[str],
    shapes: list[list[int]],
    pack_below: int,
    bucket_bytes: int,
) -> list[Broadcast]:
    """An update's broadcasts in order, the same on sender and engine: tensors of
    ``pack_below`` bytes or more alone where they come (in parts of at most about
    ``bucket_bytes`` past that, so no receive buffer needs more); the smaller ones gathered into
    buckets, each sent where it reaches ``bucket_bytes``: slices of one stacked tensor together
    (at most ``OPEN_RUNS`` such runs open), in slot order, the rest per dtype, what is left at
    the end. A model of many small tensors costs one collective per bucket, not one per tensor
    (0.35 ms each in gloo, a launch each in NCCL), and a MoE's experts, whose slots follow one
    another in a run, still land in place."""
    plan: list[Broadcast] = []
    buckets: dict[tuple[str, str | None], list[int]] = {}  # (dtype, stacked or None) -> filling
    filled: dict[tuple[str, str | None], int] = {}

    def send(key: tuple[str, str | None]) -> None:
        indices, stacked = buckets.pop(key), key[1]
        filled.pop(key)
        if stacked is not None:  # in slot order; in place only if the slots follow
            indices.sort(key=lambda i: stacked_slice(names[i])[1])
            slots = [stacked_slice(names[i])[1] for i in indices]
            stacked = stacked if slots == list(range(slots[0], slots[0] + len(slots))) else None
        plan.append(Broadcast(tuple(indices), key[0], bucket=True, stacked=stacked))

    for i, (name, dtype, shape) in enumerate(zip(names, dtypes, shapes, strict=True)):
        size = nbytes(dtype, shape)
        if size >= pack_below:
            plan += _alone(i, dtype, shape, size, bucket_bytes)
            continue
        stacked = stacked_slice(name)
        key = (dtype, stacked and stacked[0])
        runs = [k for k in buckets if k[1] is not None]
        if stacked and key not in buckets and len(runs) == OPEN_RUNS:
            send(runs[0])  # the oldest run goes: its layer is done
        buckets.setdefault(key, []).append(i)
        filled[key] = filled.get(key, 0) + size
        if filled[key] >= bucket_bytes:
            send(key)
    for key in list(buckets):
        send(key)
    return plan


def _alone(index: int, dtype: str, shape: list[int], size: int, bucket_bytes: int) -> list:
    """One tensor's broadcasts: whole, or in parts of whole rows of at most about a bucket."""
    rows = shape[0] if shape else 1
    parts = min(rows, -(-size // bucket_bytes)) if shape else 1
    if parts <= 1:
        return [Broadcast((index,), dtype, bucket=False)]
    step = -(-rows // parts)
    return [
        Broadcast((index,), dtype, bucket=False, rows=(begin, min(begin + step, rows)))
        for begin in range(0, rows, step)
    ]


def nbytes(dtype: str, shape: list[int]) -> int:
    """Bytes of a tensor of ``dtype`` (torch's name, e.g. "bfloat16") and ``shape``."""
    import torch

    return getattr(torch, dtype).itemsize * math.prod(shape)
