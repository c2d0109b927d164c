"""RouteResolver: the one rule that picks a model and an engine, for the gateway and the client.

Model: explicit ``model`` (id or alias) -> ``route_key`` -> the default; an unknown explicit
choice is a 400 and never falls back. Engine, by the role's ``routing.policy``: ``round_robin``
takes the ready engines in turn and ignores any routing key; ``affinity`` needs the routing key
(the ``x-smg-routing-key`` header; without it a 400) and sends each key to one engine by
rendezvous hashing. Through sglang-router the router picks the engine: under ``affinity`` the key
travels on to it (its ``manual`` policy pins each key to one worker), under ``round_robin`` it
does not. A model that is not READY is a 503.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import threading
from dataclasses import dataclass

from relax_launch.inference.disaggregation import PrefillTarget
from relax_launch.inference.discovery import Discovery, PrefillRecord, RouteMode, State

ROUTING_KEY_HEADER = "x-smg-routing-key"
RETRY_AFTER_S = 1
# Set on the gateway's own 503s (nothing reached an engine, so a client may try again).
REFUSED_HEADER = "x-relax-routing"
ROUTING_FIELDS = ("model", "route_key")
# Generation paths of a role and the engine path each one is forwarded to.
ENGINE_PATHS = {
    "/generate": "/generate",
    "/v1/chat/completions": "/v1/chat/completions",
    "/chat/completions": "/v1/chat/completions",
    "/v1/completions": "/v1/completions",
}


class RoutingError(Exception):
    """The request cannot be routed as asked (HTTP 400)."""

    status = 400


class ModelUnavailable(RoutingError):
    """The model exists but cannot take requests now (HTTP 503, retry later)."""

    status = 503


@dataclass(frozen=True)
class RouteTarget:
    model_id: str
    base_url: str
    engine_id: str | None  # None when the request goes through sglang-router
    generation: int
    served_model_name: str
    registry_epoch: str
    topology_revision: int
    routing_key: str | None = None  # sent on to sglang-router (policy affinity only)
    prefill: PrefillTarget | None = None  # a disaggregated pair's prefill half


def _selector(value: object, name: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise RoutingError(f"{name} must be a non-empty string")
    return value


def select_model(snapshot: Discovery, model: object = None, route_key: object = None) -> str:
    """The model id a request addresses; raises ``RoutingError`` (400) when it names none."""
    model, route_key = _selector(model, "model"), _selector(route_key, "route_key")
    routing = snapshot.routing
    if model is not None:
        chosen = model if model in snapshot.models else routing.aliases.get(model)
        if chosen is None:
            known = sorted(set(snapshot.models) | set(routing.aliases))
            raise RoutingError(f"{snapshot.role} serves no model {model!r}; known: {known}")
        return chosen
    if route_key is not None:
        if route_key not in routing.route_key_map:
            known = sorted(routing.route_key_map)
            raise RoutingError(f"{snapshot.role} has no route_key {route_key!r}; known: {known}")
        return routing.route_key_map[route_key]
    if routing.default_model is None:
        raise RoutingError(f"{snapshot.role} has no default model: name a model or route_key")
    return routing.default_model


def rendezvous(role: str, model_id: str, key: str, engine_ids: list[str]) -> str:
    """Highest-random-weight choice: stable per key, moves few keys when engines change."""

    def weight(engine_id: str) -> bytes:
        return hashlib.sha256(json.dumps([role, model_id, key, engine_id]).encode()).digest()

    return max(engine_ids, key=weight)


def prefill_target(record: PrefillRecord | None) -> PrefillTarget | None:
    if record is None:
        return None
    return PrefillTarget.at(record.engine_id, record.base_url, record.bootstrap_port)


class RouteResolver:
    """Resolves requests against discovery snapshots; keeps the round-robin cursors."""

    def __init__(self) -> None:
        self._cursors: dict[tuple[str, str, str], itertools.count] = {}
        self._lock = threading.Lock()

    def resolve(
        self,
        snapshot: Discovery,
        model: object = None,
        route_key: object = None,
        affinity_key: str | None = None,
    ) -> RouteTarget:
        model_id = select_model(snapshot, model, route_key)
        affinity = snapshot.routing.policy == "affinity"
        if affinity and not affinity_key:
            raise RoutingError(
                f"{snapshot.role} routes by affinity (gateway.routing_policy): send the "
                f"{ROUTING_KEY_HEADER} header"
            )
        record = snapshot.models[model_id]
        if record.state is not State.READY:
            raise ModelUnavailable(
                f"{snapshot.role} model {model_id!r} is {record.state.value}; retry later"
            )

        def target(
            base_url: str,
            engine_id: str | None,
            generation: int,
            routing_key: str | None = None,
            prefill: PrefillRecord | None = None,
        ) -> RouteTarget:
            return RouteTarget(
                model_id,
                base_url,
                engine_id,
                generation,
                record.served_model_name,
                snapshot.registry_epoch,
                snapshot.topology_revision,
                routing_key,
                prefill_target(prefill),
            )

        if record.route_mode is RouteMode.ROUTER:
            # the router chooses the engine; under affinity it needs the key to do so
            return target(record.router_url or "", None, 0, affinity_key if affinity else None)
        engines = {e.engine_id: e for e in record.engines if e.direct_eligible and e.base_url}
        if not engines:
            raise ModelUnavailable(f"{snapshot.role} model {model_id!r} has no ready engine")
        if affinity:
            chosen = engines[rendezvous(snapshot.role, model_id, affinity_key, list(engines))]
        else:
            chosen = list(engines.values())[self._next(snapshot, model_id) % len(engines)]
        return target(
            chosen.base_url or "", chosen.engine_id, chosen.generation, prefill=chosen.prefill
        )

    def _next(self, snapshot: Discovery, model_id: str) -> int:
        key = (snapshot.role, snapshot.registry_epoch, model_id)
        with self._lock:
            return next(self._cursors.setdefault(key, itertools.count()))
