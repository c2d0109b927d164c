"""Whether a scale request may start (``EngineScaler.request``): the model and bound it names
are the role's, no other operation of the role is in flight, the role serves, and the target is
within the role's engines and in the direction of the request's kind. Each refusal is a
``ScaleRefused`` with its HTTP status and what to do instead."""

from __future__ import annotations

from collections.abc import Iterable

from relax_launch.inference.discovery import State
from relax_launch.inference.manager import InferenceManager
from relax_launch.inference.scale_routes import ScaleRefused
from relax_launch.runtime.scale_records import ScaleOperation


def check_request(
    role: str,
    manager: InferenceManager,
    kind: str,
    target: int,
    model: str | None,
    timeout_s: float | None,
    active: ScaleOperation | None,
) -> None:
    """The request itself, and the state of ``role`` (``manager``'s): serving, with no
    operation in flight (``active``)."""
    if model is not None and model not in {manager.model_id, *manager.routing.aliases}:
        raise ScaleRefused(400, f"{role} serves no model {model!r}; known: {manager.model_id}")
    if timeout_s is not None and not timeout_s > 0:
        raise ScaleRefused(400, f"timeout_secs must be above 0, not {timeout_s}")
    if active is not None:
        same = " (the same target)" if (active.kind, active.target) == (kind, target) else ""
        raise ScaleRefused(
            409,
            f"{active.kind} to {active.target} engines of {role} is in flight{same} "
            f"(request {active.request_id}); wait for it to end",
        )
    if manager.state is State.FAILED:
        raise ScaleRefused(409, f"{role} is FAILED (a lifecycle operation failed); onload it first")
    if manager.state is not State.READY:
        state = manager.state.value
        raise ScaleRefused(409, f"{role} is {state}, not serving yet; retry later")


def check_target(role: str, kind: str, target: int, now: int, bounds: tuple[int, int]) -> None:
    """``target`` engines of ``role``, which has ``now``: between its planned engines and its
    ``max_engines`` (``bounds``), and another count, in the direction of ``kind``."""
    planned, most = bounds
    if not planned <= target <= most:
        raise ScaleRefused(
            400,
            f"num_replicas={target} is outside {planned} (the planned engines) to "
            f"{most} ({role}.max_engines)",
        )
    if target == now:
        raise ScaleRefused(409, f"{role} has {now} engines already (num_replicas={target})")
    if (target < now) == (kind == "scale_out"):
        other = "scale_in" if kind == "scale_out" else "scale_out"
        raise ScaleRefused(
            400, f"{role} has {now} engines: {kind} to {target} goes the wrong way; use {other}"
        )


def check_pool_room(role: str, free: int, wanted: int, holders: Iterable[str | None]) -> None:
    """A scale-out of ``wanted`` engines where ``free`` reserved engines are startable: the
    others' ranks are held by another role on the spare pool (``holders``)."""
    if free >= wanted:
        return
    held = ", ".join(sorted({h for h in holders if h is not None})) or "nobody"
    raise ScaleRefused(
        409,
        f"{role} can start {free} more engines, not {wanted}: the spare pool's ranks are held "
        f"by {held}; scale that role in first",
    )
