"""Colocated weight transport: trainer and engines on one host and device (``split``, ``defer``)
hand the weights over in memory, with no broadcast (on one GPU NCCL cannot even join two
processes).

The stage's export is packed, tensor after tensor, into buckets: flat byte tensors allocated
once on the trainer's device and reused every sync. Each bucket travels as SGLang's
``update_weights_from_tensor`` payload, which names the bucket without a byte of it:

- on a GPU the bucket itself, pickled by ``torch.multiprocessing``'s reductions: a CUDA IPC
  handle to the trainer's own device memory;
- on the CPU a file in ``/dev/shm`` that the trainer maps and fills, and that the engine maps by
  its name once. (``torch.multiprocessing``'s reductions need, on the CPU, either a common
  parent process, which a trainer and an SGLang server do not have, or the ``torch_shm_manager``
  daemon, a process the job would leave running after the trainer: a named file does the same
  without either.) Once every engine has mapped it, the name is removed: the memory lives while
  the mappings do, and a crash leaves nothing behind.

One request per bucket and engine carries the bucket's handle and layout (name, dtype, shape,
offset); the engine copies each tensor out into its parameter (``receiver.load_bucket``). Two
buckets alternate, so the next one fills while the engines copy from the last, and memory stays
at two buckets whatever the model's size. The last bucket's request sets the version and
flushes the prefix cache.
"""

from __future__ import annotations

import base64
import io
import json
import os
import pickle
import time
from collections.abc import Iterable
from concurrent.futures import Future
from multiprocessing.reduction import ForkingPickler

import torch

from relax_launch import platform
from relax_launch.deadline import Deadline
from relax_launch.weights.receiver import RECEIVER_REPORT
from relax_launch.weights.sync import TensorSpec, WeightSender, check_receivers
from relax_launch.weights.update_plan import IN_PLACE
from relax_launch.weights.update_session import (
    EngineTarget,
    WeightSyncError,
    await_all,
)

BUCKET_BYTES = 256 << 20  # or the largest tensor, if larger
SHM_DIR = "/dev/shm"
ALIGN = 64  # every tensor starts on a 64-byte boundary of its bucket


def pack(manifest: list[TensorSpec], bucket_bytes: int) -> list[list[tuple[int, int]]]:
    """The manifest cut into buckets: per bucket, (manifest index, byte offset) of each tensor,
    in order; a bucket holds ``bucket_bytes`` at most, or one tensor larger than that."""
    buckets: list[list[tuple[int, int]]] = [[]]
    offset = 0
    for index, spec in enumerate(manifest):
        size = -(-spec.nbytes // ALIGN) * ALIGN
        if buckets[-1] and offset + size > bucket_bytes:
            buckets.append([])
            offset = 0
        buckets[-1].append((index, offset))
        offset += size
    return buckets


def handover(bucket: torch.Tensor | tuple[str, int], layout: list) -> str:
    """A bucket and its layout as SGLang's ``update_weights_from_tensor`` takes them (base64 of
    a pickle, no byte of the bucket in it): a CUDA bucket by ``torch.multiprocessing``'s
    reduction (an IPC handle), a CPU bucket as its shared file's ``(path, size)``. Every engine
    process sees the devices this one sees (torchrun ranks and their servers), so device indices
    match."""
    buffer = io.BytesIO()
    ForkingPickler(buffer).dump((bucket, layout))
    return base64.b64encode(buffer.getvalue()).decode()


def taken_over(payload: str) -> tuple[torch.Tensor | tuple[str, int], list]:
    """The receiving side of ``handover`` (SGLang does the same, with its restricted
    unpickler)."""
    return pickle.loads(base64.b64decode(payload))  # noqa: S301 - our own handover, one host


def shared_file(path: str, size: int) -> torch.Tensor:
    """The bytes of a shared file, mapped (the engine's receiver maps it the same way)."""
    return torch.from_file(path, shared=True, size=size, dtype=torch.uint8)


def merged(replies: tuple) -> dict:
    """One engine's replies to every bucket of a send, as one: the last bucket's message (the
    version it set) with the receiver's reports added up."""
    total: dict[str, int] = {}
    for reply in replies:
        report = reply.get("message", "").partition(RECEIVER_REPORT)[2]
        if report:
            for key, value in json.JSONDecoder().raw_decode(report)[0].items():
                total[key] = (
                    max(total.get(key, 0), value) if key == "moved" else total.get(key, 0) + value
                )
    message = replies[-1].get("message", "").partition(RECEIVER_REPORT)[0]
    if total:
        message += RECEIVER_REPORT + json.dumps(total)
    return {**replies[-1], "message": message}


def _done(value: object) -> Future:
    future: Future = Future()
    future.set_result(value)
    return future


class BucketSender(WeightSender):
    """A stage's sender for engines on its own host (see the module docstring)."""

    TRANSPORT = "bucket"

    def connect(self, timeout_s: float) -> None:
        """Nothing to join (the buckets are made on the first send, on this rank's device), once
        each engine has said its receiver is loaded."""
        self.buckets: list[torch.Tensor] = []
        self.files: list[tuple[str, int] | None] = []  # CPU: each bucket's (path, size)
        self.named: set[str] = set()  # files whose names are still in /dev/shm
        self.device = platform.current_device()
        check_receivers(self.control, self.targets, timeout_s)

    def _deliver(
        self,
        tensors: Iterable[tuple[str, torch.Tensor]],
        manifest: list[TensorSpec],
        weight_version: int,
        deadline: Deadline,
    ) -> tuple[list[Future], float, float]:
        """Fill each bucket from the export and ask every engine to load it; a bucket is
        refilled only once every engine has loaded what it held."""
        plan = pack(manifest, max(BUCKET_BYTES, *(s.nbytes for s in manifest)))
        tensors = iter(tensors)
        export_s = copy_s = 0.0
        loading: list[list[Future]] = [[], []]  # each bucket's requests still running
        replies: list[list] = []  # per bucket, each engine's reply
        for number, entries in enumerate(plan):
            slot = number % 2
            if loading[slot]:  # the engines still copy out of this bucket
                replies.append(await_all(self.targets, loading[slot], "loading a bucket", deadline))
            layout, size = [], entries[-1][1] + manifest[entries[-1][0]].nbytes
            bucket = self._bucket(slot, size)
            for index, offset in entries:
                spec = manifest[index]
                began = time.monotonic()
                name, tensor = next(tensors, (None, None))
                export_s += time.monotonic() - began
                if tensor is None or TensorSpec.of(name, tensor) != spec:
                    got = None if tensor is None else TensorSpec.of(name, tensor)
                    raise WeightSyncError(
                        f"the export does not match the manifest: expected {spec}, "
                        f"the trainer exported {got}"
                    )
                began = time.monotonic()
                bucket[offset : offset + spec.nbytes].view(tensor.dtype).view(tensor.shape).copy_(
                    tensor
                )
                copy_s += time.monotonic() - began
                layout.append((spec.name, spec.dtype, list(spec.shape), offset))
            platform.synchronize(bucket.device)  # filled before the engines read it
            last = number == len(plan) - 1
            loading[slot] = self._load(slot, layout, weight_version if last else None, deadline)
        for slot in (len(plan) % 2, (len(plan) - 1) % 2):  # the last bucket last
            if loading[slot]:
                replies.append(await_all(self.targets, loading[slot], "loading a bucket", deadline))
        return (
            [_done(merged(per_bucket)) for per_bucket in zip(*replies, strict=True)],
            export_s,
            copy_s,
        )

    def _bucket(self, slot: int, size: int) -> torch.Tensor:
        """Bucket ``slot`` with room for ``size`` bytes, allocated once (or grown)."""
        while len(self.buckets) <= slot:
            self.buckets.append(torch.empty(0, dtype=torch.uint8))
            self.files.append(None)
        if self.buckets[slot].numel() < size:
            if self.device.type == "cuda":
                self.buckets[slot] = torch.empty(size, dtype=torch.uint8, device=self.device)
            else:
                path = os.path.join(
                    SHM_DIR, f"relax-launch-bucket-{self.group_name}-{os.getpid()}-{slot}"
                )
                self._unlink(path)  # a smaller one before it, under the same name
                with open(path, "wb") as file:
                    file.truncate(size)
                self.named.add(path)
                self.buckets[slot], self.files[slot] = shared_file(path, size), (path, size)
        return self.buckets[slot]

    def _delivered(self) -> None:
        """Every engine loaded every bucket, so each has mapped the files: their names go."""
        for path in list(self.named):
            self._unlink(path)

    def _unlink(self, path: str) -> None:
        if path in self.named or os.path.exists(path):
            os.unlink(path)
            self.named.discard(path)

    def _load(
        self,
        slot: int,
        layout: list[tuple[str, str, list[int], int]],
        weight_version: int | None,
        deadline: Deadline,
    ) -> list[Future]:
        """One update request per engine for bucket ``slot`` (with the version and a cache flush
        on the last one)."""
        bucket = self.buckets[slot]
        payload = handover(bucket if bucket.is_cuda else self.files[slot], layout)
        calls = []
        for target in self.targets:
            body = self._request(target, payload, weight_version)
            calls.append(
                self.control.submit(
                    target.url, "/update_weights_from_tensor", body, deadline.left("updating")
                )
            )
        return calls

    @staticmethod
    def _request(target: EngineTarget, payload: str, weight_version: int | None) -> dict:
        body = {
            "serialized_named_tensors": [payload] * target.tp_size,  # one per engine rank
            "load_format": IN_PLACE,
            "flush_cache": weight_version is not None,
        }
        if weight_version is not None:
            body["weight_version"] = str(weight_version)
        return body

    def close(self) -> None:
        self._delivered()  # no name left behind, whatever the engines mapped
        self.buckets, self.files = [], []
        self.control.close()
