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

All-or-nothing is made here: once every stage has sent and the controller ``commit``s, the
sender copies what it sent to host buffers (reused from sync to sync) in the background, while
rollout runs and the trainer is idle, so the copy is off the sync's critical path; the trainer
waits for it (``wait_for_rollback_copy``) before it changes its parameters again. If any stage
fails, every stage ``restore``s: it sends that copy again, with its version.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Iterable
from concurrent.futures import Future
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from relax_launch import platform
from relax_launch.weights.engine_client import (
    EngineControl,
    EngineRequestError,
    EngineUnreachable,
)
from relax_launch.weights.receiver import IN_PLACE, broadcast_plan, nbytes
from relax_launch.weights.update_session import (
    Deadline,
    EngineTarget,
    WeightSyncError,
    await_all,
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
    transport: str  # "broadcast", or "shared_memory" for engines on the trainer's host
    num_tensors: int
    num_bytes: int
    seconds: float
    export_s: float  # in the trainer's export (TP gather, layout conversion)
    transfer_s: float  # waiting for broadcasts to complete
    engine_s: float  # after the last broadcast, until every engine answered (load, flush)
    rollback_copy_s: float  # the previous sync's host copy, made off the critical path


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
        self.control = EngineControl()
        self.device = torch.device("cpu")  # where exported tensors live: a restore sends there
        self.sent: list[tuple[str, torch.Tensor]] = []  # the last send, until committed
        self.committed: list[tuple[str, torch.Tensor]] = []  # host copy of the committed sync
        self._copier: threading.Thread | None = None
        self._copy_s = 0.0

    def connect(self, timeout_s: float) -> None:
        """Form the broadcast group with every engine worker (the engines join over HTTP)."""
        deadline = Deadline(timeout_s)
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
        self.wait_for_rollback_copy()
        start, deadline = time.monotonic(), Deadline(timeout_s)
        tensors = iter(named)
        try:
            sent, calls, export_s, transfer_s = self._deliver(
                tensors, manifest, weight_version, deadline
            )
            waited = time.monotonic()
            await_all(self.targets, calls, "receiving the weights", deadline)
        except (EngineRequestError, RuntimeError) as exc:
            for _ in tensors:  # finish the export: the other TP ranks are still gathering
                pass
            failed = f"sending version {weight_version} failed: {exc}"
            if isinstance(exc, EngineUnreachable):
                self._drop_group()
                failed += "; an engine is gone, so this broadcast group was dropped"
            raise WeightSyncError(failed) from exc
        self._delivered()
        self.sent = sent
        return SyncReport(
            weight_version=weight_version,
            transport=self.TRANSPORT,
            num_tensors=len(manifest),
            num_bytes=sum(s.nbytes for s in manifest),
            seconds=time.monotonic() - start,
            export_s=export_s,
            transfer_s=transfer_s,
            engine_s=time.monotonic() - waited,
            rollback_copy_s=self._copy_s,
        )

    def _deliver(
        self,
        tensors: Iterable[tuple[str, torch.Tensor]],
        manifest: list[TensorSpec],
        weight_version: int,
        deadline: Deadline,
    ) -> tuple[list[tuple[str, torch.Tensor]], list[Future], float, float]:
        """Ask every engine to receive, then broadcast; returns what was sent, the engines'
        requests, and the seconds spent exporting and transferring."""
        request = update_request(manifest, self.group_name, weight_version)
        calls = [
            self.control.submit(
                t.url, "/update_weights_from_distributed", request, deadline.left("updating")
            )
            for t in self.targets
        ]
        sent, export_s, transfer_s = self._stream(tensors, manifest, deadline, calls)
        return sent, calls, export_s, transfer_s

    def _delivered(self) -> None:
        """Every engine took the update (a transport may release what it no longer needs)."""

    def _stream(
        self,
        tensors: Iterable[tuple[str, torch.Tensor]],
        manifest: list[TensorSpec],
        deadline: Deadline,
        calls: list[Future],
    ) -> tuple[list[tuple[str, torch.Tensor]], float, float]:
        """Broadcast each exported tensor as it comes, ``IN_FLIGHT`` ahead of the one waited on;
        small ones at the end, packed (``broadcast_plan``).

        A tensor that does not match its manifest entry still completes the engines' sequence of
        broadcasts (with a placeholder), so the group stays usable for the restore that follows.
        """
        sent, mismatch, in_flight = [], None, deque()
        export_s = transfer_s = 0.0
        tensors = iter(tensors)
        alone, packed = broadcast_plan([s.dtype for s in manifest], [s.shape for s in manifest])
        alone = set(alone)
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
            sent.append((spec.name, tensor))
            if index not in alone:  # sent packed, after the others
                continue
            in_flight.append(dist.broadcast(tensor, group=self.group, group_src=0, async_op=True))
            if len(in_flight) > IN_FLIGHT:
                transfer_s += self._wait(in_flight.popleft(), deadline, calls)
        packs = [torch.cat([sent[i][1].reshape(-1) for i in group]) for group in packed.values()]
        for pack in packs:  # alive in ``packs`` until every broadcast completed
            in_flight.append(dist.broadcast(pack, group=self.group, group_src=0, async_op=True))
        while in_flight:
            transfer_s += self._wait(in_flight.popleft(), deadline, calls)
        if mismatch is not None:
            raise WeightSyncError(f"the export does not match the manifest: {mismatch}")
        return sent, export_s, transfer_s

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

    def commit(self) -> None:
        """Every stage sent and the engines took the version: copy what was sent to host
        buffers in the background; a later failure restores that copy."""
        if not self.sent:
            raise RuntimeError("commit without a successful send")
        sent, self.sent = self.sent, []
        self._copier = threading.Thread(target=self._copy, args=(sent,), daemon=True)
        self._copier.start()

    def _copy(self, sent: list[tuple[str, torch.Tensor]]) -> None:
        began = time.monotonic()
        buffers = {name: buffer for name, buffer in self.committed}
        copy = []
        for name, tensor in sent:
            buffer = buffers.get(name)
            if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
                buffer = platform.host_buffer(tensor)
            copy.append((name, buffer.copy_(tensor, non_blocking=True)))
        platform.synchronize(self.device)
        self.committed, self._copy_s = copy, time.monotonic() - began

    def wait_for_rollback_copy(self) -> None:
        """Block until the background copy of the last committed sync is done: call before the
        trainer changes the parameters it may still be reading."""
        if self._copier is not None:
            self._copier.join()
            self._copier = None

    def restore(self, weight_version: int, timeout_s: float) -> bool:
        """Send the last committed copy again as ``weight_version`` (the session is still
        open); False if there is none yet (the first sync failed: the engines still hold their
        checkpoint)."""
        self.wait_for_rollback_copy()
        self.sent = []
        if self.group is None:
            raise WeightSyncError(
                "the broadcast group was dropped after an engine died: it must be formed again"
            )
        if not self.committed:
            return False
        manifest = [TensorSpec.of(name, tensor) for name, tensor in self.committed]
        restoring = ((name, tensor.to(self.device)) for name, tensor in self.committed)
        self.send(restoring, manifest, weight_version, timeout_s)
        self.sent = []
        return True

    def _drop_group(self) -> None:
        """Leave the broadcast group at once: an engine of it died mid-sync, so the others wait
        for tensors that will never come; this side closing its connections ends their wait."""
        if self.group is not None:
            dist.destroy_process_group(self.group)
            self.group = None

    def close(self) -> None:
        self.wait_for_rollback_copy()
        for target in self.targets:
            try:
                self.control.post(
                    target.url, "/destroy_weights_update_group", {"group_name": self.group_name}, 30
                )
            except EngineRequestError:
                pass  # the engine is gone or stopping, or never joined: nothing to tear down
        self._drop_group()
        self.control.close()


def custom_group(
    backend: str,
    host: str,
    port: int,
    world_size: int,
    rank: int,
    group_name: str,
    timeout_s: float,
) -> dist.ProcessGroup:
    """A process group outside the default world, built by the same SGLang helper the engines
    use for their side of it (rank 0 hosts the store); imported here, on the few ranks that
    send weights, because SGLang's utilities are a heavy import."""
    from sglang.srt.utils.common import init_custom_process_group

    return init_custom_process_group(
        backend=backend,
        init_method=f"tcp://{host}:{port}",
        timeout=timedelta(seconds=timeout_s),
        world_size=world_size,
        rank=rank,
        group_name=group_name,
    )
