"""The vocabulary of the lifecycle coordinator (``runtime/lifecycle.py``): a role's lease on
its shared ranks, the member record of a registered role, and the records of the batches and
onload/offload operations it keeps (bounded histories)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from relax_launch.deadline import Deadline
from relax_launch.rl.interfaces import TurnRefused

# What one onload/offload returns: e.g. {"bytes": moved}; None counts as nothing reported.
Operation = Callable[[tuple[str, ...]], "dict[str, float] | None"]
BATCH_HISTORY, OPERATION_HISTORY = 1024, 8192


class Lease(StrEnum):
    SLEEPING = "sleeping"  # holds nothing
    ONLOADING = "onloading"
    ACTIVE = "active"  # holds some or all of its parts
    DRAINING = "draining"
    BLOCKED = "blocked"  # an operation's outcome is unknown: keeps its ranks until cleaned up


class LeaseError(TurnRefused):
    """A grant, commit or registration was refused; nothing changed."""


class BatchFailed(RuntimeError):
    """The batch was failed (a phase's error or a blocked lease); it is never committed."""


@dataclass
class Member:
    role: str
    ranks: frozenset[int]
    parts: tuple[str, ...]
    onload: Operation
    offload: Operation
    inference: bool
    resident: set[str] = field(default_factory=set)
    lease: Lease = Lease.SLEEPING

    def describe(self) -> str:
        ranks = ",".join(map(str, sorted(self.ranks)))
        return f"{self.role} (rank{'s' * (len(self.ranks) > 1)} {ranks})"


@dataclass
class BatchRecord:
    batch: int
    state: str = "pending"  # pending -> committed | failed
    error: str = ""


@dataclass
class OperationRecord:
    fingerprint: tuple[Any, ...]
    future: Future
    changes: tuple[str, ...]  # the parts it onloads, or offloads
    began: float
    deadline: Deadline  # of the answer: operation_timeout_s from the start
    outcome: dict[str, float] | LeaseError | None = None  # decided once


def trim_history(history: OrderedDict, bound: int) -> None:
    """Forget the oldest records beyond ``bound``."""
    while len(history) > bound:
        history.popitem(last=False)
