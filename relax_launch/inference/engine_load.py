"""An engine's own load, as its SGLang server reports it on ``/v1/loads``: requests waiting,
requests running, tokens generated per second (filled in because the engines run with
``enable_metrics``). The autoscaler, a scale-in's drain and ``relax-launch top`` read it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from relax_launch import http

LOADS = "/v1/loads?include=core"  # one entry per data-parallel rank of the engine


@dataclass(frozen=True)
class EngineLoad:
    queued: float
    running: float
    tokens_per_s: float


def parse_load(document: dict[str, Any]) -> EngineLoad:
    """The engine's load from its ``/v1/loads`` document, summed over its ranks."""
    loads = document.get("loads") or []
    return EngineLoad(
        queued=float(sum(entry.get("num_waiting_reqs", 0) for entry in loads)),
        running=float(sum(entry.get("num_running_reqs", 0) for entry in loads)),
        tokens_per_s=float(sum(entry.get("gen_throughput", 0.0) for entry in loads)),
    )


def engine_load(url: str, timeout_s: float = 2.0) -> EngineLoad | None:
    """The load of the engine at ``url``; None when it does not answer."""
    try:
        reply = http.call("GET", url + LOADS, timeout_s=timeout_s)
        return parse_load(reply.json()) if reply.ok else None
    except (http.TransportError, TimeoutError, OSError, ValueError, AttributeError):
        return None


def idle(url: str | None) -> bool:
    """Whether the engine reports no request queued or running (unreadable: taken as idle, the
    requests in flight to it decide; a scale-in's drain)."""
    if url is None:
        return True
    load = engine_load(url)
    return load is None or load.queued + load.running == 0
