"""WeightSender: push HF-named tensors from a trainer source rank into SGLang engines.

One sender per pipeline stage. It rendezvouses a process group with every rollout engine worker
(SGLang's ``init_weights_update_group``; the sender is rank 0), then each sync opens an update
session on every engine, broadcasts fixed-size flattened buckets (one dtype per bucket, as
SGLang's ``flattened_bucket`` format requires aligned offsets), sets ``weight_version`` and closes
the session. SGLang applies a bucket as it arrives, so all-or-nothing is made here: the sender
keeps the packed buckets of the last committed sync and, if a sync fails midway, sends them
again. Bucket k+1 is packed on a thread while bucket k is broadcast.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from relax_launch.weights.engine_client import Background, EngineRequestError, post

DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


class WeightSyncError(RuntimeError):
    """A sync failed; the message says which engine and whether the rollback held."""


@dataclass(frozen=True)
class EngineTarget:
    """One rollout engine as the sender sees it."""

    url: str
    rank_offset: int
    label: str


@dataclass
class Bucket:
    names: list[str] = field(default_factory=list)
    tensors: list[torch.Tensor] = field(default_factory=list)
    nbytes: int = 0


@dataclass(frozen=True)
class SyncReport:
    weight_version: int
    num_tensors: int
    num_bytes: int
    seconds: float


def buckets(named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[Bucket]:
    """Group tensors, in order, into buckets of at most ``bucket_bytes`` and a single dtype."""
    current = Bucket()
    for name, tensor in named:
        size = tensor.numel() * tensor.element_size()
        if current.names and (
            current.nbytes + size > bucket_bytes or tensor.dtype != current.tensors[0].dtype
        ):
            yield current
            current = Bucket()
        current.names.append(name)
        current.tensors.append(tensor)
        current.nbytes += size
    if current.names:
        yield current


def flatten(bucket: Bucket, buffer: torch.Tensor) -> torch.Tensor:
    """The bucket's bytes back to back in ``buffer`` (grown if needed); returns the used slice."""
    if buffer.numel() < bucket.nbytes:
        buffer = torch.empty(bucket.nbytes, dtype=torch.uint8)
    offset = 0
    for tensor in bucket.tensors:
        size = tensor.numel() * tensor.element_size()
        buffer[offset : offset + size].view(tensor.dtype).view(tensor.shape).copy_(tensor)
        offset += size
    return buffer[: bucket.nbytes]


class WeightSender:
    """The source rank's side of weight sync for one pipeline stage."""

    def __init__(
        self,
        *,
        targets: list[EngineTarget],
        world_size: int,
        group_name: str,
        host: str,
        port: int,
        backend: str,
        bucket_bytes: int,
        timeout_s: float,
    ) -> None:
        self.targets, self.world_size, self.group_name = targets, world_size, group_name
        self.host, self.port, self.backend = host, port, backend
        self.bucket_bytes, self.timeout_s = bucket_bytes, timeout_s
        self.group: dist.ProcessGroup | None = None
        self.committed: list[tuple[dict, torch.Tensor]] = []  # (bucket metadata, flat bytes)
        self.committed_version = 0
        self.spare: list[torch.Tensor] = []

    def connect(self) -> None:
        """Form the broadcast group with every engine worker (the engines join over HTTP)."""
        body = {
            "master_address": self.host,
            "master_port": self.port,
            "world_size": self.world_size,
            "group_name": self.group_name,
            "backend": self.backend,
        }
        calls = [
            Background(
                t.url,
                "/init_weights_update_group",
                {**body, "rank_offset": t.rank_offset},
                self.timeout_s,
            )
            for t in self.targets
        ]
        self.group = custom_group(
            self.backend, self.host, self.port, self.world_size, 0, self.group_name, self.timeout_s
        )
        for target, call in zip(self.targets, calls, strict=True):
            _checked(
                target, "joining the weight-sync group", lambda c=call: c.result(self.timeout_s)
            )

    def sync(self, named: Iterable[tuple[str, torch.Tensor]], weight_version: int) -> SyncReport:
        """Send every tensor and commit ``weight_version``; on failure restore the last commit."""
        start = time.monotonic()
        tensors = iter(named)
        try:
            packed = self._send_all(self._pack_ahead(tensors), weight_version)
        except (EngineRequestError, RuntimeError) as exc:
            for _ in tensors:  # finish the export: the other TP ranks are still gathering
                pass
            self._rollback(exc, weight_version)
        # The packed buckets are the snapshot a later failed sync restores; the old snapshot's
        # buffers become the next sync's packing space (no copy beyond the packing itself).
        self.spare = [flat for _, flat in self.committed]
        self.committed, self.committed_version = packed, weight_version
        return SyncReport(
            weight_version,
            sum(len(m["names"]) for m, _ in packed),
            sum(flat.numel() for _, flat in packed),
            time.monotonic() - start,
        )

    def _pack_ahead(
        self, named: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[dict, torch.Tensor]]:
        """(metadata, flat bytes) per bucket; bucket k+1 is packed while bucket k is sent.

        Tensors are pulled from ``named`` on this thread (it may run TP collectives); only the
        byte copies run on the packer thread.
        """
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="weight-pack") as packer:
            pending = None
            for index, bucket in enumerate(buckets(named, self.bucket_bytes)):
                future = packer.submit(self._pack, bucket, index)
                if pending is not None:
                    yield pending.result()
                pending = future
            if pending is not None:
                yield pending.result()

    def _pack(self, bucket: Bucket, index: int) -> tuple[dict, torch.Tensor]:
        buffer = self.spare[index] if index < len(self.spare) else torch.empty(0, dtype=torch.uint8)
        meta = {
            "names": bucket.names,
            "dtypes": [DTYPE_NAMES[t.dtype] for t in bucket.tensors],
            "shapes": [list(t.shape) for t in bucket.tensors],
        }
        return meta, flatten(bucket, buffer)

    def _send_all(
        self, packed: Iterable[tuple[dict, torch.Tensor]], version: int
    ) -> list[tuple[dict, torch.Tensor]]:
        for target in self.targets:
            _checked(
                target,
                "opening an update session",
                lambda t=target: post(t.url, "/begin_weight_update", {}, self.timeout_s),
            )
        sent = []
        try:
            for meta, flat in packed:
                self._send_bucket(meta, flat)
                sent.append((meta, flat))
            body = {"new_version": str(version), "abort_all_requests": False}
            for target in self.targets:
                _checked(
                    target,
                    "setting weight_version",
                    lambda t=target: post(t.url, "/update_weight_version", body, self.timeout_s),
                )
        finally:
            for target in self.targets:
                post(target.url, "/end_weight_update", {}, self.timeout_s)
        return sent

    def _send_bucket(self, meta: dict, flat: torch.Tensor) -> None:
        body = {
            **meta,
            "group_name": self.group_name,
            "load_format": "flattened_bucket",
            "flush_cache": False,
        }
        calls = [
            Background(t.url, "/update_weights_from_distributed", body, self.timeout_s)
            for t in self.targets
        ]
        dist.broadcast(flat, group=self.group, group_src=0)
        for target, call in zip(self.targets, calls, strict=True):
            _checked(
                target,
                f"loading a bucket of {len(meta['names'])} tensors",
                lambda c=call: c.result(self.timeout_s),
            )

    def _rollback(self, cause: Exception, version: int) -> None:
        if not self.committed:
            raise WeightSyncError(f"weight sync to version {version} failed: {cause}") from cause
        try:
            self._send_all(self.committed, self.committed_version)
        except (EngineRequestError, RuntimeError) as again:
            raise WeightSyncError(
                f"weight sync to version {version} failed ({cause}) and restoring version "
                f"{self.committed_version} failed too ({again}): engines hold mixed weights"
            ) from cause
        raise WeightSyncError(
            f"weight sync to version {version} failed ({cause}); engines restored to version "
            f"{self.committed_version}"
        ) from cause

    def close(self) -> None:
        if self.group is None:
            return
        for target in self.targets:
            try:
                post(
                    target.url, "/destroy_weights_update_group", {"group_name": self.group_name}, 30
                )
            except EngineRequestError:
                pass  # the engine is gone or stopping: nothing left to tear down there
        dist.destroy_process_group(self.group)
        self.group = None


def _checked(target: EngineTarget, what: str, action) -> object:
    try:
        return action()
    except EngineRequestError as exc:
        raise EngineRequestError(f"{target.label} failed {what}: {exc}") from None


def custom_group(
    backend: str,
    host: str,
    port: int,
    world_size: int,
    rank: int,
    group_name: str,
    timeout_s: float,
) -> dist.ProcessGroup:
    """A process group outside the default world, built exactly as SGLang's
    ``init_custom_process_group`` builds its side (rank 0 hosts the store)."""
    from torch.distributed.distributed_c10d import (
        Backend,
        PrefixStore,
        _new_process_group_helper,
        _world,
        rendezvous,
    )

    timeout = timedelta(seconds=timeout_s)
    store, rank, world = next(rendezvous(f"tcp://{host}:{port}", rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    group, _ = _new_process_group_helper(
        world,
        rank,
        [],
        Backend(backend),
        PrefixStore(group_name, store),
        group_name=group_name,
        backend_options=None,
        timeout=timeout,
        device_id=None,
    )
    _world.pg_group_ranks[group] = {i: i for i in range(world)}
    return group
