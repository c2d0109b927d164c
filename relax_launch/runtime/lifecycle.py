"""LifecycleCoordinator: which role holds the shared ranks of a colocated job (split, defer).

Every role registers its ranks, the parts of its memory (trainer: params, grads, optimizer;
engines: weights, kv_cache) and two confirmed operations: onload and offload of named parts. A
role is granted parts (``activate``) only once every other role on its ranks has confirmed the
offload of everything it held — except the parts listed as co-resident (the weight sync, where
the trainer's parameters and the rollout engine's weights meet). The rules:

- An operation that fails or times out leaves its role BLOCKED: the lease is kept even if the
  late call succeeds, the batch in flight fails and its waiters wake with ``BatchFailed``. Only
  a confirmed cleanup (``deactivate`` that succeeds) releases a blocked lease.
- Operation ids deduplicate: a repeated id joins (or returns) the first call; the same id for a
  different batch, action, role or parts is refused.
- One batch in flight. It commits only once no inference role holds memory; consumers wait on
  ``wait_committed`` (the commit gate) before training on it.

Every grant, confirmation, block, commit and failure is an event, kept in order and written to
a JSON-lines log: it proves which roles held which ranks at each moment.
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from typing import Any

from relax_launch.deadline import Deadline
from relax_launch.runtime.leases import (
    BATCH_HISTORY,
    OPERATION_HISTORY,
    BatchFailed,
    BatchRecord,
    Lease,
    LeaseError,
    Member,
    Operation,
    OperationRecord,
    trim_history,
)

TRAINER = "trainer"


class LifecycleCoordinator:
    """In-process on rank 0; thread-safe. See the module docstring for the contract."""

    def __init__(
        self,
        *,
        operation_timeout_s: float,
        co_resident: Iterable[tuple[str, str]] = (),
        log_path: Path | None = None,
    ) -> None:
        self.operation_timeout_s = operation_timeout_s
        self.co_resident = frozenset(co_resident)
        self.log_path = log_path
        self.members: dict[str, Member] = {}
        self.events: list[dict[str, Any]] = []
        self.batches: OrderedDict[int, BatchRecord] = OrderedDict()
        self.operations: OrderedDict[str, OperationRecord] = OrderedDict()
        self.pending: int | None = None
        self._changed = threading.Condition()
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="relax-lifecycle")
        self._started = time.monotonic()

    # ---- topology ------------------------------------------------------------------------

    def register(
        self,
        role: str,
        *,
        ranks: Iterable[int],
        parts: Iterable[str],
        onload: Operation,
        offload: Operation,
        inference: bool = True,
        resident: Iterable[str] = (),
    ) -> None:
        """Add a role; repeating an identical registration is a no-op. Frozen once a batch began."""
        ranks, parts = frozenset(ranks), tuple(parts)
        with self._changed:
            known = self.members.get(role)
            if known is not None and (known.ranks, known.parts) == (ranks, parts):
                return
            if self.batches:
                raise LeaseError(f"cannot register {role}: the topology is frozen after batch 0")
            if known is not None:
                raise LeaseError(f"{role} is registered already with other ranks or parts")
            held = set(resident)
            lease = Lease.ACTIVE if held else Lease.SLEEPING
            self.members[role] = Member(role, ranks, parts, onload, offload, inference, held, lease)

    def holding(self) -> list[str]:
        """The inference roles that hold memory on their ranks (or may: not asleep), in the
        order they registered."""
        with self._changed:
            return [
                m.role
                for m in self.members.values()
                if m.inference and (m.resident or m.lease is not Lease.SLEEPING)
            ]

    def state(self) -> dict[str, dict[str, Any]]:
        """Each role's lease, resident parts and ranks (``GET /{role}/admin/engines``)."""
        with self._changed:
            return {
                m.role: {
                    "lease": m.lease.value,
                    "resident": sorted(m.resident),
                    "ranks": sorted(m.ranks),
                }
                for m in self.members.values()
            }

    # ---- leases --------------------------------------------------------------------------

    def activate(
        self, role: str, parts: Iterable[str] | None = None, operation_id: str | None = None
    ) -> dict[str, float]:
        """Onload ``parts`` (default: all) of ``role`` once no other role holds its ranks."""
        return self._operate("activate", role, parts, operation_id)

    def deactivate(
        self, role: str, parts: Iterable[str] | None = None, operation_id: str | None = None
    ) -> dict[str, float]:
        """Offload ``parts`` (default: all); confirmed, it releases them. On a BLOCKED role this
        is the cleanup that releases its lease (every part it may hold is offloaded)."""
        return self._operate("deactivate", role, parts, operation_id)

    def _operate(
        self, action: str, role: str, parts: Iterable[str] | None, operation_id: str | None
    ) -> dict[str, float]:
        with self._changed:
            member = self._member(role)
            wanted = self._parts(member, parts)
            batch = next(reversed(self.batches), None)  # the batch begun last, even if failed
            fingerprint = (batch, action, role, wanted)
            record = self.operations.get(operation_id) if operation_id else None
            if record is not None and record.fingerprint != fingerprint:
                raise LeaseError(
                    f"operation id {operation_id!r} was used for {record.fingerprint}, not for "
                    f"{fingerprint}: use a new id for a different batch, action, role or parts"
                )
            if record is None:
                record = self._start(action, member, wanted, fingerprint)
                if operation_id:
                    self._remember(operation_id, record)
        return self._settle(action, member, record)

    def _start(
        self, action: str, member: Member, wanted: tuple[str, ...], fingerprint: tuple
    ) -> OperationRecord:
        """Check the grant, mark the role in transition and run the operation (lock held)."""
        if action == "activate":
            self._check_grant(member, wanted)
            todo = tuple(p for p in wanted if p not in member.resident)
            member.lease, call, changes = Lease.ONLOADING, member.onload, wanted
        else:
            if member.lease is Lease.BLOCKED:
                todo = member.parts  # after an unknown outcome, anything may be held
            else:
                self._check_idle(member)
                todo = tuple(p for p in wanted if p in member.resident)
            member.lease, call, changes = Lease.DRAINING, member.offload, todo
        self._log("grant" if action == "activate" else "release", member, todo)
        future = self._pool.submit(call, todo) if todo else self._pool.submit(dict)  # {}
        return OperationRecord(
            fingerprint, future, changes, time.monotonic(), Deadline(self.operation_timeout_s)
        )

    def _settle(self, action: str, member: Member, record: OperationRecord) -> dict[str, float]:
        """Wait for the operation; the first waiter to finish decides its outcome, once: a late
        answer after a timeout changes nothing, a joined duplicate gets the same outcome."""
        result, why = self._wait(record) if record.outcome is None else ({}, "")
        with self._changed:
            if record.outcome is None:
                record.outcome = self._apply(action, member, record, result, why)
            outcome = record.outcome
        if isinstance(outcome, LeaseError):
            raise LeaseError(str(outcome))
        return outcome

    def _wait(self, record: OperationRecord) -> tuple[dict[str, float], str]:
        """The operation's result, or why there is none, within the timeout from its start."""
        try:
            return record.future.result(timeout=record.deadline.left()) or {}, ""
        except FutureTimeout:
            return {}, f"no answer within {self.operation_timeout_s:.0f} s"
        except Exception as exc:  # noqa: BLE001 - any failure leaves the outcome unknown
            return {}, f"{type(exc).__name__}: {exc}"

    def _apply(
        self, action: str, member: Member, record: OperationRecord, result: dict, why: str
    ) -> dict[str, float] | LeaseError:
        if why:
            return self._block(member, action, why)
        if action == "activate":
            member.resident |= set(record.changes)
        else:
            member.resident -= set(record.changes)
        member.lease = Lease.ACTIVE if member.resident else Lease.SLEEPING
        outcome = {**result, "seconds": time.monotonic() - record.began}  # the wall time
        self._log("confirm", member, record.changes, **outcome)
        self._changed.notify_all()
        return outcome

    def _block(self, member: Member, action: str, why: str) -> LeaseError:
        """Keep the lease and fail the batch in flight (lock held); the error names the role."""
        member.lease = Lease.BLOCKED
        message = (
            f"{member.describe()}: {'onload' if action == 'activate' else 'offload'} failed "
            f"({why}); its lease stays BLOCKED until an offload is confirmed "
            f"(deactivate('{member.role}'))"
        )
        self._log("block", member, (), error=why)
        if self.pending is not None:
            self._finish(self.pending, "failed", message)
        self._changed.notify_all()
        return LeaseError(message)

    def _check_grant(self, member: Member, wanted: tuple[str, ...]) -> None:
        self._check_idle(member)
        if member.lease is Lease.BLOCKED:
            raise LeaseError(f"{member.describe()} is BLOCKED: clean it up with deactivate first")
        mine = {(member.role, p) for p in wanted}
        for other in self.members.values():
            if other is member or not (other.ranks & member.ranks):
                continue
            theirs = {(other.role, p) for p in other.resident}
            blocked = other.lease is Lease.BLOCKED
            in_motion = other.lease in (Lease.ONLOADING, Lease.DRAINING)
            if blocked or in_motion or (theirs and not (theirs | mine) <= self.co_resident):
                held = ", ".join(sorted(other.resident)) or other.lease.value
                raise LeaseError(
                    f"{member.describe()} cannot take {', '.join(wanted)}: the lease is held by "
                    f"{other.describe()} ({held}; {other.lease.value}) until it offloads"
                )

    def _check_idle(self, member: Member) -> None:
        if member.lease in (Lease.ONLOADING, Lease.DRAINING):
            raise LeaseError(f"{member.describe()} is {member.lease.value}: one operation a time")

    # ---- batches -------------------------------------------------------------------------

    def begin_batch(self, batch: int) -> None:
        """Batch ids are increasing integers; only one may be in flight."""
        with self._changed:
            if not isinstance(batch, int) or isinstance(batch, bool) or batch < 0:
                raise LeaseError(f"batch ids are integers >= 0, not {batch!r}")
            if self.pending is not None:
                raise LeaseError(f"batch {self.pending} is still in flight; batch {batch} waits")
            if self.batches and batch <= next(reversed(self.batches)):
                raise LeaseError(f"batch {batch} is not after batch {next(reversed(self.batches))}")
            blocked = [m.describe() for m in self.members.values() if m.lease is Lease.BLOCKED]
            if blocked:
                raise LeaseError(f"cannot begin batch {batch}: {', '.join(blocked)} BLOCKED")
            self.pending = batch
            self.batches[batch] = BatchRecord(batch)
            trim_history(self.batches, BATCH_HISTORY)
            self._log("begin", None, (), batch=batch)

    def commit_batch(self, batch: int) -> None:
        """Publish the batch to its consumers; only once every inference role has offloaded."""
        with self._changed:
            if self.pending != batch:
                raise LeaseError(f"batch {batch} is not the batch in flight ({self.pending})")
            holding = [
                f"{m.describe()} holds {', '.join(sorted(m.resident)) or m.lease.value}"
                for m in self.members.values()
                if m.inference and (m.resident or m.lease is not Lease.SLEEPING)
            ]
            if holding:
                raise LeaseError(
                    f"cannot commit batch {batch} before inference offload: {'; '.join(holding)}"
                )
            self._finish(batch, "committed", "")

    def fail_batch(self, batch: int, why: str) -> None:
        """Mark the batch failed and wake its waiters; leases are left as they are."""
        with self._changed:
            record = self.batches.get(batch)
            if record is None or record.state != "pending":
                return
            self._finish(batch, "failed", why)

    def wait_committed(self, batch: int, timeout_s: float) -> None:
        """Block until ``batch`` commits; ``BatchFailed`` if it failed. A timeout changes
        nothing (the batch and the leases are as they were)."""
        deadline = Deadline(timeout_s)
        with self._changed:
            while True:
                record = self.batches.get(batch)
                if record is None:
                    raise LeaseError(f"batch {batch} was never begun (or left the history)")
                if record.state == "committed":
                    return
                if record.state == "failed":
                    raise BatchFailed(f"batch {batch} failed: {record.error}")
                if deadline.passed:
                    raise TimeoutError(f"batch {batch} was not committed within {timeout_s} s")
                self._changed.wait(deadline.left())

    def _finish(self, batch: int, state: str, error: str) -> None:
        self.batches[batch].state, self.batches[batch].error = state, error
        self.pending = None
        self._log("commit" if state == "committed" else "fail", None, (), batch=batch, error=error)
        self._changed.notify_all()

    # ---- helpers -------------------------------------------------------------------------

    def _member(self, role: str) -> Member:
        if role not in self.members:
            raise LeaseError(f"unknown role {role!r}; registered: {sorted(self.members)}")
        return self.members[role]

    def _parts(self, member: Member, parts: Iterable[str] | None) -> tuple[str, ...]:
        wanted = member.parts if parts is None else tuple(parts)
        unknown = sorted(set(wanted) - set(member.parts))
        if unknown or not wanted:
            raise LeaseError(f"{member.role} parts are {member.parts}, not {list(wanted)}")
        return tuple(p for p in member.parts if p in wanted)

    def _remember(self, operation_id: str, record: OperationRecord) -> None:
        self.operations[operation_id] = record
        trim_history(self.operations, OPERATION_HISTORY)

    def _log(self, event: str, member: Member | None, parts: Iterable[str], **extra: Any) -> None:
        entry = {
            "t": round(time.monotonic() - self._started, 4),
            "event": event,
            "batch": extra.pop("batch", self.pending),
        }
        if member is not None:
            entry |= {"role": member.role, "parts": list(parts), "lease": member.lease.value}
        entry |= {k: v for k, v in extra.items() if v not in ("", None)}
        entry["holders"] = {m.role: sorted(m.resident) for m in self.members.values() if m.resident}
        self.events.append(entry)
        if self.log_path is not None:
            with self.log_path.open("a") as log:
                log.write(json.dumps(entry) + "\n")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
