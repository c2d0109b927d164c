"""The engines' side of one weight sync: open an update session, commit a version, close.

A sync has one session per engine however many pipeline stages send into it (SGLang allows one
open session per engine), so the controller opens and closes it around every stage's sender
(``runtime/session.py``). Stdlib only: rank 0 drives it without importing torch here.
"""

from __future__ import annotations

from dataclasses import dataclass

from relax_launch.weights.engine_client import Background, EngineRequestError


class WeightSyncError(RuntimeError):
    """A sync failed; the message says which engine and whether the rollback held."""


@dataclass(frozen=True)
class EngineTarget:
    """One rollout engine as the senders see it."""

    url: str
    rank_offset: int
    label: str


class UpdateSession:
    """Open on every engine, then ``commit(version)`` or not, then ``close`` (always)."""

    def __init__(self, targets: list[EngineTarget], timeout_s: float) -> None:
        self.targets, self.timeout_s = targets, timeout_s

    def open(self) -> None:
        self._on_every_engine("opening an update session", "/begin_weight_update", {})

    def commit(self, version: int) -> None:
        body = {"new_version": str(version), "abort_all_requests": False}
        self._on_every_engine("setting weight_version", "/update_weight_version", body)

    def close(self) -> None:
        self._on_every_engine("closing the update session", "/end_weight_update", {})

    def _on_every_engine(self, what: str, path: str, body: dict) -> None:
        calls = [Background(t.url, path, body, self.timeout_s) for t in self.targets]
        await_all(self.targets, calls, what, self.timeout_s)


def await_all(
    targets: list[EngineTarget], calls: list[Background], what: str, timeout_s: float
) -> None:
    """Wait for one request per engine; the first failure names its engine and the step."""
    for target, call in zip(targets, calls, strict=True):
        try:
            call.result(timeout_s)
        except EngineRequestError as exc:
            raise EngineRequestError(f"{target.label} failed {what}: {exc}") from None
