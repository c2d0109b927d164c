"""WeightSender: stream a trainer stage's weights into SGLang engines, straight into their
parameters.

One sender per pipeline stage. It rendezvouses a process group with every rollout engine worker
(SGLang's ``init_weights_update_group``; the sender is rank 0). Within an update session the
controller has opened on every engine (``update_session.py``), ``send`` makes **one**
``update_weights_from_distributed`` request per engine, carrying the stage's manifest (names,
dtypes, shapes: fixed for a job, so built once), the ``weight_version`` and a cache flush, and
then broadcasts each tensor as the trainer's export yields it, a few broadcasts in flight, so the
export (TP gather, layout conversion) overlaps the transfer. The engine receives each tensor
into its parameter (``receiver.py``).

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
from datetime import timedelta

import torch
import torch.distributed as dist

from relax_launch.deadline import Deadline
from relax_launch.inference.engine import (
    EngineControl,
    EngineRequestError,
)
from relax_launch.inference.server import RECEIVER_PLUGIN
from relax_launch.weights.broadcast_group import custom_group, group_store
from relax_launch.weights.receiver import (
    ABORT_KEY,
    IN_PLACE,
    RECEIVER_PROBE,
    RECEIVER_REPORT,
    broadcast_plan,
    nbytes,
)
from relax_launch.weights.update_session import (
    EngineTarget,
    WeightSyncError,
    await_all,
    sync_deadline,
)

IN_FLIGHT = 4  # broadcasts queued ahead of the one being waited on
WATCH_S = 1.0  # while a broadcast waits, how often to check that no engine gave up


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


def update_request(manifest: list[TensorSpec], group_name: str, weight_version: int) -> dict:
    """The one update request per engine of a stage's send."""
    return {
        "names": [s.name for s in manifest],
        "dtypes": [s.dtype for s in manifest],
        "shapes": [list(s.shape) for s in manifest],
        "group_name": group_name,
        "load_format": IN_PLACE,
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
    ) -> None:
        self.targets, self.world_size, self.group_name = targets, world_size, group_name
        self.host, self.port, self.backend = host, port, backend
        self.group: dist.ProcessGroup | None = None
        self._calls: list[Future] = []  # the engines' update requests of the send in progress
        self.control = EngineControl()
        self.device = torch.device("cpu")  # where exported tensors live

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
        self.group = custom_group(
            self.backend, self.host, self.port, self.world_size, 0, self.group_name, timeout_s
        )
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
        except (EngineRequestError, RuntimeError) as exc:
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
        request = update_request(manifest, self.group_name, weight_version)
        calls = self._calls = [
            self.control.submit(
                t.url, "/update_weights_from_distributed", request, deadline.left("updating")
            )
            for t in self.targets
        ]
        export_s, transfer_s = self._stream(tensors, manifest, deadline, calls)
        return calls, export_s, transfer_s

    def _delivered(self) -> None:
        """Every engine took the update (a transport may release what it no longer needs)."""

    def _stream(
        self,
        tensors: Iterable[tuple[str, torch.Tensor]],
        manifest: list[TensorSpec],
        deadline: Deadline,
        calls: list[Future],
    ) -> tuple[float, float]:
        """Broadcast each exported tensor as it comes, ``IN_FLIGHT`` ahead of the one waited on;
        small ones at the end, packed (``broadcast_plan``). Only the tensors in flight and the
        small ones are held: a stage's export is never in memory whole.

        A tensor that does not match its manifest entry still completes the engines' sequence of
        broadcasts (with a placeholder), so the engines are not left waiting in the group.
        """
        mismatch, in_flight, small = None, deque(), {}
        export_s = transfer_s = 0.0
        tensors = iter(tensors)
        alone, packed = broadcast_plan([s.dtype for s in manifest], [s.shape for s in manifest])
        alone = set(alone)
        try:
            for index, spec in enumerate(manifest):
                began = time.monotonic()
                name, tensor = next(tensors, (None, None))
                export_s += time.monotonic() - began
                if tensor is None or TensorSpec.of(name, tensor) != spec:
                    got = None if tensor is None else TensorSpec.of(name, tensor)
                    mismatch = mismatch or f"expected {spec}, the trainer exported {got}"
                    tensor = torch.empty(
                        spec.shape, dtype=getattr(torch, spec.dtype), device=self.device
                    )
                tensor = tensor.contiguous()  # a broadcast needs dense memory
                self.device = tensor.device
                if index not in alone:  # sent packed, after the others
                    small[index] = tensor
                    continue
                broadcast = dist.broadcast(tensor, group=self.group, group_src=0, async_op=True)
                in_flight.append((broadcast, tensor))  # the tensor lives until it is sent
                if len(in_flight) > IN_FLIGHT:
                    transfer_s += self._wait(in_flight.popleft()[0], deadline, calls)
            for group in packed.values():
                pack = torch.cat([small[i].reshape(-1) for i in group])
                broadcast = dist.broadcast(pack, group=self.group, group_src=0, async_op=True)
                in_flight.append((broadcast, pack))
            while in_flight:
                transfer_s += self._wait(in_flight.popleft()[0], deadline, calls)
        except BaseException:
            in_flight.clear()  # a failed send's broadcasts must not outlive it (``_drop_group``)
            broadcast = None
            raise
        if mismatch is not None:
            raise WeightSyncError(f"the export does not match the manifest: {mismatch}")
        return export_s, transfer_s

    def _wait(self, work: dist.Work, deadline: Deadline, calls: list[Future]) -> float:
        """Wait for one broadcast; an engine that answered its request with an error instead
        of receiving fails the sync now, not at the deadline."""
        began = time.monotonic()
        while True:
            try:
                work.wait(timedelta(seconds=min(WATCH_S, deadline.left("a broadcast completed"))))
                return time.monotonic() - began
            except RuntimeError:  # not complete yet: is an engine still receiving?
                for target, call in zip(self.targets, calls, strict=True):
                    if call.done() and (error := call.exception()) is not None:
                        kind = type(error) if isinstance(error, EngineRequestError) else None
                        raise (kind or EngineRequestError)(
                            f"{target.label} refused the update: {error}"
                        ) from None

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
        if self.group is None:
            return
        with contextlib.suppress(Exception):  # the store's peers may be gone already
            group_store(self.group).set(ABORT_KEY, "1")
        dist.destroy_process_group(self.group)
        self.group = None
        gc.collect()  # the group closes its connections once nothing refers to it

    def close(self) -> None:
        """Leave the group and have every engine destroy its side; after a failed send the
        engines keep theirs: gloo cannot destroy a group with receives still posted (they would
        never finish), which would hold the engine's scheduler for good."""
        broken = self.group is None
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
