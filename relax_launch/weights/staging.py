"""An engine rank's receive buffers for one broadcast update, all freed with it (never kept
for the next sync):

- ``Receives``: the buckets of small tensors, at most ``BUCKETS_POSTED`` buffers of the
  update's largest bucket at once, each copied out into the parameters once received;
- ``Staging``: where tensors that fit no parameter of the rank are received (a layout SGLang's
  ``load_weights`` must reshape or pad, another pipeline stage's tensors): one buffer of at
  most the sender's bucket size (or the largest such tensor), reused within the update.

Staged tensors are carved from the buffer one after the other; when the next one would not fit,
every receive posted so far is completed, what the buffer holds goes to ``load_weights`` and the
buffer is reused. Another stage's tensors take room but are never read.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from typing import Any

from relax_launch.weights.update_plan import Broadcast, nbytes

NAME = "staging"  # the buffer's key in the receiver's buffers (``_ReceiverState.staging``)
ALIGN = 64  # every staged tensor starts on a 64-byte boundary
BUCKETS_POSTED = 2  # bucket buffers an engine rank receives into at once


class Receives:
    """One update's receives on an engine rank (``state``: the receiver's, which finds each
    tensor's parameter; ``wait``: how a receive is waited for, ``receiver.wait_unless_aborted``).
    They are posted ahead of their waits (the sender never waits for this process to get round
    to the next tensor); a bucket's only while one of ``BUCKETS_POSTED`` buffers is free, so the
    buckets' memory stays bounded however many small tensors a model has. A bucket, once
    received, is copied out into the parameters (or to ``load_weights``, as a copy: its buffer
    is reused)."""

    def __init__(
        self,
        state: Any,
        group: Any,
        names: list[str],
        shapes: list[list[int]],
        bucket_bytes: int,
        device: Any,
        wait: Callable[[Any, Any], None],
    ) -> None:
        self.state, self.group, self.names, self.shapes = state, group, names, shapes
        self.wait = wait
        self.bucket_bytes, self.device = bucket_bytes, device  # each buffer: the largest bucket
        self.posted: deque = deque()  # (work, Broadcast, destination, its bucket buffer)
        self.free: list[Any] = [None] * BUCKETS_POSTED  # made when a bucket first needs one
        self.staged: list[tuple[str, Any]] = []
        self.copied = self.elsewhere = 0

    def bucket_buffer(self, item: Broadcast) -> tuple[Any, Any]:
        """Where bucket ``item`` is received, once a buffer is free: the part of that buffer
        it fills, as its dtype, and the buffer."""
        import torch

        while not self.free:
            self.complete_oldest()
        buffer = self.free.pop()
        if buffer is None:
            buffer = torch.empty(self.bucket_bytes, dtype=torch.uint8, device=self.device)
        dtype = getattr(torch, item.dtype)
        numel = sum(math.prod(self.shapes[i]) for i in item.indices)
        return buffer[: numel * dtype.itemsize].view(dtype), buffer

    def post(self, item: Broadcast, destination: Any, buffer: Any = None) -> None:
        """Post the receive of ``item`` into ``destination`` (a part of bucket ``buffer``)."""
        import torch

        work = torch.distributed.broadcast(destination, src=0, group=self.group, async_op=True)
        self.posted.append((work, item, destination, buffer))

    def complete_all(self) -> None:
        while self.posted:
            self.complete_oldest()

    def complete_oldest(self) -> None:
        work, item, destination, buffer = self.posted.popleft()
        self.wait(work, self.group)
        if buffer is not None:
            self._take_out(destination, item.indices)
            self.free.append(buffer)

    def _take_out(self, bucket: Any, indices: tuple[int, ...]) -> None:
        offset = 0
        for i in indices:
            name, shape = self.names[i], self.shapes[i]
            piece = bucket[offset : offset + math.prod(shape)].view(shape)
            offset += piece.numel()
            destination = self.state.direct(name, piece.dtype, shape)
            if destination is None and self.state.elsewhere(name):
                self.elsewhere += 1
            elif destination is None:  # the buffer is reused: load_weights gets a copy
                self.staged.append((name, piece.clone()))
            else:
                destination.copy_(piece)
                self.copied += 1

    def buffer_bytes(self) -> int:
        """The bucket buffers this update made (all free again once it completed)."""
        return sum(buffer is not None for buffer in self.free) * self.bucket_bytes


def largest_bucket(plan: list[Broadcast], dtypes: list[str], shapes: list[list[int]]) -> int:
    """Bytes of the update's largest bucket: the size of each bucket buffer."""
    sizes = [sum(nbytes(dtypes[i], shapes[i]) for i in b.indices) for b in plan if b.bucket]
    return max(sizes, default=0)


class Staging:
    """``allocate(nbytes)`` makes (or returns) the buffer; ``load`` hands staged (name, tensor)
    pairs to ``load_weights``."""

    def __init__(
        self,
        capacity: int,
        allocate: Callable[[int], Any],
        load: Callable[[list[tuple[str, Any]]], None],
    ) -> None:
        self.capacity, self.allocate, self.load = capacity, allocate, load
        self.buffer: Any = None
        self.used = 0
        self.pending: list[tuple[str, Any]] = []  # received here, not loaded yet
        self.num_loaded = self.loaded_bytes = 0  # loaded while the update went on
        self.peak_bytes = 0

    @classmethod
    def of_update(cls, state: Any, capacity: int, updater: Any) -> Staging:
        """The staging of an update on ``updater``'s engine rank: its buffer one of the
        receiver ``state``'s (freed when the update finishes), staged tensors loaded under
        their checkpoint names (``for_load_weights``)."""
        import torch

        def allocate(nbytes: int) -> Any:
            return state.staging(NAME, torch.uint8, [nbytes], updater.device)

        return cls(
            capacity,
            allocate,
            lambda pairs: updater.get_model().load_weights(for_load_weights(pairs)),
        )

    def take(
        self, name: str, dtype: Any, shape: list[int], complete: Callable[[], None], keep: bool
    ) -> Any:
        """Room for tensor ``name``; ``keep``: it goes to ``load_weights`` (else it is another
        stage's, dropped). ``complete`` finishes every receive posted so far: called before
        the buffer is reused."""
        nbytes = math.prod(shape) * dtype.itemsize
        if self.buffer is not None and self.used + nbytes > self.buffer.numel():
            complete()
            self.flush()
            self.used = 0
            if nbytes > self.buffer.numel():
                self.buffer = None  # freed before a larger one is made
        if self.buffer is None:
            self.buffer = self.allocate(max(self.capacity, nbytes))
            self.peak_bytes = max(self.peak_bytes, self.buffer.numel())
        piece = self.buffer[self.used : self.used + nbytes].view(dtype).view(shape)
        self.used += -(-nbytes // ALIGN) * ALIGN
        if keep:
            self.pending.append((name, piece))
        return piece

    def flush(self) -> None:
        """What the buffer holds to ``load_weights`` (its receives are complete)."""
        if self.pending:
            self.load(self.pending)
            self.num_loaded += len(self.pending)
            self.loaded_bytes += sum(t.numel() * t.element_size() for _, t in self.pending)
            self.pending = []


def for_load_weights(staged: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """Staged tensors as ``load_weights`` reads them (``checkpoint_names``)."""
    return [pair for name, tensor in staged for pair in checkpoint_names(name, tensor)]


def checkpoint_names(name: str, tensor: Any) -> list[tuple[str, Any]]:
    """A tensor sent in the engine's fused layout that did not fit the parameter (the CPU
    engine pads some sizes, e.g. a shared expert's), as the checkpoint tensors ``load_weights``
    reads, which pads and shards them itself: a routed expert's slice ``experts.w13_weight[e]``
    as expert e's gate and up projections, ``w2_weight[e]`` as its down projection, a
    ``gate_up_proj`` as gate and up. Any other name as it is."""
    stem, _, index = name.partition("[")
    if stem.endswith("experts.w13_weight") and index:
        prefix = f"{stem.removesuffix('w13_weight')}{index[:-1]}."
        gate, up = tensor.chunk(2)
        return [(prefix + "gate_proj.weight", gate), (prefix + "up_proj.weight", up)]
    if stem.endswith("experts.w2_weight") and index:
        return [(f"{stem.removesuffix('w2_weight')}{index[:-1]}.down_proj.weight", tensor)]
    if name.endswith("gate_up_proj.weight"):
        gate, up = tensor.chunk(2)
        stem = name.removesuffix("gate_up_proj.weight")
        return [(stem + "gate_proj.weight", gate), (stem + "up_proj.weight", up)]
    return [(name, tensor)]
