"""Discovery, schema 2: what one role serves right now, as an immutable, validated snapshot.

The gateway's ``GET /{role}/engines`` publishes it and the direct ``InferenceClient`` routes
from it, so both read the same document. Multi-rank engines appear once, by their head URL.
"""

from __future__ import annotations

import json
from enum import StrEnum
from typing import Any, Literal, get_args, get_origin
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from relax_launch.inference.config import RoutingPolicy

SCHEMA_VERSION = 2
ROLES = ("rollout", "genrm", "teacher")
# gateway.routing_policy: engines in turn (any routing key ignored), or one engine per routing key


class State(StrEnum):
    STARTING = "STARTING"
    READY = "READY"
    DRAINING = "DRAINING"
    SLEEPING = "SLEEPING"
    ONLOADING = "ONLOADING"
    FAILED = "FAILED"
    DEAD = "DEAD"


class RouteMode(StrEnum):
    DIRECT = "DIRECT"  # the gateway or client picks an engine head
    ROUTER = "ROUTER"  # everything goes through one sglang-router process


class WeightSource(StrEnum):
    STATIC = "STATIC"  # loaded once from disk; every weight mutation is refused
    TRAINER = "TRAINER"  # follows the trainer through weight sync


class _Strict(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


def _check_url(url: str | None) -> str | None:
    if url is None:
        return None
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{url!r} is not an http(s) URL")
    if parts.username or parts.password or parts.query or parts.fragment:
        raise ValueError(f"{url!r} must not carry credentials, a query or a fragment")
    return url.rstrip("/")


class PrefillRecord(_Strict):
    """The prefill half a decode engine pairs with (prefill/decode disaggregation): requests go
    to both, with its bootstrap address (``base_url``'s host, ``bootstrap_port``)."""

    engine_id: str = Field(min_length=1)
    base_url: str
    bootstrap_port: int = Field(ge=1, le=65535)

    @field_validator("base_url")
    @classmethod
    def _valid_url(cls, url: str) -> str | None:
        return _check_url(url)


class EngineRecord(_Strict):
    """One logical engine (its head); followers of a multi-rank engine are not listed. A
    disaggregated pair is listed once, as its decode engine with its ``prefill`` half; it is
    eligible only while both halves are."""

    engine_id: str = Field(min_length=1)
    base_url: str | None
    state: State
    direct_eligible: bool
    generation: int = Field(ge=0, description="Bumped when the engine's process or URL changes.")
    prefill: PrefillRecord | None = None

    @field_validator("base_url")
    @classmethod
    def _valid_url(cls, url: str | None) -> str | None:
        return _check_url(url)

    @model_validator(mode="before")
    @classmethod
    def _eligible_only_when_ready(cls, data: dict) -> dict:
        if isinstance(data, dict) and (data.get("state") != "READY" or not data.get("base_url")):
            data = {**data, "direct_eligible": False}
        return data


class ModelRecord(_Strict):
    state: State
    route_mode: RouteMode
    router_url: str | None = None
    weight_source: WeightSource
    weight_version: str | None
    served_model_name: str
    engines: tuple[EngineRecord, ...]

    @field_validator("router_url")
    @classmethod
    def _valid_url(cls, url: str | None) -> str | None:
        return _check_url(url)

    @field_validator("engines")
    @classmethod
    def _unique_sorted(cls, engines: tuple[EngineRecord, ...]) -> tuple[EngineRecord, ...]:
        ids = [e.engine_id for e in engines]
        duplicates = sorted({i for i in ids if ids.count(i) > 1})
        if duplicates:
            raise ValueError(f"duplicate engine ids {duplicates}")
        return tuple(sorted(engines, key=lambda e: e.engine_id))

    @model_validator(mode="after")
    def _consistent(self) -> ModelRecord:
        if self.weight_source is WeightSource.STATIC and self.weight_version is not None:
            raise ValueError("a STATIC model publishes no weight_version (it never changes)")
        if (
            self.route_mode is RouteMode.ROUTER
            and self.state is State.READY
            and not self.router_url
        ):
            raise ValueError("route_mode ROUTER needs router_url")
        return self


class RoutingSpec(_Strict):
    """How a request picks a model: explicit ``model`` (id or alias), then ``route_key``, then
    the default."""

    default_model: str | None = None
    route_key_map: dict[str, str] = Field(default_factory=dict)
    aliases: dict[str, str] = Field(default_factory=dict)
    policy: RoutingPolicy = "round_robin"


class PoolEngineRecord(_Strict):
    """An engine started (or starting) on the shared spare pool's ranks."""

    role: Literal["rollout", "genrm", "teacher"]
    engine_id: str = Field(min_length=1)
    ranks: tuple[int, ...]
    state: str = Field(description="starting, health_checking, weight_syncing, serving, ...")


class PoolRecord(_Strict):
    """The job's shared spare pool (``cluster.spare_ranks``): its ranks, those no engine holds,
    and the engines holding the others (each role's engine there, whichever role it is)."""

    ranks: tuple[int, ...]
    roles: tuple[str, ...] = Field(description="The roles that may start engines there.")
    free_ranks: tuple[int, ...]
    engines: tuple[PoolEngineRecord, ...]


class Discovery(_Strict):
    schema_version: Literal[2] = SCHEMA_VERSION
    role: Literal["rollout", "genrm", "teacher"]
    registry_epoch: str = Field(min_length=1, description="Changes when the manager restarts.")
    topology_revision: int = Field(ge=0, description="Moves only when the content changes.")
    phase: str
    routing: RoutingSpec
    models: dict[str, ModelRecord]
    pool: PoolRecord | None = Field(
        None, description="The shared spare pool, on a role that may start engines there."
    )

    @model_validator(mode="after")
    def _consistent(self) -> Discovery:
        if self.role != "rollout":
            dynamic = [
                m for m, r in self.models.items() if r.weight_source is not WeightSource.STATIC
            ]
            if dynamic:
                raise ValueError(f"{self.role} serves only STATIC models, not {dynamic}")
        routing = self.routing
        targets = {
            "default_model": [routing.default_model] if routing.default_model else [],
            "route_key_map": list(routing.route_key_map.values()),
            "aliases": list(routing.aliases.values()),
        }
        for field, models in targets.items():
            missing = sorted(set(models) - set(self.models))
            if missing:
                raise ValueError(f"routing.{field} names unknown models {missing}")
        shadowing = sorted(set(routing.aliases) & set(self.models))
        if shadowing:
            raise ValueError(f"aliases {shadowing} shadow model ids")
        return self


def read_discovery(body: bytes | str) -> Discovery:
    """A discovery document as a client reads it: a gateway may add fields within a schema
    version (``pool`` joined schema 2), so fields this version does not know are left out at
    every level before the strict validation (``schema_version`` must still be 2)."""
    return Discovery.model_validate(_known(Discovery, json.loads(body)))


def _known(annotation: Any, value: Any) -> Any:
    """``value`` without the keys that ``annotation``'s models (nested ones too) do not have."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        if not isinstance(value, dict):
            return value
        fields = annotation.model_fields
        return {k: _known(fields[k].annotation, v) for k, v in value.items() if k in fields}
    args = get_args(annotation)
    if get_origin(annotation) is dict and len(args) == 2 and isinstance(value, dict):
        return {k: _known(args[1], v) for k, v in value.items()}
    if get_origin(annotation) in (tuple, list) and args and isinstance(value, list):
        return [_known(args[0], v) for v in value]
    models = [a for a in args if isinstance(a, type) and issubclass(a, BaseModel)]
    return _known(models[0], value) if len(models) == 1 else value  # X | None
