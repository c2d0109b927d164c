"""What a scale operation (``runtime/scaling.py``) is and reports: its engines' outcomes, and the
state of each engine of an elastic role."""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from relax_launch.console import operator_log
from relax_launch.inference.engine import EngineHandle
from relax_launch.inference.manager import InferenceManager


@dataclass
class Replica:
    """One engine an operation starts or stops, and how that went."""

    index: int
    engine_id: str
    # scale-out: pending, starting, health_checking, weight_syncing (rollout), serving;
    # scale-in: draining, stopped; either: failed, or stopped by a cancel
    state: str = "pending"
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
    state: str = "running"  # running (cancelling) -> succeeded | failed | cancelled
    error: str = ""
    replicas: list[Replica] = field(default_factory=list)
    started: float = field(default_factory=time.time)
    finished: float | None = None
    cancel: threading.Event = field(default_factory=threading.Event)  # asked by the API
    committed: bool = False  # past the point where a cancel is honoured (its engines route)

    def document(self, actual: int) -> dict[str, Any]:
        """What ``GET /{role}/{kind}/{request_id}`` answers; ``actual``: the role's engines
        serving now (an engine still starting or syncing is not)."""
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


class Cancelled(Exception):  # noqa: N818 - an operation's end, named for what it is
    """A scale-out cancelled through the API, its started engines stopped again."""


def state_of(manager: InferenceManager, handle: EngineHandle) -> str:
    """serving, weight_syncing (a rollout engine before its first sync), draining or lost."""
    if handle.engine_id in manager.retired:
        return "draining"
    if handle.engine_id in manager.joining:
        return "weight_syncing"
    if handle.engine_id in manager.lost:
        return "lost"
    return "serving"


def log_operation(op: ScaleOperation, actual: int, log_dir: Path) -> None:
    """Every operation's outcome: a line of ``scaling.jsonl`` in the run directory, and one
    for the operator."""
    document = op.document(actual)
    log_dir.mkdir(parents=True, exist_ok=True)
    with (log_dir / "scaling.jsonl").open("a") as log:
        log.write(json.dumps(document) + "\n")
    line = (
        f"relax-launch: {op.role} {op.kind} {op.before} -> {op.target} ({op.source}) "
        f"{op.state} in {document['seconds']:.1f} s; engines now: {actual}"
    )
    if op.error and op.state != "cancelled":
        operator_log().warning(f"{line}: {op.error}")
    else:
        operator_log().info(line)
