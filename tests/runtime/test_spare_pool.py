"""The shared spare pool (``cluster.spare_ranks``): the plan lays each elastic role's reserved
engines over the pool's ranks, and ``EngineScaler`` lets one role at a time hold them, over a
real plan and real InferenceManagers with the ranks' start and stop commands answered in process
(as ``test_scaling.py``). The real job is ``tests/rl/test_pool_job.py`` (slow)."""

from __future__ import annotations

import json
import threading

import pytest
from test_scaling import Ranks, ended

from relax_launch.config import build_config
from relax_launch.config.errors import ConfigError
from relax_launch.inference.discovery import RoutingSpec, WeightSource
from relax_launch.inference.engine import EngineHandle
from relax_launch.inference.engine_load import EngineLoad
from relax_launch.inference.manager import InferenceManager
from relax_launch.inference.scale_routes import ScaleRefused
from relax_launch.placement import plan
from relax_launch.placement.config import SpareAutoscaleConfig
from relax_launch.placement.render import summary
from relax_launch.runtime import pool_autoscaler, scaling

ENGINE = {"max_total_tokens": 2048}
JOB = {
    "cluster": {"nnodes": 1, "nproc_per_node": 5, "device": "cpu", "spare_ranks": 1},
    "trainer": {"model": "builtin:tiny-llama", "ranks": 1},
    "rollout": {"ranks": 1, "engine": {"max_total_tokens": 2048}},
    "genrm": {"model": "builtin:tiny-llama", "ranks": 1, "max_engines": 2, "engine": ENGINE},
    "teacher": {"model": "builtin:tiny-llama", "ranks": 1, "max_engines": 3, "engine": ENGINE},
    "reward": {"sources": [{"name": "judge", "genrm": True}]},
    "algorithm": {"n_samples_per_prompt": 2, "distill_coef": 0.1},
    "data": {"prompts_per_step": 2},
}


def test_the_plan_lays_every_elastic_roles_reserved_engines_over_the_pool() -> None:
    placed = plan(build_config(JOB))
    pool = [(e.role, e.index, e.ranks) for e in placed.engines if e.pool]
    # teacher.max_engines=3 asks for 2 more, the one-rank pool holds 1; no role reserves its own
    assert pool == [("genrm", 1, (4,)), ("teacher", 1, (4,))]
    assert [e.ranks for e in placed.engines if not e.pool] == [(1,), (2,), (3,)]
    assert {a.role for a in placed.ranks[4].assignments} == {"genrm", "teacher"}
    assert "spare pool: ranks 4, for no role; on scale-out genrm engine 1, teacher engine 1" in (
        summary(placed)
    )


@pytest.mark.parametrize(
    ("change", "fields"),
    [
        ({"genrm": {"max_engines": 1}, "teacher": {"max_engines": 1}}, ("cluster.spare_ranks",)),
        ({"genrm": {"tp_size": 2, "ranks": 2}}, ("cluster.spare_ranks", "genrm.max_engines")),
        ({"cluster": {"spare_ranks": 0, "spare_autoscale": {}}}, ("cluster.spare_autoscale",)),
        (
            {"cluster": {"spare_autoscale": {}}, "teacher": {"autoscale": {}}},
            ("teacher.autoscale", "cluster.spare_autoscale"),
        ),
    ],
)
def test_a_pool_that_cannot_work_is_refused_naming_its_fields(change, fields) -> None:
    job = {k: dict(v) if isinstance(v, dict) else v for k, v in JOB.items()}
    for section, values in change.items():
        job[section] = {**job.get(section, {}), **values}
    with pytest.raises(ConfigError) as error:
        plan(build_config(job))
    assert error.value.fields[: len(fields)] == fields, error.value


def manager(role: str) -> InferenceManager:
    made = InferenceManager(
        role=role,
        model_id="tiny-llama",
        served_model_name="/models/tiny-llama",
        weight_source=WeightSource.STATIC,
        routing=RoutingSpec(default_model="tiny-llama"),
        elastic=True,
    )
    url = f"http://{role}.test:30000"
    made.attach([EngineHandle("tiny-llama/0", url, role, True, index=0)])
    return made


@pytest.fixture
def scaler(tmp_path, monkeypatch):
    monkeypatch.setattr(scaling, "get_json", lambda url, path, timeout_s: {})  # healthy
    monkeypatch.setattr(scaling, "idle", lambda url: True)
    made = scaling.EngineScaler(
        plan=plan(build_config(JOB)),
        managers={"genrm": manager("genrm"), "teacher": manager("teacher")},
        call=Ranks(),
        startup_timeout_s=30,
        drain_timeout_s=30,
        sync_lock=threading.Lock(),
        log_dir=tmp_path,
    )
    yield made
    made.close()


def test_one_role_at_a_time_holds_the_pools_ranks_and_gives_them_back(scaler) -> None:
    assert scaler.bounds("teacher") == (1, 2)  # max_engines 3, capped by the pool
    assert ended(scaler, scaler.request("genrm", "scale_out", 2))["state"] == "succeeded"
    with pytest.raises(ScaleRefused) as refused:
        scaler.request("teacher", "scale_out", 2)
    assert refused.value.status == 409
    assert "held by tiny-llama/1 (genrm); scale that role in first" in str(refused.value)
    (pool,) = [r for r in scaler.replicas("teacher") if r["pool"]]
    assert pool["state"] == "spare pool, held by tiny-llama/1 (genrm)"
    assert [r["state"] for r in scaler.replicas("genrm")] == ["serving", "serving"]

    assert ended(scaler, scaler.request("genrm", "scale_in", 1))["state"] == "succeeded"
    assert [r["state"] for r in scaler.replicas("teacher")] == ["serving", "spare pool"]
    doc = ended(scaler, scaler.request("teacher", "scale_out", 2))
    assert doc["state"] == "succeeded" and doc["actual"] == 2, doc
    held = [r["state"] for r in scaler.replicas("genrm")]
    assert held == ["serving", "spare pool, held by tiny-llama/1 (teacher)"]


def test_the_pool_autoscaler_moves_the_spare_to_a_burst_and_logs_why(scaler, monkeypatch):
    """The shell reads the roles (the engines' own load, the answered counts), asks the scaler
    for the policy's move and writes it, with what it saw, to autoscaler.jsonl."""
    loads = {"http://genrm.test:30000": EngineLoad(queued=20, running=4, tokens_per_s=0)}
    monkeypatch.setattr(pool_autoscaler, "engine_load", lambda url: loads.get(url))
    log = scaler.log_dir / "autoscaler.jsonl"
    config = SpareAutoscaleConfig(min_gain_s=1, hold_s=0, start_estimate_s=1)
    auto = pool_autoscaler.PoolAutoscaler(config, scaler, scaler.managers, log)
    genrm = scaler.managers["genrm"]
    assert auto.tick(auto.view(100.0)) == []  # no throughput read yet
    for _ in range(10):  # 10 answered in 5 s on one engine: 2 requests/s
        with genrm.requests.track("tiny-llama/0"):
            pass
    (record,) = auto.tick(auto.view(105.0))
    assert (record["role"], record["decision"], record["from"], record["to"]) == (
        "genrm",
        "scale_out",
        1,
        2,
    )
    assert "24 requests left at 2.00 requests/s per engine" in record["reason"]
    assert record["waiting_on"] == "genrm" and record["roles"]["genrm"]["outstanding"] == 24
    assert ended(scaler, scaler.get("genrm", "scale_out", record["request_id"]))["actual"] == 2
    assert json.loads(log.read_text())["request_id"] == record["request_id"]
    assert auto.metrics() == {
        "pool/autoscale_decisions": 1.0,
        "pool/free_ranks": 0.0,
        "genrm/pool_engines": 1.0,
        "teacher/pool_engines": 0.0,
    }
