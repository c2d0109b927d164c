# long: one sender's whole protocol (probe, groups per engine TP index, stream, failure, close)
"""WeightSender: stream a trainer stage's weights into SGLang engines, straight into their
parameters.

One sender per pipeline stage. It rendezvouses a process group with every rollout engine worker
(SGLang's ``init_weights_update_group``; the sender is rank 0). Within an update session the
controller has opened on every engine (``update_session.py``), ``send`` makes **one**
``update_weights_from_distributed`` request per engine, carrying the stage's manifest (names,
dtypes, shapes: fixed for a job, so built once), the ``weight_version`` and a cache flush, and
then broadcasts each tensor as the trainer's export yields it (small ones in buckets), a few
broadcasts in flight, so the export (TP gather, layout conversion) overlaps the transfer. The
engine receives each tensor into its parameter (``receiver.py``).

Every engine's answer carries its receiver's report (``receiver.RECEIVER_REPORT``): how many
tensors landed in place, how many were staged, and that no parameter moved. An answer without it
comes from an engine that did not load the receiver (SGLang's own receive ran, allocating and
copying every tensor): the send fails naming that engine, so a job never runs on it unknowingly.

No copy of the weights is kept for a rollback. A send that fails leaves the engines' parameters
partly written; the controller keeps them out of routing and sends the same version again (the
trainer's parameters do not change until the sync is done), in a new group without the engines
that died (``runtime/session.py``).
"""

from __future__ import annotations

import contextlib
import gc
import json
import time
from collections import deque
from collections.abc import Iterable
from concurrent.futures import Future
from dataclasses import dataclass

import torch
import torch.distributed as dist

from relax_launch import platform
from relax_launch.deadline import Deadline
from relax_launch.inference.engine import (
    EngineControl,
    EngineRequestError,
)
from relax_launch.inference.server import RECEIVER_PLUGIN
from relax_launch.weights.broadcast_group import custom_group, group_store
from relax_launch.weights.collective_wait import wait_for
from relax_launch.weights.engine_shards import EngineShards
from relax_launch.weights.pipeline_stages import BY_TP_RANK, tp_groups
from relax_launch.weights.receiver import ABORT_KEY, RECEIVER_PROBE, RECEIVER_REPORT
from relax_launch.weights.update_plan import Broadcast, broadcast_plan, in_place_format, nbytes
from relax_launch.weights.update_session import (
    EngineTarget,
    WeightSyncError,
    await_all,
    sync_deadline,
)

IN_FLIGHT = 4  # broadcasts queued ahead of the one being waited on


def dtype_name(dtype: torch.dtype) -> str:
    """The name SGLang resolves with ``getattr(torch, name)``: torch.bfloat16 -> "bfloat16"."""
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of a stage's export, as the engine allocates and names it."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @classmethod
    def of(cls, name: str, tensor: torch.Tensor) -> TensorSpec:
        return cls(name, dtype_name(tensor.dtype), tuple(tensor.shape))

    @property
    def nbytes(self) -> int:
        return nbytes(self.dtype, list(self.shape))


def update_request(
    manifest: list[TensorSpec], group_name: str, weight_version: int, load_format: str
) -> dict:
    """The one update request per engine of a stage's send."""
    return {
        "names": [s.name for s in manifest],
        "dtypes": [s.dtype for s in manifest],
        "shapes": [list(s.shape) for s in manifest],
        "group_name": group_name,
        "load_format": load_format,
        "weight_version": str(weight_version),
        # Prefix-cache KV computed by the previous weights must not serve the new ones. SGLang
        # drains in-flight generations before it applies an update, so the flush cannot fail.
        "flush_cache": True,
    }


@dataclass(frozen=True)
class SyncReport:
    """One stage's send; ``*_s`` split ``seconds`` into where the sender waited."""

    weight_version: int
    transport: str  # "broadcast", or "bucket" for engines on the trainer's host and device
    num_tensors: int
    num_bytes: int
    seconds: float
    export_s: float  # in the trainer's export (TP gather, layout conversion)
    transfer_s: float  # waiting for broadcasts to complete
    engine_s: float  # after the last broadcast, until every engine answered (load, flush)
    receivers: tuple[dict, ...]  # each engine's receiver report (receiver.py), in target order


class ReceiverMissing(WeightSyncError):
    """relax-launch's receiver is not loaded in an engine (it did not answer the probe, or an
    update without its report)."""


def missing(target: EngineTarget, seen: str) -> ReceiverMissing:
    return ReceiverMissing(
        f"{target.label} runs without relax-launch's in-place receiver ({seen}): the SGLang "
        f"plugin '{RECEIVER_PLUGIN}' did not load there, and the engine would misread the "
        "weight sync (packed broadcasts, buckets) and crash. Reinstall relax-launch in the "
        "engines' environment (pip install -e .) and look for the plugin's error in the "
        "engine's log"
    )


def check_receivers(control: EngineControl, targets: list[EngineTarget], timeout_s: float) -> None:
    """Ask every engine whether the receiver plugin is loaded; ``ReceiverMissing`` names the
    first that is not."""
    for target in targets:
        body = {"name": RECEIVER_PROBE, "truncate_size": 1}
        try:
            answer = control.post(target.url, "/get_weights_by_name", body, timeout_s)
        except EngineRequestError as exc:
            raise missing(target, f"its answer to the probe: {exc}") from None
        if answer != [RECEIVER_REPORT.strip(), "ready"]:
            raise missing(target, f"its answer to the probe: {answer!r:.100}")


def receiver_reports(targets: list[EngineTarget], replies: list) -> tuple[dict, ...]:
    """Each engine's receiver report, read from its reply's message; ``ReceiverMissing``
    names the first engine whose reply has none."""
    reports = []
    for target, reply in zip(targets, replies, strict=True):
        message = str(reply.get("message", "")) if isinstance(reply, dict) else str(reply)
        _, mark, report = message.partition(RECEIVER_REPORT)
        if not mark:
            raise missing(target, f"it took an update without a report: {message[:200]!r}")
        reports.append(json.JSONDecoder().raw_decode(report)[0])
    return tuple(reports)


class WeightSender:
    """The source rank's side of weight sync for one pipeline stage."""

    TRANSPORT = "broadcast"

    def __init__(
        self,
        *,
        targets: list[EngineTarget],
        world_size: int,
        group_name: str,
        host: str,
        port: int,
        backend: str,
        shards: EngineShards | None = None,
    ) -> None:
        # ``shards``: how the engines' TP ranks hold each weight; past one rank, rank k takes
        # its slice in the group of TP index k (``pipeline_stages.BY_TP_RANK``), else all whole
        self.shards = shards or EngineShards(1, num_heads=1, num_kv_heads=1)
        if self.shards.tp_size > 1:
            group_name += BY_TP_RANK
        self.targets, self.world_size, self.group_name = targets, world_size, group_name
        self.host, self.port, self.backend = host, port, backend
        self.groups: list[dist.ProcessGroup] = []  # one per engine TP index
        self._calls: list[Future] = []  # the engines' update requests of the send in progress
        self._planned: tuple = (None, None)  # _plan's last manifest and answer
        self.control = EngineControl()
        self.device = torch.device("cpu")  # where exported tensors live
        # tensors under the first size travel in buckets of about the second (``broadcast_plan``);
        # the trainer's worker sets its own device's
        self.bucketing = platform.sync_bucketing("cpu")

    def connect(self, timeout_s: float) -> None:
        """Form the broadcast group with every engine worker (the engines join over HTTP), once
        each engine has said its receiver is loaded."""
        deadline = sync_deadline(timeout_s)
        check_receivers(self.control, self.targets, deadline.left("asking for the receivers"))
        body = {
            "master_address": self.host,
            "master_port": self.port,
            "world_size": self.world_size,
            "group_name": self.group_name,
            "backend": self.backend,
        }
        calls = [
            self.control.submit(
                t.url,
                "/init_weights_update_group",
                {**body, "rank_offset": t.rank_offset},
                timeout_s,
            )
            for t in self.targets
        ]
        self.groups = [  # they share one store, hosted at ``port`` by the first
            custom_group(self.backend, self.host, self.port, self.world_size, 0, name, timeout_s)
            for name in tp_groups(self.group_name, self.shards.tp_size)
        ]
        await_all(self.targets, calls, "joining the weight-sync group", deadline)

    def send(
        self,
        named: Iterable[tuple[str, torch.Tensor]],
        manifest: list[TensorSpec],
        weight_version: int,
        timeout_s: float,
    ) -> SyncReport:
        """Stream every tensor of this stage into the open update session as
        ``weight_version``; ``named`` must yield exactly ``manifest``."""
        start, deadline = time.monotonic(), sync_deadline(timeout_s)
        tensors = iter(named)
        try:
            calls, export_s, transfer_s = self._deliver(tensors, manifest, weight_version, deadline)
            waited = time.monotonic()
            replies = await_all(self.targets, calls, "receiving the weights", deadline)
        except BaseException as exc:  # whatever failed, no engine is left waiting in the group
            if not isinstance(exc, EngineRequestError | RuntimeError):
                self._drop_group()
                raise  # not a failed send but a defect (or an interrupt): as it is
            for _ in tensors:  # finish the export: the other TP ranks are still gathering
                pass
            error = WeightSyncError(
                f"sending version {weight_version} failed: {exc}; its broadcast group was dropped"
            )
            _forget_frames(exc)  # their broadcasts would keep the group's connections open
            self._unblock_refusers()
            self._drop_group()  # the engines still receiving give up (receiver.ABORT_KEY)
            raise error from None
        self._delivered()
        return SyncReport(
            weight_version=weight_version,
            transport=self.TRANSPORT,
            num_tensors=len(manifest),
            num_bytes=sum(s.nbytes for s in manifest),
            seconds=time.monotonic() - start,
            export_s=export_s,
            transfer_s=transfer_s,
            engine_s=time.monotonic() - waited,
            receivers=receiver_reports(self.targets, replies),
        )

    def _deliver(
        self,
        tensors: Iterable[tuple[str, torch.Tensor]],
        manifest: list[TensorSpec],
        weight_version: int,
        deadline: Deadline,
    ) -> tuple[list[Future], float, float]:
        """Ask every engine to receive, then broadcast; returns the engines' requests, and the
        seconds spent exporting and transferring."""
        request = update_request(
            self._engine_manifest(manifest),
            self.group_name,
            weight_version,
            in_place_format(*self.bucketing),
        )
        calls = self._calls = [
            self.control.submit(
                t.url, "/update_weights_from_distributed", request, deadline.left("updating")
            )
            for t in self.targets
        ]
        export_s, transfer_s = self._stream(tensors, manifest, deadline, calls)
        return calls, export_s, transfer_s

    def _engine_manifest(self, manifest: list[TensorSpec]) -> list[TensorSpec]:
        """``manifest`` as each engine TP rank receives it (its slice of every tensor)."""
        return self._plan(manifest)[2]

    def _plan(
        self, manifest: list[TensorSpec]
    ) -> tuple[list[list[int]], list[Broadcast], list[TensorSpec]]:
        """Each engine TP rank's shapes, the broadcasts (``broadcast_plan``) and the per-rank
        manifest of a stage's manifest: the same list every sync, so worked out once."""
        key = (manifest, self.bucketing)
        if self._planned[0] != key:  # identity first: no element compared for the same list
            per_rank = [
                TensorSpec(s.name, s.dtype, self.shards.shape(s.name, s.shape)) for s in manifest
            ]
            shapes = [list(s.shape) for s in per_rank]
            names, dtypes = [s.name for s in manifest], [s.dtype for s in manifest]
            plan = broadcast_plan(names, dtypes, shapes, *self.bucketing)
            self._planned = (key, (shapes, plan, per_rank))
        return self._planned[1]

    def _delivered(self) -> None:
        """Every engine took the update (a transport may release what it no longer needs)."""

    def _stream(
        self,
        tensors: Iterable[tuple[str, torch.Tensor]],
        manifest: list[TensorSpec],
        deadline: Deadline,
        calls: list[Future],
    ) -> tuple[float, float]:
        """Broadcast the export in the order of ``broadcast_plan``, ``IN_FLIGHT`` broadcasts
        ahead of the one waited on: a large tensor as it comes, small ones in a bucket once it
        is full. Only the tensors in flight and the buckets filling are held: a stage's export
        is never in memory whole.

        A tensor that does not match its manifest entry still completes the engines' sequence of
        broadcasts (with a placeholder), so the engines are not left waiting in the group.
        """
        mismatch, in_flight, held = None, deque(), {}
        export_s = transfer_s = 0.0
        tensors, exported = iter(tensors), 0
        shapes, plan, _ = self._plan(manifest)
        buckets = _BucketPool(sum(self.bucketing), self.device)
        try:
            for item in plan:
                while exported <= max(item.indices):  # export up to this broadcast's last tensor
                    spec = manifest[exported]
                    began = time.monotonic()
                    name, tensor = next(tensors, (None, None))
                    export_s += time.monotonic() - began
                    if tensor is None or TensorSpec.of(name, tensor) != spec:
                        got = None if tensor is None else TensorSpec.of(name, tensor)
                        mismatch = mismatch or f"expected {spec}, the trainer exported {got}"
                        tensor = torch.empty(
                            spec.shape, dtype=getattr(torch, spec.dtype), device=self.device
                        )
                    # each engine TP rank's slice, dense as a broadcast needs
                    held[exported] = self.shards.slices(spec.name, tensor)
                    self.device = buckets.device = tensor.device
                    exported += 1
                payloads = _payloads(item, held, shapes, buckets, len(self.groups))
                broadcasts = [
                    dist.broadcast(payload, group=group, group_src=0, async_op=True)
                    for payload, group in zip(payloads, self.groups, strict=True)
                ]
                in_flight.append((broadcasts, payloads))  # the payloads live until sent
                if len(in_flight) > IN_FLIGHT:
                    works, sent = in_flight.popleft()
                    transfer_s += self._wait_all(works, deadline, calls)
                    buckets.sent(sent)
            while in_flight:
                transfer_s += self._wait_all(in_flight.popleft()[0], deadline, calls)
        except BaseException:
            in_flight.clear()  # a failed send's broadcasts must not outlive it (``_drop_group``)
            broadcasts = None
            raise
        if mismatch is not None:
            raise WeightSyncError(f"the export does not match the manifest: {mismatch}")
        return export_s, transfer_s

    def _wait_all(self, works: list[dist.Work], deadline: Deadline, calls: list[Future]) -> float:
        return sum(self._wait(work, deadline, calls) for work in works)

    def _wait(self, work: dist.Work, deadline: Deadline, calls: list[Future]) -> float:
        """Wait for one broadcast (``collective_wait``: polled, never ``wait(timeout)``, which
        aborts an NCCL group); an engine that answered its request with an error instead of
        receiving fails the sync now, not at the deadline."""

        def no_refusal() -> None:
            for target, call in zip(self.targets, calls, strict=True):
                if call.done() and (error := call.exception()) is not None:
                    kind = type(error) if isinstance(error, EngineRequestError) else None
                    raise (kind or EngineRequestError)(
                        f"{target.label} refused the update: {error}"
                    )

        return wait_for(work, deadline, "a broadcast completed", no_refusal)

    def _unblock_refusers(self) -> None:
        """After a failed send, the engines that refused the update (idle: no receive posted)
        destroy their side of the group, which ends the broadcasts sent to them; this side's
        group, once dropped, would otherwise wait for those until its timeout (the sync's)."""
        for target, call in zip(self.targets, self._calls, strict=False):
            if call.done() and call.exception() is not None:
                self._destroy_engine_side(target)

    def _drop_group(self) -> None:
        """Leave the broadcast group after a failed send: the engines still receiving would wait
        for tensors that will never come, so they are told to give up first (through the group's
        own store, which the receiver polls while it waits); then this side's connections close,
        so the engines' pending receives fail and the engines can destroy their side."""
        for group in self.groups:
            with contextlib.suppress(Exception):  # the store's peers may be gone already
                group_store(group).set(ABORT_KEY, "1")
            dist.destroy_process_group(group)
        self.groups = []
        gc.collect()  # the group closes its connections once nothing refers to it

    def close(self) -> None:
        """Leave the group and have every engine destroy its side; after a failed send the
        engines keep theirs: gloo cannot destroy a group with receives still posted (they would
        never finish), which would hold the engine's scheduler for good."""
        broken = not self.groups
        self._drop_group()
        for target in [] if broken else self.targets:
            self._destroy_engine_side(target)
        self.control.close()

    def _destroy_engine_side(self, target: EngineTarget) -> None:
        # an engine gone or stopping, or that never joined, has nothing to tear down
        with contextlib.suppress(EngineRequestError):
            body = {"group_name": self.group_name}
            self.control.post(target.url, "/destroy_weights_update_group", body, 30)


def _forget_frames(error: BaseException | None) -> None:
    """Drop the frames an exception chain holds: their locals include the failed send's
    broadcasts, which hold the group (and its connections) alive."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        error.__traceback__ = None
        error = error.__cause__ or error.__context__


def _payloads(
    item: Broadcast,
    held: dict[int, list[torch.Tensor]],
    shapes: list[list[int]],
    buckets: _BucketPool,
    tp_size: int,
) -> list[torch.Tensor]:
    """Broadcast ``item``'s payload for each engine TP index (from ``held``: each exported
    tensor's slices, given up with its last broadcast): a tensor, rows of one, or a bucket."""
    if item.bucket:
        parts = [held.pop(i) for i in item.indices]
        return [buckets.fill([p[k] for p in parts]) for k in range(tp_size)]
    (i,) = item.indices
    if item.rows is None:
        return held.pop(i)
    begin, end = item.rows
    slices = held.pop(i) if end == shapes[i][0] else held[i]
    return [piece[begin:end] for piece in slices]  # whole rows of a dense tensor: dense


class _BucketPool:
    """The sender's bucket buffers within one send: a bucket is filled into a buffer whose
    broadcast completed, rather than a new allocation (whose pages the host would first have
    to fault in and zero: as long as the copy itself, for every byte of a MoE's small
    tensors). At most ``IN_FLIGHT`` + 1 buffers a TP index; gone with the send."""

    def __init__(self, nbytes: int, device: torch.device) -> None:
        self.nbytes, self.device = nbytes, device
        self.free: list[torch.Tensor] = []
        self.of: dict[int, torch.Tensor] = {}  # a filled bucket's data_ptr -> its buffer

    def fill(self, parts: list[torch.Tensor]) -> torch.Tensor:
        """``parts`` end to end in a buffer, as one flat tensor of their dtype."""
        buffer = self.free.pop() if self.free else None
        if buffer is None or buffer.device != self.device:
            buffer = torch.empty(self.nbytes, dtype=torch.uint8, device=self.device)
        dtype, numel = parts[0].dtype, sum(p.numel() for p in parts)
        bucket = buffer[: numel * dtype.itemsize].view(dtype)
        torch.cat([p.reshape(-1) for p in parts], out=bucket)
        self.of[bucket.data_ptr()] = buffer
        return bucket

    def sent(self, payloads: list[torch.Tensor]) -> None:
        """These payloads' broadcasts completed: their buffers may be filled again."""
        for payload in payloads:
            if (buffer := self.of.pop(payload.data_ptr(), None)) is not None:
                self.free.append(buffer)
