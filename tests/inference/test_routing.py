"""Discovery schema 2 and the shared routing rule (pure logic, no processes)."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError
from sglang_router.launch_router import parse_router_args

from relax_launch.inference.discovery import Discovery, read_discovery
from relax_launch.inference.router import SGLangRouter
from relax_launch.inference.routing import (
    ModelUnavailable,
    RouteResolver,
    RoutingError,
    rendezvous,
    select_model,
)


def engine(i: int, state: str = "READY", url: str | None = None) -> dict:
    return {
        "engine_id": f"math/{i}",
        "base_url": url or f"http://10.0.0.{i}:3000",
        "state": state,
        "direct_eligible": True,
        "generation": 1,
    }


def model(state: str = "READY", engines: list | None = None, **extra) -> dict:
    record = {
        "state": state,
        "route_mode": "DIRECT",
        "weight_source": "STATIC",
        "weight_version": None,
        "served_model_name": "/models/math",
        "engines": engines if engines is not None else [engine(0), engine(1), engine(2)],
    }
    return {**record, **extra}


def snapshot(role: str = "teacher", **changes) -> Discovery:
    document = {
        "schema_version": 2,
        "role": role,
        "registry_epoch": "epoch-1",
        "topology_revision": 3,
        "phase": "serving",
        "routing": {
            "default_model": "math",
            "route_key_map": {"math-data": "math", "code-data": "code"},
            "aliases": {"teacher-checkpoint": "math"},
            "policy": "round_robin",
        },
        "models": {"math": model(), "code": model(engines=[engine(7)])},
    }
    document["models"].update(changes.pop("models", {}))
    document.update(changes)
    return Discovery.model_validate(document)


def test_routing_precedence_model_then_route_key_then_default():
    snap = snapshot()
    assert select_model(snap, "code", "math-data") == "code"  # explicit model wins
    assert select_model(snap, "teacher-checkpoint") == "math"  # an alias names its model
    assert select_model(snap, None, "code-data") == "code"  # then the route key
    assert select_model(snap) == "math"  # then the default


@pytest.mark.parametrize(
    "model,route_key", [("nope", None), ("nope", "math-data"), (None, "unknown-key")]
)
def test_explicit_unknown_selection_never_falls_back(model, route_key):
    with pytest.raises(RoutingError) as info:
        RouteResolver().resolve(snapshot(), model, route_key)
    assert info.value.status == 400 and "known" in str(info.value)


@pytest.mark.parametrize("bad", ["", 3, ["math"]])
def test_non_string_selectors_are_400(bad):
    with pytest.raises(RoutingError):
        select_model(snapshot(), bad)


def test_no_default_needs_an_explicit_choice():
    routing = {"default_model": None, "route_key_map": {}, "aliases": {}, "policy": "round_robin"}
    with pytest.raises(RoutingError, match="no default model"):
        select_model(snapshot(routing=routing))


@pytest.mark.parametrize("state", ["STARTING", "SLEEPING", "DRAINING", "ONLOADING", "FAILED"])
def test_model_not_ready_is_503(state):
    snap = snapshot(models={"math": model(state=state)})
    with pytest.raises(ModelUnavailable) as info:
        RouteResolver().resolve(snap)
    assert info.value.status == 503 and state in str(info.value)


def test_round_robin_cycles_ready_engines_only():
    engines = [engine(0), engine(1, state="SLEEPING"), engine(2)]
    snap = snapshot(models={"math": model(engines=engines)})
    resolver = RouteResolver()
    picks = [resolver.resolve(snap).engine_id for _ in range(4)]
    assert picks == ["math/0", "math/2", "math/0", "math/2"]


def test_round_robin_ignores_the_routing_key():
    resolver = RouteResolver()
    picks = [resolver.resolve(snapshot(), affinity_key="one-session") for _ in range(4)]
    assert [p.engine_id for p in picks] == ["math/0", "math/1", "math/2", "math/0"]
    assert all(p.routing_key is None for p in picks)


def test_affinity_is_stable_and_spreads_keys():
    snap = snapshot(routing={"default_model": "math", "policy": "affinity"})
    a, b = RouteResolver(), RouteResolver()  # e.g. the gateway and a direct client
    for key in (f"session-{i}" for i in range(30)):
        assert (
            a.resolve(snap, affinity_key=key).engine_id
            == b.resolve(snap, affinity_key=key).engine_id
        )
    chosen = {a.resolve(snap, affinity_key=f"k{i}").engine_id for i in range(60)}
    assert chosen == {"math/0", "math/1", "math/2"}


def test_rendezvous_moves_only_keys_of_a_removed_engine():
    ids = ["e0", "e1", "e2", "e3"]
    before = {k: rendezvous("rollout", "m", k, ids) for k in map(str, range(200))}
    after = {k: rendezvous("rollout", "m", k, ids[:3]) for k in before}
    moved = {k for k in before if before[k] != after[k]}
    assert moved == {k for k in before if before[k] == "e3"}


def test_affinity_policy_requires_the_routing_key():
    routing = {"default_model": "math", "route_key_map": {}, "aliases": {}, "policy": "affinity"}
    snap = snapshot(routing=routing, models={"math": model()})
    with pytest.raises(RoutingError, match="x-smg-routing-key"):
        RouteResolver().resolve(snap)
    assert RouteResolver().resolve(snap, affinity_key="s1").engine_id.startswith("math/")


def router_snapshot(policy: str) -> Discovery:
    rollout = model(
        route_mode="ROUTER",
        router_url="http://127.0.0.1:9000",
        weight_source="TRAINER",
        weight_version="4",
    )
    routing = {"default_model": "math", "policy": policy}
    return snapshot(role="rollout", routing=routing, models={"math": rollout, "code": rollout})


def test_router_mode_targets_the_router():
    target = RouteResolver().resolve(router_snapshot("round_robin"), affinity_key="s1")
    assert target.base_url == "http://127.0.0.1:9000" and target.engine_id is None
    assert target.routing_key is None  # round robin: the router never sees the key


def test_router_mode_passes_the_routing_key_under_affinity():
    snap = router_snapshot("affinity")
    assert RouteResolver().resolve(snap, affinity_key="s1").routing_key == "s1"
    with pytest.raises(RoutingError, match="x-smg-routing-key") as info:
        RouteResolver().resolve(snap)
    assert info.value.status == 400


@pytest.mark.parametrize("policy", ["round_robin", "affinity"])
def test_router_is_started_with_the_routing_policy(policy, tmp_path):
    router = SGLangRouter(
        worker_urls=["http://127.0.0.1:1"], log_path=tmp_path / "r.log", policy=policy
    )
    command = router.command()
    assert command[1:3] == ["-m", "sglang_router.launch_router"]
    parsed = parse_router_args(command[3:])  # the installed router's own parser
    assert parsed.policy == {"round_robin": "round_robin", "affinity": "manual"}[policy]
    if policy == "affinity":
        assert parsed.assignment_mode == "min_group"  # new keys spread over the engines


def test_not_ready_engines_are_never_direct_eligible():
    snap = snapshot(models={"math": model(engines=[engine(0, state="SLEEPING")])})
    assert snap.models["math"].engines[0].direct_eligible is False
    with pytest.raises(ModelUnavailable, match="no ready engine"):
        RouteResolver().resolve(snap)


@pytest.mark.parametrize(
    "change,message",
    [
        ({"extra": 1}, "Extra inputs"),
        ({"schema_version": 1}, "schema_version"),
        ({"models": {"math": model(weight_version="3")}}, "STATIC model publishes no"),
        ({"models": {"math": model(engines=[engine(0), engine(0)])}}, "duplicate engine ids"),
        ({"models": {"math": model(engines=[engine(0, url="ftp://x:1")])}}, "not an http"),
        ({"models": {"math": model(engines=[engine(0, url="http://u:p@h:1")])}}, "credentials"),
        ({"models": {"math": model(engines=[engine(0, url="http://h:1/?q=1")])}}, "query"),
        ({"models": {"math": model(weight_source="TRAINER")}}, "only STATIC"),
        ({"routing": {"default_model": "nope"}}, "unknown models ['nope']"),
    ],
)
def test_discovery_is_validated_strictly(change, message):
    with pytest.raises(ValidationError, match=message.replace("[", r"\[").replace("]", r"\]")):
        snapshot(**change)


def test_a_client_ignores_fields_a_later_gateway_adds_within_the_schema_version():
    document = snapshot().model_dump(mode="json")
    document["added"] = {"any": 1}  # as pool joined schema 2
    document["routing"]["added"] = 1
    document["models"]["math"]["added"] = 1
    document["models"]["code"]["engines"][0]["added"] = 1
    held = {"role": "teacher", "engine_id": "math/9", "ranks": [3], "state": "s", "added": 1}
    document["pool"] = {
        "ranks": [3], "roles": ["teacher"], "free_ranks": [], "engines": [held], "added": 1
    }  # fmt: skip
    read = read_discovery(json.dumps(document))
    assert read.models == snapshot().models and read.pool.engines[0].engine_id == "math/9"
    with pytest.raises(ValidationError, match="Extra inputs"):  # the gateway's own: strict
        Discovery.model_validate(document)
    with pytest.raises(ValidationError, match="schema_version"):  # another version: refused
        read_discovery(json.dumps(document | {"schema_version": 3}))
    with pytest.raises(ValidationError, match="not an http"):  # the known fields: as strictly
        document["models"]["code"]["engines"][0]["base_url"] = "ftp://x:1"
        read_discovery(json.dumps(document))


def test_aliases_may_not_shadow_a_model_id():
    routing = {"default_model": "math", "aliases": {"code": "math"}}
    with pytest.raises(ValidationError, match="shadow"):
        snapshot(routing=routing)


def test_snapshots_are_immutable():
    snap = snapshot()
    with pytest.raises(ValidationError):
        snap.topology_revision = 9
    with pytest.raises(ValidationError):
        snap.models["math"].state = "DEAD"
