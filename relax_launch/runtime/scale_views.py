"""What rank 0's ``EngineScaler`` shows of the elastic roles: every engine of a role's plan
with its state (the admin route's ``replicas``, which ``relax-launch top`` prints), and the
shared spare pool (``cluster.spare_ranks``): its ranks and the engine of each role started or
starting there. ``pool_engines`` is the one answer to "who holds the pool": the discovery
document's ``pool``, the replicas' ``spare pool, held by ...``, a scale-out's room and the
pool's autoscaler all read it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from relax_launch.inference.discovery import PoolEngineRecord, PoolRecord
from relax_launch.placement.plan import EnginePlan
from relax_launch.runtime.scale_records import state_of

if TYPE_CHECKING:
    from relax_launch.runtime.scaling import EngineScaler


def pool_engines(scaler: EngineScaler) -> list[EnginePlan]:
    """The pool engines started (or starting) now, of every role."""
    return [
        engine
        for role, engines in scaler.roles.items()
        for engine in engines
        if engine.pool and engine.index in scaler.running[role]
    ]


def holder(scaler: EngineScaler, engine: EnginePlan) -> str | None:
    """The engine of another role on ``engine``'s pool ranks, as ``model/index (role)``."""
    if not engine.pool:
        return None
    for other in pool_engines(scaler):
        if other.role != engine.role and set(other.ranks) & set(engine.ranks):
            return f"{scaler.managers[other.role].model_id}/{other.index} ({other.role})"
    return None


def pool(scaler: EngineScaler) -> PoolRecord | None:
    """The shared spare pool: its ranks, the free ones, and each engine holding some (None
    when the job has no pool)."""
    ranks = sorted({r for e in scaler.plan.engines if e.pool for r in e.ranks})
    if not ranks:
        return None
    held = [
        PoolEngineRecord(
            role=e.role,
            engine_id=f"{scaler.managers[e.role].model_id}/{e.index}",
            ranks=e.ranks,
            state=engine_state(scaler, e),
        )
        for e in pool_engines(scaler)
    ]
    taken = {r for e in held for r in e.ranks}
    return PoolRecord(
        ranks=tuple(ranks),
        roles=tuple(r for r, engines in scaler.roles.items() if any(e.pool for e in engines)),
        free_ranks=tuple(r for r in ranks if r not in taken),
        engines=tuple(held),
    )


def engine_state(scaler: EngineScaler, engine: EnginePlan) -> str:
    """One engine's state: serving, weight_syncing, draining, lost; while an operation moves
    it, the operation's (starting, health_checking, ...); reserved (a pool engine: ``spare
    pool``, or ``spare pool, held by X`` while another role's engine runs on its ranks)."""
    manager = scaler.managers[engine.role]
    handle = next((e for e in manager.engines if e.index == engine.index), None)
    state = state_of(manager, handle) if handle is not None else "reserved"
    active = scaler.active.get(engine.role)
    if state != "serving" and active is not None:
        moving = {r.index: r.state for r in active.replicas}
        state = moving.get(engine.index, state)
    if engine.pool and state == "reserved":
        held = holder(scaler, engine)
        state = f"spare pool, held by {held}" if held else "spare pool"
    return state


def replicas(scaler: EngineScaler, role: str) -> list[dict[str, Any]]:
    """Every engine of ``role`` in the plan: its state, URL and requests in flight."""
    manager = scaler.managers[role]
    handles = {e.index: e for e in manager.engines}
    out = []
    for engine in scaler.roles[role]:
        handle = handles.get(engine.index)
        out.append(
            {
                "index": engine.index,
                "engine_id": f"{manager.model_id}/{engine.index}",
                "reserved": engine.reserved,
                "pool": engine.pool,
                "ranks": list(engine.ranks),
                "state": engine_state(scaler, engine),
                "url": handle.url if handle is not None else None,
                "in_flight": manager.requests.in_flight(handle.engine_id) if handle else 0,
                "answered": manager.requests.answered(handle.engine_id) if handle else 0,
            }
        )
    return out
