"""Several models behind one role (``{role}.models``): the config that lists them, the plan that
places each model's engines, discovery listing them, and the gateway's and the controller's
routing by ``model`` and ``route_key`` to each model's engines (engines: the scripted upstream,
whose request paths say which engine was reached)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from harness.prometheus_text import total

from relax_launch.config import build_config
from relax_launch.config.errors import ConfigError
from relax_launch.inference.config import GatewayConfig, GenRMConfig, RolloutConfig, TeacherConfig
from relax_launch.inference.control_plane import ControlPlane, ModelSpec, RoleSpec
from relax_launch.placement import plan
from relax_launch.placement.memory_plan import memory_plan
from relax_launch.placement.preflight import preflight
from relax_launch.placement.render import table
from relax_launch.rl import rollout
from relax_launch.runtime.engines import engine_worker

MODEL = "builtin:tiny-llama"
SCORE = {"input_ids": [1, 5, 9], "sampling_params": {"max_new_tokens": 1}}


def two_models(cls: type = TeacherConfig, **more) -> TeacherConfig:
    second = {"model": MODEL, "model_id": "beta", "aliases": ["b"], "route_keys": ["code"]}
    return cls(
        model=MODEL,
        model_id="alpha",
        route_keys=("math",),
        engine={"max_total_tokens": 512},
        models=[{**second, **more}],
    )


def test_a_role_lists_further_models_each_with_its_engines():
    teacher = two_models(ranks=2, tp_size=2, engine={"max_total_tokens": 1024})
    default, beta = teacher.model_sections()
    assert teacher.total_ranks == 3 and default.models == () and default.model_id == "alpha"
    assert (beta.model_id, beta.ranks, beta.tp_size, beta.route_keys) == ("beta", 2, 2, ("code",))
    assert beta.engine == {"max_total_tokens": 1024}  # its own arguments over the role's
    assert TeacherConfig(model=MODEL).model_sections() == (TeacherConfig(model=MODEL),)


@pytest.mark.parametrize(
    "change,words",
    [
        ({"model_id": "alpha"}, "share model ids and aliases ('alpha' in model, models[0])"),
        ({"aliases": ["alpha"]}, "share model ids and aliases"),
        ({"route_keys": ["math"]}, "share route_keys ('math' in route_keys"),
        ({"engine": {"tp_size": 2}}, "set by the placement planner"),
    ],
)
def test_models_that_requests_could_not_tell_apart_are_refused(change, words):
    with pytest.raises(ValueError, match=re.escape(words)):
        two_models(**change)


def test_rollout_and_elastic_roles_refuse_several_models():
    with pytest.raises(ValueError, match="rollout serves one model: the policy"):
        RolloutConfig(models=[{"model": MODEL}])
    with pytest.raises(ValueError, match="models with max_engines"):
        TeacherConfig(model=MODEL, max_engines=2, models=[{"model": MODEL, "model_id": "b"}])


def job(teacher_models: list[dict], world: int = 5):
    return build_config(
        {
            "cluster": {"nnodes": 1, "nproc_per_node": world, "device": "cpu"},
            "trainer": {"model": MODEL, "ranks": 1},
            "rollout": {"ranks": 1, "engine": {"max_total_tokens": 512}},
            "teacher": {
                "model": MODEL,
                "model_id": "alpha",
                "engine": {"max_total_tokens": 512},
                "models": teacher_models,
            },
            "algorithm": {"n_samples_per_prompt": 2, "distill_coef": 0.1},
            "data": {"prompts_per_step": 2},
        }
    )


def test_the_planner_places_each_models_engines_and_the_memory_plan_sums_them():
    config = job(
        [{"model": MODEL, "model_id": "beta", "ranks": 2, "engine": {"max_total_tokens": 2048}}]
    )
    placed = plan(config)
    teachers = [(e.index, e.ranks, e.model, e.label) for e in placed.engines_of("teacher")]
    assert teachers == [
        (0, (2,), 0, "teacher engine 0"),
        (1, (3,), 1, "teacher engine 1 (models[0])"),
        (2, (4,), 1, "teacher engine 2 (models[0])"),
    ]
    assert "teacher[e2 head models[0]]" in table(placed)
    kv = {e.label: e.kv_tokens for e in memory_plan(config, placed).engines}
    assert kv["teacher engine 0"] == 512 and kv["teacher engine 2 (models[0])"] == 2048
    with pytest.raises(ConfigError, match=r"teacher.models\[0\].ranks=2\)") as refused:
        plan(job([{"model": MODEL, "model_id": "beta", "ranks": 2}], world=4))
    assert "teacher.ranks=1 + teacher.models[0].ranks=2" in str(refused.value)


def test_preflight_checks_each_model_by_its_own_field(tmp_path):
    config = job([{"model": str(tmp_path / "absent"), "model_id": "beta"}], world=4)
    with pytest.raises(ConfigError, match=r"teacher.models\[0\].model="):
        preflight(config, plan(config))


@pytest.fixture
def plane(upstream, tiny_model: Path, tmp_path: Path) -> Iterator[ControlPlane]:
    """A teacher (alpha on engine 0, beta on engine 1) and a genrm (style on engine 0, facts
    on engine 1), their engines the upstream's /t0, /t1, /g0, /g1."""
    teacher, genrm = two_models(), two_models(GenRMConfig, model_id="facts", route_keys=["facts"])
    genrm = genrm.model_copy(update={"model_id": "style", "route_keys": ("style",)})
    specs = [
        RoleSpec(
            r,
            MODEL,
            tiny_model,
            s,
            "serving",
            more=(ModelSpec(s.model_sections()[1], tiny_model, (1,)),),
        )
        for r, s in (("teacher", teacher), ("genrm", genrm))
    ]
    control = ControlPlane(specs, gateway=GatewayConfig(), admin_token=None, log_dir=tmp_path)
    control.start()
    for role, prefix in (("teacher", "t"), ("genrm", "g")):
        control.attach(role, [f"{upstream.url}/{prefix}0", f"{upstream.url}/{prefix}1"], 10)
    try:
        yield control
    finally:
        control.close()


def test_discovery_lists_each_model_with_its_own_engines(plane):
    found = httpx.get(f"{plane.url}/teacher/engines").json()
    engines = {m: [e["engine_id"] for e in r["engines"]] for m, r in found["models"].items()}
    assert engines == {"alpha": ["alpha/0"], "beta": ["beta/1"]}
    assert found["routing"]["default_model"] == "alpha"
    assert found["routing"]["route_key_map"] == {"math": "alpha", "code": "beta"}
    assert found["routing"]["aliases"] == {"b": "beta"}  # the shared reference names neither
    assert all(r["state"] == "READY" for r in found["models"].values())
    health = httpx.get(f"{plane.url}/teacher/health").json()
    assert health["models"] == {m: {"state": "READY", "ready": True} for m in ("alpha", "beta")}
    listed = httpx.get(f"{plane.url}/teacher/v1/models").json()["data"]
    assert [m["id"] for m in listed] == ["alpha", "beta", "b"]


def test_the_gateway_routes_by_model_alias_and_route_key(plane, upstream):
    for choice, engine in [
        ({"model": "beta"}, "/t1"),
        ({"model": "b"}, "/t1"),
        ({"route_key": "code"}, "/t1"),
        ({"route_key": "math"}, "/t0"),
        ({}, "/t0"),  # the default model
    ]:
        upstream.reset()
        reply = httpx.post(f"{plane.url}/teacher/generate", json={**SCORE, **choice})
        assert reply.status_code == 200, reply.text
        assert [r["path"] for r in upstream.requests] == [f"{engine}/generate"], choice
    upstream.reset()
    unknown = httpx.post(f"{plane.url}/teacher/generate", json={**SCORE, "model": "gamma"})
    assert unknown.status_code == 400 and upstream.requests == []
    assert unknown.json()["error"]["message"] == (
        "teacher serves no model 'gamma'; known: ['alpha', 'b', 'beta']"
    )


def test_the_controller_routes_as_the_gateway_and_judges_by_reward_source(plane, upstream):
    client = plane.engines.client("teacher")
    upstream.reset()
    for choice in ({"model": "beta"}, {"route_key": "math"}, {}):
        plane.engines.run(client.request("/generate", {**SCORE, **choice}), "one request")
    assert [r["path"] for r in upstream.requests] == [
        "/t1/generate",
        "/t0/generate",
        "/t0/generate",
    ]
    conversation = [[{"role": "user", "content": "2+2=4?"}]]
    for source, engine in (("facts", "/g1"), ("style", "/g0"), ("other", "/g0")):
        upstream.reset()
        replies = rollout.judge(plane.engines, conversation, "[0-9]", source, max_tokens=2)
        assert replies == ["judged: 7"] and [r["path"] for r in upstream.requests] == [
            f"{engine}/generate"
        ]
    metrics = httpx.get(f"{plane.url}/metrics").text
    answered = {
        e: total(metrics, "relax_engine_requests_answered", engine=e)
        for e in ("alpha/0", "beta/1", "style/0", "facts/1")
    }
    assert answered == {"alpha/0": 2, "beta/1": 1, "style/0": 2, "facts/1": 1}
    assert total(metrics, "relax_model_ready", role="genrm", model="facts") == 1


def test_each_models_engines_start_that_model_with_its_own_arguments():
    further = {
        "model": "builtin:tiny-qwen2",
        "model_id": "beta",
        "engine": {"max_total_tokens": 2048},
    }
    config = job([further], world=4)
    placed = plan(config)
    started = [
        engine_worker(config, placed, e.ranks[0], e, node_rank=0, rendezvous=None)
        for e in placed.engines_of("teacher")
    ]
    assert [
        (Path(w.server.model_path).name, w.server.engine["max_total_tokens"]) for w in started
    ] == [
        ("tiny-llama", 512),
        ("tiny-qwen2", 2048),
    ]
