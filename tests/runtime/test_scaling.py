"""EngineScaler (rank 0's scale operations) and Autoscaler (its decisions): this module's logic
over a real plan and a real InferenceManager, with the ranks' start and stop commands answered
in process and the engines' HTTP replaced; the real job is in tests/rl/test_elastic_job.py and
tests/runtime/test_elastic_rollout.py."""

from __future__ import annotations

import json
import threading
import time

import pytest

from relax_launch.config import build_config
from relax_launch.deadline import wait_until
from relax_launch.inference.discovery import RoutingSpec, State, WeightSource
from relax_launch.inference.engine import EngineHandle
from relax_launch.inference.engine_load import EngineLoad, parse_load
from relax_launch.inference.manager import InferenceManager
from relax_launch.inference.scale_routes import ScaleRefused
from relax_launch.placement import plan
from relax_launch.runtime import scaling
from relax_launch.runtime.autoscale_policy import Load
from relax_launch.runtime.autoscaler import LoadAutoscaler
from relax_launch.runtime.control import RemoteError
from relax_launch.runtime.rank_commands import StartEngine, StopEngine

JOB = {
    "cluster": {"nnodes": 1, "nproc_per_node": 5, "device": "cpu"},
    "trainer": {"model": "builtin:tiny-llama", "ranks": 1},
    "rollout": {"ranks": 1, "engine": {"max_total_tokens": 2048}},
    "genrm": {
        "model": "builtin:tiny-llama",
        "ranks": 1,
        "max_engines": 3,
        "engine": {"max_total_tokens": 2048},
    },
    "reward": {"sources": [{"name": "judge", "genrm": True}]},
    "algorithm": {"n_samples_per_prompt": 2},
    "data": {"prompts_per_step": 2},
}


class Ranks:
    """Answers StartEngine and StopEngine as the engines' head ranks would; ``fail`` holds
    the indices whose start fails, ``gate`` (when set) holds every start until it is set."""

    def __init__(self) -> None:
        self.commands: list[object] = []
        self.fail: set[int] = set()
        self.gate: threading.Event | None = None

    def __call__(self, command, ranks, timeout_s):
        self.commands.append(command)
        if isinstance(command, StartEngine):
            if self.gate is not None:
                self.gate.wait(60)  # a bound against a hang: the test sets it
            if command.index in self.fail:
                raise RemoteError(f"command #1 'engine.start' failed on rank {ranks[0]}: boom")
            return {ranks[0]: f"http://10.0.0.{command.index}:30000"}
        return {ranks[0]: None}


def genrm_manager() -> InferenceManager:
    manager = InferenceManager(
        role="genrm",
        model_id="tiny-llama",
        served_model_name="/models/tiny-llama",
        weight_source=WeightSource.STATIC,
        routing=RoutingSpec(default_model="tiny-llama", aliases={"judge": "tiny-llama"}),
        elastic=True,
    )
    manager.attach([EngineHandle("tiny-llama/0", "http://10.0.0.0:30000", "genrm", True, index=0)])
    return manager


class WaitedLock:
    """The scaler's sync lock: ``waited`` is set once the scaler waits for it, held by the
    test (as ``lock``, which records nothing)."""

    def __init__(self) -> None:
        self.lock, self.waited = threading.Lock(), threading.Event()

    def __enter__(self) -> None:
        if not self.lock.acquire(blocking=False):
            self.waited.set()
            assert self.lock.acquire(timeout=60)  # a bound against a hang: the test releases it

    def __exit__(self, *exc) -> None:
        self.lock.release()


def rollout_scaler(tmp_path, monkeypatch, sync_lock=None):
    """A scaler of a rollout role with one planned engine serving synced weights and one
    reserved, its ranks' commands answered in process."""
    monkeypatch.setattr(scaling, "get_json", lambda url, path, timeout_s: {})
    monkeypatch.setattr(scaling, "POLL_S", 0.02)
    job = {**JOB, "rollout": {"ranks": 1, "max_engines": 2, "engine": {"max_total_tokens": 2048}}}
    job["genrm"] = {**JOB["genrm"], "max_engines": 2}
    manager = InferenceManager(
        role="rollout",
        model_id="tiny-llama",
        served_model_name="/models/tiny-llama",
        weight_source=WeightSource.TRAINER,
        routing=RoutingSpec(default_model="tiny-llama"),
        elastic=True,
    )
    manager.attach(
        [EngineHandle("tiny-llama/0", "http://10.0.0.0:30000", "rollout", False, index=0)]
    )
    manager.weights_valid = True  # the first sync has committed
    ranks = Ranks()
    made = scaling.EngineScaler(
        plan=plan(build_config(job)),
        managers={"rollout": manager},
        call=ranks,
        startup_timeout_s=30,
        drain_timeout_s=30,
        sync_lock=sync_lock or threading.Lock(),
        log_dir=tmp_path,
    )
    made.ranks, made.manager = ranks, manager
    return made


@pytest.fixture
def scaler(tmp_path, monkeypatch):
    monkeypatch.setattr(scaling, "get_json", lambda url, path, timeout_s: {})  # healthy
    monkeypatch.setattr(scaling, "idle", lambda url: True)  # the engines report no load
    manager, ranks = genrm_manager(), Ranks()
    made = scaling.EngineScaler(
        plan=plan(build_config(JOB)),
        managers={"genrm": manager},
        call=ranks,
        startup_timeout_s=30,
        drain_timeout_s=30,
        sync_lock=threading.Lock(),
        log_dir=tmp_path,
    )
    made.ranks, made.manager = ranks, manager
    return made


def ended(scaler, op, timeout_s: float = 60.0):  # a bound against a hang only
    deadline = time.monotonic() + timeout_s
    while op.state in ("running", "cancelling"):
        assert time.monotonic() < deadline, op
        time.sleep(0.01)
    return op.document(scaler.actual(op.role))


def replica_states(scaler, op) -> list[str]:
    return [r["state"] for r in op.document(scaler.actual(op.role))["replicas"]]


def routed(manager) -> list[str]:
    return [e.engine_id for e in manager.snapshot().models["tiny-llama"].engines]


def test_scale_out_starts_the_reserved_engines_and_routes_them_once_healthy(scaler):
    op = scaler.request("genrm", "scale_out", 3)
    doc = ended(scaler, op)
    assert doc["state"] == "succeeded" and (doc["from"], doc["target"], doc["actual"]) == (1, 3, 3)
    assert [(r["index"], r["state"]) for r in doc["replicas"]] == [(1, "serving"), (2, "serving")]
    assert routed(scaler.manager) == ["tiny-llama/0", "tiny-llama/1", "tiny-llama/2"]
    assert [c.index for c in scaler.ranks.commands] == [1, 2]
    states = [r["state"] for r in scaler.replicas("genrm")]
    assert states == ["serving"] * 3
    logged = [json.loads(line) for line in (scaler.log_dir / "scaling.jsonl").open()]
    assert logged[0]["request_id"] == op.request_id and logged[0]["state"] == "succeeded"
    assert scaler.metrics() == {"genrm/engines": 3.0, "genrm/scale_operations": 1.0}


def test_a_failed_start_leaves_the_count_and_stops_the_engines_that_started(scaler):
    scaler.ranks.fail = {2}
    doc = ended(scaler, scaler.request("genrm", "scale_out", 3))
    assert doc["state"] == "failed" and doc["actual"] == 1, doc
    assert "1 of 2 engines failed to start, so none was added" in doc["error"]
    assert "engine 2: RemoteError" in doc["error"] and "genrm keeps 1 engines" in doc["error"]
    assert routed(scaler.manager) == ["tiny-llama/0"]
    stopped = [c.index for c in scaler.ranks.commands if isinstance(c, StopEngine)]
    assert stopped == [1, 2]  # the one that started, and the failed one (whatever it left)
    assert [r["state"] for r in doc["replicas"]] == ["stopped", "failed"]
    assert [r["state"] for r in scaler.replicas("genrm")] == ["serving", "reserved", "reserved"]


def test_actual_counts_serving_engines_and_a_cancel_stops_the_started_ones(scaler):
    """RFC #351's cancel: the 202 of a scale-out answers the engines serving (1), not the
    target; a cancel while the starts are under way lets them end, stops every engine they
    started by its head rank, and the count is as before."""
    scaler.ranks.gate = threading.Event()
    op = scaler.request("genrm", "scale_out", 3)
    assert wait_until(lambda: replica_states(scaler, op) == ["starting"] * 2, 60)
    doc = op.document(scaler.actual("genrm"))
    assert (doc["actual"], doc["target"]) == (1, 3) and scaler.count("genrm") == 3
    assert [r["state"] for r in doc["replicas"]] == ["starting", "starting"]
    assert scaler.cancel("genrm", op.request_id).state == "cancelling"
    assert scaler.cancel("genrm", op.request_id) is op  # asking again changes nothing
    scaler.ranks.gate.set()
    doc = ended(scaler, op)
    assert doc["state"] == "cancelled" and doc["actual"] == 1 and scaler.count("genrm") == 1
    assert "genrm keeps 1" in doc["error"]
    assert [r["state"] for r in doc["replicas"]] == ["stopped", "stopped"]
    assert sorted(c.index for c in scaler.ranks.commands if isinstance(c, StopEngine)) == [1, 2]
    assert routed(scaler.manager) == ["tiny-llama/0"]
    for wrong, status in ((op.request_id, 409), ("nope", 404)):
        with pytest.raises(ScaleRefused) as refused:
            scaler.cancel("genrm", wrong)
        assert refused.value.status == status
    scaler.ranks.gate = None
    done = ended(scaler, scaler.request("genrm", "scale_out", 2))
    assert done["state"] == "succeeded" and done["actual"] == 2
    assert [o.state for o in scaler.listed("genrm", "scale_out")] == ["succeeded", "cancelled"]
    assert scaler.listed("genrm", "scale_in") == []


REFUSALS = {
    "above max_engines": ("scale_out", 4, {}, 400, "outside 1 (the planned engines) to 3"),
    "below the planned engines": ("scale_in", 0, {}, 400, "outside 1 (the planned engines)"),
    "the count it has": ("scale_out", 1, {}, 409, "genrm has 1 engines already"),
    "the wrong way": ("scale_in", 2, {}, 400, "goes the wrong way; use scale_out"),
    "an unknown model": ("scale_out", 2, {"model": "other"}, 400, "serves no model 'other'"),
    "a timeout of 0": ("scale_out", 2, {"timeout_s": 0}, 400, "timeout_secs must be above 0"),
}


@pytest.mark.parametrize("kind,target,extra,status,message", REFUSALS.values(), ids=REFUSALS)
def test_refusals_change_nothing(scaler, kind, target, extra, status, message):
    with pytest.raises(ScaleRefused) as refused:
        scaler.request("genrm", kind, target, **extra)
    assert refused.value.status == status and message in str(refused.value)
    assert scaler.count("genrm") == 1 and not scaler.ranks.commands
    assert scaler.request("genrm", "scale_out", 2, model="judge")  # an alias is the model


def test_one_operation_at_a_time_and_none_while_the_role_does_not_serve(scaler):
    scaler.ranks.gate = threading.Event()
    op = scaler.request("genrm", "scale_out", 2)
    for kind, target in (("scale_out", 2), ("scale_out", 3), ("scale_in", 1)):
        with pytest.raises(ScaleRefused) as refused:
            scaler.request("genrm", kind, target)
        assert refused.value.status == 409 and op.request_id in str(refused.value)
    assert scaler.scaling("genrm")["operation"]["state"] == "running"
    scaler.ranks.gate.set()
    ended(scaler, op)
    scaler.manager.state = State.FAILED
    with pytest.raises(ScaleRefused, match="is FAILED .* onload it first") as refused:
        scaler.request("genrm", "scale_out", 3)
    assert refused.value.status == 409
    scaler.manager.state = State.SLEEPING
    with pytest.raises(ScaleRefused, match="is SLEEPING, not serving yet"):
        scaler.request("genrm", "scale_out", 3)
    scaler.manager.state = State.READY
    scaler.close()
    with pytest.raises(ScaleRefused, match="the job is stopping"):
        scaler.request("genrm", "scale_out", 3)


def test_scale_in_waits_for_the_requests_in_flight_then_stops_the_newest(scaler):
    ended(scaler, scaler.request("genrm", "scale_out", 3))
    manager = scaler.manager
    release = threading.Event()

    def request_on(engine_id: str) -> None:
        with manager.requests.track(engine_id):
            release.wait(60)  # a bound against a hang: the test sets it

    thread = threading.Thread(target=request_on, args=("tiny-llama/2",))
    thread.start()
    op = scaler.request("genrm", "scale_in", 2)
    assert wait_until(lambda: scaler.replicas("genrm")[2]["state"] == "draining", 60)
    assert op.state == "running" and routed(manager) == ["tiny-llama/0", "tiny-llama/1"]
    assert [r["state"] for r in scaler.replicas("genrm")][2] == "draining"
    assert not any(isinstance(c, StopEngine) for c in scaler.ranks.commands)  # still draining
    assert manager.was_retired("http://10.0.0.2:30000/generate")
    release.set()
    thread.join()
    doc = ended(scaler, op)
    assert doc["state"] == "succeeded" and doc["actual"] == 2
    assert doc["replicas"] == [
        {**doc["replicas"][0], "index": 2, "state": "stopped", "rerouted": 0}
    ]  # fmt: skip
    assert [c.index for c in scaler.ranks.commands if isinstance(c, StopEngine)] == [2]
    assert manager.requests.answered("tiny-llama/2") == 1
    # gone from the manager, still known as scaled in: a late failure there is sent elsewhere
    assert [e.index for e in manager.engines] == [0, 1]
    assert manager.was_retired("http://10.0.0.2:30000/generate")


def test_scale_in_stops_at_its_bound_with_requests_left_for_other_engines(scaler):
    ended(scaler, scaler.request("genrm", "scale_out", 2))
    with scaler.manager.requests.track("tiny-llama/1"):
        doc = ended(scaler, scaler.request("genrm", "scale_in", 1, timeout_s=0.3))
    assert doc["state"] == "succeeded" and doc["replicas"][0]["rerouted"] == 1, doc


class FakeScaler:
    def __init__(self, count: int = 1) -> None:
        self.engines, self.active, self.ended, self.asked = count, {}, {}, []

    def count(self, role: str) -> int:
        return self.engines

    def request(self, role, kind, target, source):
        self.asked.append((kind, target, source))
        if target > 3:
            raise ScaleRefused(400, "outside")
        return type("Op", (), {"request_id": f"op{len(self.asked)}"})()


def autoscaler(tmp_path, fake: FakeScaler, **config) -> LoadAutoscaler:
    from relax_launch.inference.config import AutoscaleConfig

    settings = {"scale_up_window_s": 2, "scale_down_window_s": 5, "cooldown_s": 3} | config
    return LoadAutoscaler(
        "genrm", AutoscaleConfig(**settings), (1, 3), fake, genrm_manager(),
        tmp_path / "autoscaler.jsonl",
    )  # fmt: skip


def test_the_autoscaler_scales_out_after_its_window_and_clamps_to_its_bounds(tmp_path):
    fake = FakeScaler(1)
    scale = autoscaler(tmp_path, fake, target_queue_per_engine=4)
    busy = Load(queued=6, running=4, in_flight=3)  # 10 requests: 3 engines wanted
    assert scale.tick(busy, 100.0) is None and scale.policy.wanted == 3
    assert scale.tick(busy, 101.9) is None  # within the up window
    decision = scale.tick(busy, 102.0)
    assert decision["decision"] == "scale_out" and (decision["from"], decision["to"]) == (1, 3)
    assert decision["request_id"] == "op1" and fake.asked == [("scale_out", 3, "autoscaler")]
    assert scale.tick(Load(0, 0, 40), 200.0) is None and scale.policy.wanted == 3  # at most 3
    logged = [json.loads(line) for line in (tmp_path / "autoscaler.jsonl").open()]
    assert logged == [decision]
    assert scale.metrics() == {"genrm/autoscale_decisions": 1.0, "genrm/autoscale_wanted": 3.0}


def test_the_autoscaler_waits_out_operations_cooldowns_and_a_changing_mind(tmp_path):
    fake = FakeScaler(3)
    scale = autoscaler(tmp_path, fake)
    quiet = Load(0, 0, 0)
    fake.active = {"genrm": object()}  # an operation runs: nothing decided, windows reset
    assert scale.tick(quiet, 0.0) is None and scale.policy.since is None
    fake.active, fake.ended = {}, {"genrm": 10.0}
    assert scale.tick(quiet, 12.0) is None and scale.policy.since is None  # cooling down until 13
    assert scale.tick(quiet, 13.0) is None and scale.policy.since == ("scale_in", 13.0)
    assert scale.tick(Load(0, 0, 9), 15.0) is None and scale.policy.since is None  # wants 3 again
    assert scale.tick(quiet, 16.0) is None
    assert scale.tick(quiet, 20.9) is None
    decision = scale.tick(quiet, 21.0)  # 5 s of wanting 1 (the planned count, at least)
    assert (decision["decision"], decision["to"]) == ("scale_in", 1)


def test_a_refused_decision_is_logged_with_why(tmp_path):
    fake = FakeScaler(1)
    scale = autoscaler(tmp_path, fake, scale_up_window_s=0)
    scale.policy.bounds = (1, 5)
    decision = scale.tick(Load(0, 0, 100), 0.0)
    assert decision["refused"] == "outside" and "request_id" not in decision


def test_an_engines_load_is_read_from_its_loads_document():
    document = {
        "loads": [
            {"num_waiting_reqs": 3, "num_running_reqs": 5, "gen_throughput": 120.5},
            {"num_waiting_reqs": 1, "num_running_reqs": 0, "gen_throughput": 10.0},
        ]
    }
    assert parse_load(document) == EngineLoad(queued=4, running=5, tokens_per_s=130.5)
    assert parse_load({}) == EngineLoad(0, 0, 0)


def test_an_engine_that_starts_but_fails_its_health_check_is_stopped_and_never_routed(
    scaler, monkeypatch
):
    from relax_launch.inference.engine import EngineRequestError

    def unhealthy(url, path, timeout_s):
        raise EngineRequestError(f"GET {url}{path}: HTTP 503")

    monkeypatch.setattr(scaling, "get_json", unhealthy)
    doc = ended(scaler, scaler.request("genrm", "scale_out", 2))
    assert doc["state"] == "failed" and "HTTP 503" in doc["error"] and doc["actual"] == 1
    assert routed(scaler.manager) == ["tiny-llama/0"]
    assert [c.index for c in scaler.ranks.commands if isinstance(c, StopEngine)] == [1]


def test_closing_lets_the_operation_in_flight_end_first(scaler):
    scaler.ranks.gate = threading.Event()  # the head rank is starting the engine
    op = scaler.request("genrm", "scale_out", 2)
    threading.Timer(0.5, scaler.ranks.gate.set).start()
    scaler.close()  # the job stops: its ranks take the stop once the start has ended
    assert op.state == "succeeded" and op.finished is not None


def test_a_rollout_scale_out_that_times_out_stops_its_engine_only_between_syncs(
    tmp_path, monkeypatch
):
    """A scaled-out rollout engine is routed once a sync commits on it; when none does in time,
    the engine is stopped again, but never while a sync runs (it may have admitted the engine:
    stopping it there failed the sync, and its repair looked the engine up: a KeyError)."""
    sync_lock = WaitedLock()
    scaler = rollout_scaler(tmp_path, monkeypatch, sync_lock)
    ranks = scaler.ranks

    def stops() -> list[StopEngine]:
        return [c for c in ranks.commands if isinstance(c, StopEngine)]

    op = scaler.request("rollout", "scale_out", 2, timeout_s=5.0)
    # added as joining: a weight sync begins and holds the lock until the scale-out, its
    # deadline passed, waits for it to stop the engine (or stops it anyway: the defect)
    assert wait_until(lambda: replica_states(scaler, op) == ["weight_syncing"], 60)
    with sync_lock.lock:
        assert wait_until(lambda: sync_lock.waited.is_set() or stops(), 60), op.state
        assert not stops(), ranks.commands
    document = ended(scaler, op)
    assert document["state"] == "failed" and "no weight sync committed" in document["error"]
    assert [type(c) for c in ranks.commands] == [StartEngine, StopEngine]
    assert scaler.count("rollout") == 1
