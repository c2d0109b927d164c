"""What a scale operation (``runtime/scaling.py``) is and reports: its engines' outcomes, and the
state of each engine of an elastic role."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from relax_launch.inference.engine import EngineHandle
from relax_launch.inference.manager import InferenceManager


@dataclass
class Replica:
    """One engine an operation starts or stops, and how that went."""

    index: int
    engine_id: str
    state: str = "pending"  # starting, joining, serving | draining, stopped | failed
    url: str | None = None
    error: str = ""
    seconds: float | None = None
    rerouted: int | None = None  # scale-in: requests still on it when its server stopped

    def document(self) -> dict[str, Any]:
        return {k: v for k, v in vars(self).items() if v not in ("", None)}


@dataclass
class ScaleOperation:
    request_id: str
    role: str
    kind: str  # "scale_out" | "scale_in"
    before: int
    target: int
    timeout_s: float
    source: str  # "api" | "autoscaler"
    state: str = "running"  # running -> succeeded | failed
    error: str = ""
    replicas: list[Replica] = field(default_factory=list)
    started: float = field(default_factory=time.time)
    finished: float | None = None

    def document(self, actual: int) -> dict[str, Any]:
        """What ``GET /{role}/{kind}/{request_id}`` answers."""
        out = {
            "request_id": self.request_id,
            "role": self.role,
            "operation": self.kind,
            "state": self.state,
            "source": self.source,
            "from": self.before,
            "target": self.target,
            "actual": actual,
            "timeout_secs": self.timeout_s,
            "started_at": self.started,
            "replicas": [r.document() for r in self.replicas],
        }
        if self.finished is not None:
            out |= {"finished_at": self.finished, "seconds": self.finished - self.started}
        if self.error:
            out["error"] = self.error
        return out


def state_of(manager: InferenceManager, handle: EngineHandle) -> str:
    """serving, joining (a rollout engine before its first sync), draining or lost."""
    if handle.engine_id in manager.retired:
        return "draining"
    if handle.engine_id in manager.joining:
        return "joining"
    if handle.engine_id in manager.lost:
        return "lost"
    return "serving"
