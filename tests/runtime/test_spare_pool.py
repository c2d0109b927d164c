"""The shared spare pool (``cluster.spare_ranks``): the plan lays each elastic role's reserved
engines over the pool's ranks, and ``EngineScaler`` lets one role at a time hold them, over a
real plan and real InferenceManagers with the ranks' start and stop commands answered in process
(as ``test_scaling.py``). The real job is ``tests/rl/test_pool_job.py`` (slow)."""

from __future__ import annotations

import json
import threading
from types import SimpleNamespace

import httpx
import pytest
from test_scaling import Ranks, ended

from relax_launch.config import build_config
from relax_launch.config.errors import ConfigError
from relax_launch.inference.config import GatewayConfig
from relax_launch.inference.control_plane import ControlPlane
from relax_launch.inference.discovery import Discovery, RoutingSpec, WeightSource
from relax_launch.inference.engine import EngineHandle
from relax_launch.inference.engine_load import EngineLoad
from relax_launch.inference.gateway import InferenceGateway
from relax_launch.inference.manager import InferenceManager
from relax_launch.inference.scale_routes import ScaleRefused
from relax_launch.inference.serve import GatewayServer
from relax_launch.placement import plan
from relax_launch.placement.config import SpareAutoscaleConfig
from relax_launch.placement.render import summary
from relax_launch.runtime import autoscaler, pool_autoscaler, scaling
from relax_launch.runtime.pool_policy import Move

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


def test_a_pool_engine_wider_than_a_node_takes_whole_nodes_as_the_planners_do() -> None:
    """Two-rank nodes; genrm engines of TP 4 (two nodes each) at ranks 2-5 and on the pool."""
    nodes = {"nproc_per_node": 2, "device": "cpu"}
    wide = {"model": "builtin:tiny-llama", "ranks": 4, "tp_size": 4, "max_engines": 2}
    job = {**JOB, "genrm": {**wide, "engine": ENGINE}, "algorithm": {"n_samples_per_prompt": 2}}
    job.pop("teacher")
    placed = plan(build_config({**job, "cluster": {**nodes, "nnodes": 5, "spare_ranks": 4}}))
    assert [(e.ranks, e.nodes) for e in placed.engines if e.pool] == [((6, 7, 8, 9), (3, 4))]
    # a one-rank teacher after genrm moves the pool's first rank to 7, inside node 3
    off = {**JOB, "genrm": job["genrm"], "cluster": {**nodes, "nnodes": 6, "spare_ranks": 5}}
    with pytest.raises(ConfigError, match="on the spare pool spans 4 ranks from rank 7") as error:
        plan(build_config(off))
    assert "must use whole nodes" in str(error.value)
    assert error.value.fields == ("genrm.tp_size", "cluster.spare_ranks")


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
    monkeypatch.setattr(autoscaler, "engine_load", lambda url, timeout_s: loads.get(url))
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


def test_the_pool_autoscaler_tells_its_policy_only_the_moves_the_scaler_took(scaler, monkeypatch):
    """A give the scaler refused freed no rank: the policy must not count it (it would hold
    the donor back from the pool for one start of its engine)."""
    log = scaler.log_dir / "autoscaler.jsonl"
    auto = pool_autoscaler.PoolAutoscaler(SpareAutoscaleConfig(), scaler, scaler.managers, log)
    assert ended(scaler, scaler.request("genrm", "scale_out", 2))["state"] == "succeeded"
    below = Move("genrm", "scale_in", 0, "for teacher", {"for": "teacher"})  # under its plan
    give = Move("genrm", "scale_in", 1, "for teacher", {"for": "teacher"})
    monkeypatch.setattr(auto.policy, "decide", lambda view: [below, give])
    told: list[tuple[Move, float]] = []
    monkeypatch.setattr(auto.policy, "accepted", lambda move, now: told.append((move, now)))
    refused, taken = auto.tick(auto.view(100.0))
    assert "refused" in refused and "request_id" in taken
    assert told == [(give, 100.0)]


def test_discovery_shows_the_pool_and_who_holds_it_as_the_admin_route_does(scaler) -> None:
    """``GET /{role}/engines`` (public) of every pool role carries the pool: its ranks, the
    free ones and the engine holding the others, from the scaler's one answer that the admin
    route's replicas (and so ``relax-launch top``) read; the document still validates as
    discovery (the direct client parses it)."""
    gateway = InferenceGateway(scaler.managers, config=GatewayConfig(), admin_token="t0ken")
    ControlPlane.scaled_by(SimpleNamespace(server=SimpleNamespace(app=gateway)), scaler)
    server = GatewayServer(gateway, "127.0.0.1", 0)
    server.start()
    try:

        def pool(role: str) -> dict:
            reply = httpx.get(f"{server.url}/{role}/engines", timeout=10)
            Discovery.model_validate_json(reply.text)
            return reply.json()["pool"]

        free = {"ranks": [4], "roles": ["genrm", "teacher"], "free_ranks": [4], "engines": []}
        assert pool("genrm") == pool("teacher") == free
        assert ended(scaler, scaler.request("genrm", "scale_out", 2))["state"] == "succeeded"
        held = {"role": "genrm", "engine_id": "tiny-llama/1", "ranks": [4], "state": "serving"}
        assert pool("teacher") == {**free, "free_ranks": [], "engines": [held]}
        root = httpx.get(f"{server.url}/engines", timeout=10).json()  # every role at once
        assert root["pool"] == pool("genrm") and root["roles"]["genrm"]["pool"] == root["pool"]
        auth = {"authorization": "Bearer t0ken"}
        admin = httpx.get(f"{server.url}/teacher/admin/engines", headers=auth, timeout=10)
        states = [r["state"] for r in admin.json()["replicas"]]
        assert states == ["serving", "spare pool, held by tiny-llama/1 (genrm)"]
    finally:
        server.stop()


def test_the_pool_autoscaler_reads_every_role_at_once_and_no_operation_list(
    scaler, monkeypatch
) -> None:
    """A reading of the pool roles' engines is concurrent and bounded (an engine that does not
    answer costs one bound, not one per engine), and the measured start comes from the scaler's
    index of ended operations, not a scan of the 256 it keeps."""
    loads = {"http://genrm.test:30000": 3.0, "http://teacher.test:30000": 5.0}
    together = threading.Barrier(2, timeout=10.0)  # passes only while both are read at once

    def load_read_with_the_other(url, timeout_s):
        together.wait()
        return EngineLoad(queued=loads[url], running=1, tokens_per_s=0)

    monkeypatch.setattr(autoscaler, "engine_load", load_read_with_the_other)
    auto = pool_autoscaler.PoolAutoscaler(
        SpareAutoscaleConfig(), scaler, scaler.managers, scaler.log_dir / "autoscaler.jsonl"
    )
    view = auto.view(0.0)  # read one after another, neither engine would count (2 s bound)
    assert [(r.role, r.outstanding) for r in view.roles] == [("genrm", 4.0), ("teacher", 6.0)]
    answer, answered = threading.Event(), threading.Event()

    def unanswered(url, timeout_s):
        answer.wait(30)
        answered.set()

    monkeypatch.setattr(autoscaler, "engine_load", unanswered)
    reader = autoscaler.LoadReader(timeout_s=0.5)
    try:  # an engine that has not answered by the bound counts nothing, and is not waited on
        assert reader.read(scaler.managers)["genrm"].queued == 0
        assert not answered.is_set()
    finally:
        answer.set()
        reader.close()

    monkeypatch.setattr(autoscaler, "engine_load", lambda url, timeout_s: None)
    ended(scaler, scaler.request("genrm", "scale_out", 2))
    measured = scaler.succeeded[("genrm", "scale_out")]
    monkeypatch.setattr(scaler, "listed", lambda role, kind: pytest.fail("scanned the list"))
    (genrm, _) = auto.view(1.0).roles
    assert genrm.start_s == measured.finished - measured.started
    auto.close()


def test_the_load_reader_keeps_one_thread_pool_for_its_life_and_ends_it_on_close(
    scaler, monkeypatch
) -> None:
    """Every tick reads on the reader's own threads (none started per tick), and ``close``
    leaves none of them running."""
    threads = set()

    def load(url, timeout_s):
        threads.add(threading.current_thread())
        return EngineLoad(queued=1, running=1, tokens_per_s=0)

    monkeypatch.setattr(autoscaler, "engine_load", load)
    reader = autoscaler.LoadReader(timeout_s=5.0)
    for _ in range(6):
        assert reader.read(scaler.managers)["teacher"].queued == 1
    assert len(threads) <= 2  # two engines: a pool per tick would have made up to 12 threads
    reader.close()
    assert not any(thread.is_alive() for thread in threads)
