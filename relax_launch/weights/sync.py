"""WeightSender: push HF-named tensors from a trainer source rank into SGLang engines.

One sender per pipeline stage. It rendezvouses a process group with every rollout engine worker
(SGLang's ``init_weights_update_group``; the sender is rank 0). Within an update session the
controller has opened on every engine (``update_session.py``), ``send`` ships the stage's
tensors in fixed-size buckets: one ``update_weights_from_distributed`` request per bucket, one
broadcast per tensor, straight from the exported tensor.

Per-tensor broadcasts rather than SGLang's ``flattened_bucket`` format: the engine allocates its
receive buffers anew for every request, and a flat buffer over 32 MiB is a fresh mapping whose
every page faults (on a new CPU engine, every page of every sync), while tensor-sized buffers
come back warm from the allocator's heap; the broadcast needs no packing copy first, and a
bucket may mix dtypes. Fewer, larger buckets save the engine's fixed cost per request.

SGLang applies a bucket as it arrives, so all-or-nothing is made here: the sender keeps a host
copy of what it last sent; the controller ``commit``s it once every stage has sent, or asks every
stage to ``restore`` (send the last committed copy again) when any stage failed. Bucket k is
copied while the engines load it, when the sender would otherwise wait, into the buffers of the
copy before the last (so after two syncs a copy allocates nothing).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from relax_launch.weights.engine_client import Background, EngineRequestError, post
from relax_launch.weights.update_session import EngineTarget, WeightSyncError, await_all


def dtype_name(dtype: torch.dtype) -> str:
    """The name SGLang resolves with ``getattr(torch, name)``: torch.bfloat16 -> "bfloat16"."""
    return str(dtype).removeprefix("torch.")


@dataclass
class Bucket:
    """Tensors sent by one engine request, in order."""

    names: list[str] = field(default_factory=list)
    tensors: list[torch.Tensor] = field(default_factory=list)
    nbytes: int = 0

    def metadata(self) -> dict:
        """The request fields that let an engine allocate and name the bucket's tensors."""
        return {
            "names": self.names,
            "dtypes": [dtype_name(t.dtype) for t in self.tensors],
            "shapes": [list(t.shape) for t in self.tensors],
        }


@dataclass(frozen=True)
class SyncReport:
    weight_version: int
    num_tensors: int
    num_bytes: int
    seconds: float


def buckets(named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[Bucket]:
    """Group tensors, in order, into buckets of at most ``bucket_bytes`` (a larger tensor travels
    alone); dtypes may mix, as each tensor is its own broadcast."""
    current = Bucket()
    for name, tensor in named:
        size = tensor.numel() * tensor.element_size()
        if current.names and current.nbytes + size > bucket_bytes:
            yield current
            current = Bucket()
        current.names.append(name)
        current.tensors.append(tensor.contiguous())  # a broadcast needs dense memory
        current.nbytes += size
    if current.names:
        yield current


def copy_bucket(bucket: Bucket, spare: Iterator[torch.Tensor]) -> Bucket:
    """A host copy of ``bucket`` that outlives the trainer's next step.

    Each tensor lands in the next ``spare`` tensor when shape and dtype match (the export order
    is the same every sync), else in a new one.
    """
    copies = []
    for tensor in bucket.tensors:
        target = next(spare, None)
        if target is None or target.shape != tensor.shape or target.dtype != tensor.dtype:
            target = torch.empty(tensor.shape, dtype=tensor.dtype)
        copies.append(target.copy_(tensor))
    return Bucket(bucket.names, copies, bucket.nbytes)


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
        self.committed: list[Bucket] = []  # host copy of the last committed sync
        self.pending: list[Bucket] | None = None  # host copy of the last send, until committed
        self.spare: list[torch.Tensor] = []  # the copy before it: the next copy's buffers
        self.device = torch.device("cpu")  # where exported tensors live: a rollback sends there

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
        await_all(self.targets, calls, "joining the weight-sync group", self.timeout_s)

    def send(self, named: Iterable[tuple[str, torch.Tensor]], weight_version: int) -> SyncReport:
        """Send every tensor of this stage into the open update session; keep a host copy."""
        start = time.monotonic()
        tensors = iter(named)
        try:
            copy = self._send_all(buckets(tensors, self.bucket_bytes), iter(self.spare))
        except (EngineRequestError, RuntimeError) as exc:
            for _ in tensors:  # finish the export: the other TP ranks are still gathering
                pass
            raise WeightSyncError(f"sending version {weight_version} failed: {exc}") from exc
        self.pending = copy
        return SyncReport(
            weight_version,
            sum(len(b.names) for b in copy),
            sum(b.nbytes for b in copy),
            time.monotonic() - start,
        )

    def commit(self) -> None:
        """Every stage sent and the engines took the version: the last send is now the copy a
        later failure restores; the copy before it lends its buffers to the next one."""
        if self.pending is None:
            raise RuntimeError("commit without a successful send")
        self.spare = [t for bucket in self.committed for t in bucket.tensors]
        self.committed, self.pending = self.pending, None

    def restore(self) -> bool:
        """Send the last committed copy again (the session is still open); False if there is
        none yet (the first sync failed: the engines still hold their checkpoint)."""
        if self.pending is not None:
            self.spare, self.pending = [t for b in self.pending for t in b.tensors], None
        if not self.committed:
            return False
        self._send_all(self._restoring(), None)
        return True

    def _send_all(
        self, outgoing: Iterable[Bucket], spare: Iterator[torch.Tensor] | None
    ) -> list[Bucket]:
        """Send ``outgoing`` bucket by bucket; with ``spare`` (a new sync, not a restore),
        return a host copy of what was sent."""
        copy = []
        for bucket in outgoing:
            calls = self._send_bucket(bucket)
            if spare is not None:  # copied while the engines load it
                self.device = bucket.tensors[0].device
                copy.append(copy_bucket(bucket, spare))
            await_all(
                self.targets,
                calls,
                f"loading a bucket of {len(bucket.names)} tensors",
                self.timeout_s,
            )
        return copy

    def _send_bucket(self, bucket: Bucket) -> list[Background]:
        """Ask every engine to load ``bucket`` and broadcast its tensors; returns the requests."""
        body = {**bucket.metadata(), "group_name": self.group_name, "flush_cache": False}
        calls = [
            Background(t.url, "/update_weights_from_distributed", body, self.timeout_s)
            for t in self.targets
        ]
        for tensor in bucket.tensors:
            dist.broadcast(tensor, group=self.group, group_src=0)
        return calls

    def _restoring(self) -> Iterator[Bucket]:
        """The committed copy, bucket by bucket, back on the device the trainer exports from."""
        for bucket in self.committed:
            yield Bucket(bucket.names, [t.to(self.device) for t in bucket.tensors], bucket.nbytes)

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
