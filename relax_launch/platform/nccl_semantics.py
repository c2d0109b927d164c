"""The CPU's weight-sync backend: gloo, behaving as NCCL does where the two differ and the sync
depends on it, so that code which is wrong under NCCL fails on the CPU too.

Registered with ``torch.distributed.Backend.register_backend`` as ``BACKEND``, in every process
that forms a weight-sync group (the trainer's senders, ``platform.weight_sync_backend``; each
SGLang process, through the receiver plugin). What it changes on top of gloo:

- ``work.wait(timeout)`` blocks until the work completes or until ``timeout`` has passed *since
  the work was enqueued* (NCCL's ``workStartTime_``), and on expiry **aborts the group** and
  raises: every pending and later collective of the group fails at once, as with NCCL's
  ``ncclCommAbort``. Gloo instead raises and lets the work go on.
- ``work.is_completed()`` never blocks (as NCCL's event query), and is True for the works of
  an aborted group.
- ``RELAX_LAUNCH_BROADCAST_S`` (tests only), set where a group's rank 0 (the sender) forms
  it, makes every broadcast of that group take at least that long on every rank, in order, as
  a stream of GPU-sized transfers would: a wait sized for the CPU's fast broadcasts then meets
  what a GPU job meets. Rank 0 passes it to the others through the group's store, so an engine
  started before the test set it slows down too.

``work.wait()`` with no timeout blocks until the work is done. NCCL's instead returns at once
and makes the current CUDA stream wait for the work; CPU tensors have no stream, so blocking is
the equivalent that keeps the data correct for what follows. Only broadcasts are implemented:
the weight sync's groups run nothing else (the trainer's own groups stay gloo).
"""

from __future__ import annotations

import os
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

BACKEND = "gloo_as_nccl"
SLOW_BROADCAST_ENV = "RELAX_LAUNCH_BROADCAST_S"
SLOW_BROADCAST_KEY = "relax_launch/broadcast_s"
POLL_S = 1e-3
_registered = threading.Lock()


def register() -> str:
    """Register the backend in this process (once); returns its name."""
    with _registered:
        if BACKEND not in dist.Backend.backend_list:
            dist.Backend.register_backend(BACKEND, NcclSemanticsGroup, devices=["cpu"])
    return BACKEND


class CommunicatorAborted(RuntimeError):
    """Every collective of a group after it was aborted (NCCL: the communicator is gone)."""


class NcclSemanticsGroup(dist.ProcessGroup):
    """One weight-sync group: a gloo group underneath, NCCL's waits and aborts on top."""

    def __init__(self, store: dist.Store, rank: int, size: int, timeout: timedelta) -> None:
        super().__init__(rank, size)
        if rank == 0:  # set before gloo's rendezvous, which the other ranks wait in
            store.set(SLOW_BROADCAST_KEY, os.environ.get(SLOW_BROADCAST_ENV) or "0")
        self.gloo = dist.ProcessGroupGloo(store, rank, size, timeout)
        self.broadcast_s = float(store.get(SLOW_BROADCAST_KEY).decode())
        # torch keeps a group's name on its backends (destroy_process_group reads it there);
        # collectives still reach this class's methods, which override the backend's
        self._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, self.gloo)
        self.stream_free_at = 0.0  # when the last enqueued broadcast may complete
        self.aborted: str | None = None

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return BACKEND

    def broadcast(self, tensors: list, opts: dist.BroadcastOptions) -> NcclSemanticsWork:
        if self.aborted is not None:
            raise CommunicatorAborted(self.aborted)
        work = self.gloo.broadcast(tensors, opts)
        self.stream_free_at = max(time.monotonic(), self.stream_free_at) + self.broadcast_s
        return NcclSemanticsWork(self, work, self.stream_free_at)

    def abort(self, reason: str) -> None:
        self.aborted = self.aborted or reason


class NcclSemanticsWork(dist.Work):
    """One broadcast, waited for as ``WorkNCCL`` is (see the module docstring)."""

    def __init__(self, group: NcclSemanticsGroup, gloo: dist.Work, done_at: float) -> None:
        super().__init__()
        self.group, self.gloo, self.done_at = group, gloo, done_at
        self.enqueued = time.monotonic()

    def is_completed(self) -> bool:
        if self.group.aborted is not None:
            return True
        return time.monotonic() >= self.done_at and self.gloo.is_completed()

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        limit = None if not timeout else self.enqueued + timeout.total_seconds()
        while not self.is_completed():
            if limit is not None and time.monotonic() >= limit:
                self.group.abort(
                    f"Watchdog caught collective operation timeout: WorkNCCL(OpType=BROADCAST, "
                    f"Timeout(ms)={timeout.total_seconds() * 1000:.0f}) ran for "
                    f"{(time.monotonic() - self.enqueued) * 1000:.0f} ms before timing out; "
                    "the communicator was aborted"
                )
                break
            time.sleep(POLL_S)
        if self.group.aborted is not None:
            raise CommunicatorAborted(self.group.aborted)
        return self.gloo.wait()
