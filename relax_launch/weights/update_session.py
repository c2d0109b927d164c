"""The engines' side of one weight sync, as the controller drives it: a deadline for the whole
sync, and the update session SGLang requires around every update request.

A sync has one session per engine however many pipeline stages send into it (SGLang allows one
open session per engine), so the controller opens and closes it around every stage's sender
(``runtime/session.py``). The version is set by the update requests themselves. No torch here:
rank 0 drives it without importing torch.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass

from relax_launch.deadline import Deadline
from relax_launch.inference.engine import EngineControl, EngineRequestError, result


class WeightSyncError(RuntimeError):
    """A sync failed; the message says which engine and what it was doing."""


@dataclass(frozen=True)
class EngineTarget:
    """One rollout engine as the senders see it."""

    url: str
    rank_offset: int
    label: str
    tp_size: int = 1


def sync_deadline(timeout_s: float) -> Deadline:
    """The end of one whole sync; every call inside it waits at most what is left, and one
    that would start after it raises ``WeightSyncError`` naming what it was about to do."""

    def expired(before: str) -> WeightSyncError:
        return WeightSyncError(
            f"weight sync passed its {timeout_s:.0f} s deadline (weight_sync.timeout_s) before "
            f"{before}"
        )

    return Deadline(timeout_s, expired)


class UpdateSession:
    """Open on every engine, then the senders' update requests, then ``close`` (always)."""

    def __init__(
        self, targets: list[EngineTarget], deadline: Deadline, control: EngineControl
    ) -> None:
        self.targets, self.deadline, self.control = targets, deadline, control

    def open(self) -> None:
        self._on_every_engine("opening an update session", "/begin_weight_update")

    def close(self) -> None:
        self._on_every_engine("closing the update session", "/end_weight_update")

    def _on_every_engine(self, what: str, path: str) -> None:
        timeout_s = self.deadline.left(what)
        calls = [self.control.submit(t.url, path, {}, timeout_s) for t in self.targets]
        await_all(self.targets, calls, what, self.deadline)


def await_all(
    targets: list[EngineTarget], calls: list[Future], what: str, deadline: Deadline
) -> list:
    """Each engine's reply to its request, in order; the first failure names its engine and
    the step."""
    replies = []
    for target, call in zip(targets, calls, strict=True):
        try:
            replies.append(result(call, deadline.left(what)))
        except (EngineRequestError, WeightSyncError) as exc:
            error = type(exc) if isinstance(exc, EngineRequestError) else EngineRequestError
            raise error(f"{target.label} failed {what}: {exc}") from None
    return replies
