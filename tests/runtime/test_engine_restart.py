"""EngineRestarts (an engine head restarts its dead server, counting it) and RolloutMembership
(which rollout engines take the next weight sync, from those counts and the engines the
controller lost): this module's logic, with a dict for the job's store and a worker that starts
at once; the real job is in test_job_ends.py."""

from __future__ import annotations

import asyncio
from urllib.parse import urlsplit

import pytest

from relax_launch.deadline import wait_until
from relax_launch.inference.discovery import RoutingSpec, WeightSource
from relax_launch.inference.engine import EngineHandle
from relax_launch.inference.health import HealthProbe
from relax_launch.inference.inprocess import ControllerMetrics, EngineClient, EngineUnreachable
from relax_launch.inference.manager import InferenceManager
from relax_launch.inference.routing import RouteResolver
from relax_launch.runtime.engine_restart import EngineRestarts, RolloutMembership, engine_key


class HealthSession:
    """Answers /health: 200 from port 4335, 503 from any other (the session's request API)."""

    def request(self, method: str, url: str, **kwargs: object) -> HealthReply:
        return HealthReply(200 if urlsplit(url).port == 4335 else 503)


class HealthReply:
    def __init__(self, status: int) -> None:
        self.status, self.headers = status, {}

    async def __aenter__(self) -> HealthReply:
        return self

    async def __aexit__(self, *exc: object) -> None:
        return None

    async def read(self) -> bytes:
        return b""


class DictStore:
    def __init__(self) -> None:
        self.values: dict[str, bytes] = {}

    def set(self, key: str, value: str) -> None:
        self.values[key] = value.encode()

    def get(self, key: str) -> bytes:
        return self.values[key]

    def check(self, keys: list[str]) -> bool:
        return all(k in self.values for k in keys)


def rollout(engines: int) -> InferenceManager:
    manager = InferenceManager(
        role="rollout",
        model_id="m",
        served_model_name="/models/m",
        weight_source=WeightSource.TRAINER,
        routing=RoutingSpec(default_model="m"),
        fault_tolerant=True,
    )
    manager.attach(
        [
            EngineHandle(f"m/{i}", f"http://10.0.0.{i}:1", "rollout", False, index=i)
            for i in range(engines)
        ]
    )
    return manager


def membership(engines: int = 3) -> tuple[RolloutMembership, DictStore, InferenceManager]:
    store, manager = DictStore(), rollout(engines)
    members = RolloutMembership(store, manager, alive=lambda url: False)  # lost ones stay down
    members.synced = tuple(range(engines))  # as the first connect leaves it
    return members, store, manager


def serving(manager: InferenceManager) -> list[str]:
    return [e.engine_id for e in manager.serving()]


def test_nothing_changed_keeps_the_groups():
    members, _, manager = membership()
    assert members.before_sync() is None
    assert members.metrics() == {
        "rollout/engines_serving": 3.0,
        "rollout/engine_restarts": 0.0,
        "rollout/prompts_regenerated": 0.0,
    }


def test_a_lost_engine_leaves_routing_and_the_next_sync_and_comes_back_once_restarted():
    members, store, manager = membership()
    manager.engine_lost("m/1", "connection refused")
    assert [e.engine_id for e in manager.snapshot().models["m"].engines] == ["m/0", "m/2"]
    assert members.before_sync() == (0, 2)  # new groups without it
    store.set(engine_key("down", "rollout", 1), "1")  # its head restarts it
    assert members.before_sync() is None and serving(manager) == ["m/0", "m/2"]
    store.set(engine_key("up", "rollout", 1), "1")  # ready again
    assert members.before_sync() == (0, 1, 2)
    assert serving(manager) == ["m/0", "m/1", "m/2"]
    assert manager.engines[1].generation == 2  # a new engine behind the same id
    assert members.metrics() == {
        "rollout/engines_serving": 3.0,
        "rollout/engine_restarts": 1.0,
        "rollout/prompts_regenerated": 0.0,
    }
    assert members.before_sync() is None


def test_each_step_counts_the_generations_sent_again_since_the_step_before():
    members, _, manager = membership()
    for _ in range(3):
        manager.requests.regenerating()
    assert members.metrics()["rollout/prompts_regenerated"] == 3.0
    assert members.metrics()["rollout/prompts_regenerated"] == 0.0
    manager.requests.regenerating()
    assert members.metrics()["rollout/prompts_regenerated"] == 1.0


def pairs() -> tuple[RolloutMembership, DictStore, InferenceManager]:
    """Decode halves 0 and 1, paired with prefill halves 2 and 3."""
    members, store, manager = membership(4)
    for decode, prefill in ((0, 2), (1, 3)):
        manager.engines[decode].half, manager.engines[prefill].half = "decode", "prefill"
        manager.engines[decode].prefill_id = f"m/{prefill}"
    return members, store, manager


@pytest.mark.parametrize("dead, partner", [(2, 0), (1, 3)], ids=["prefill", "decode"])
def test_a_pair_with_a_half_out_leaves_the_sync_whole_and_comes_back_whole(dead, partner):
    """The live half holds requests waiting on its partner's KV transfer (a sync's cache flush
    refuses them): it leaves routing and the sync with it, and comes back with it."""
    members, store, manager = pairs()
    store.set(engine_key("down", "rollout", dead), "1")  # its head restarts it
    assert members.before_sync() == tuple(sorted({0, 1, 2, 3} - {dead, partner}))
    assert set(manager.lost) == {f"m/{dead}", f"m/{partner}"}
    assert members.before_sync() is None  # held while its partner restarts: no new groups
    store.set(engine_key("up", "rollout", dead), "1")  # ready again
    assert members.before_sync() == (0, 1, 2, 3) and manager.lost == {}
    assert members.before_sync() is None and members.held == set()


def test_an_engine_restarting_before_the_controller_noticed_leaves_the_sync():
    members, store, manager = membership()
    store.set(engine_key("down", "rollout", 2), "1")
    assert members.before_sync() == (0, 1) and serving(manager) == ["m/0", "m/1"]


def test_an_engine_that_died_and_came_back_between_two_syncs_gets_new_groups():
    members, store, _ = membership()
    store.set(engine_key("down", "rollout", 0), "1")
    store.set(engine_key("up", "rollout", 0), "1")
    assert members.before_sync() == (0, 1, 2)  # same engines, but engine 0 left its group
    assert members.restarts == 1


def test_no_engine_left_is_an_error():
    members, _, manager = membership(2)
    manager.engine_lost("m/0", "gone")
    manager.engine_lost("m/1", "gone")
    with pytest.raises(RuntimeError, match="every rollout engine is down"):
        members.before_sync()


def test_the_operator_line_names_the_engines_of_the_sync():
    members, _, manager = membership()
    line = members.describe((0, 2), 7)
    assert line == (
        "relax-launch: rollout engines [0, 2] take weight version 7; engines [1] are out of "
        "routing (restarting or scaled in) (0 restarted so far)"
    )
    assert members.describe((0, 1, 2), 8).startswith(
        "relax-launch: every rollout engine takes weight version 8"
    )


class FakeWorker:
    """An engine head's worker whose server starts (or fails to) at once."""

    def __init__(self, ready: bool = True, launches: bool = True) -> None:
        self.engine = type("Engine", (), {"role": "rollout", "index": 1})()
        self.server = type("Server", (), {"stop": lambda self: None})()
        self.ready, self.launches, self.launched = ready, launches, 0

    def launch(self) -> None:
        if not self.launches:
            raise OSError("no such file: python")
        self.launched += 1

    def wait_ready(self, timeout_s: float) -> None:
        if not self.ready:
            raise TimeoutError(f"not ready within {timeout_s:.0f} s")


def restarted(restarts: EngineRestarts) -> None:
    """Once the restart in the background ended (the bound only guards against a hang)."""
    wait_until(lambda: not restarts.pending, 60, 0.01)


def test_a_restart_is_counted_down_then_up_and_the_fourth_death_ends_the_job():
    store, worker = DictStore(), FakeWorker()
    restarts = EngineRestarts(store, worker, timeout_s=1)
    for count in (1, 2, 3):
        assert restarts.restart("its SGLang server was killed by SIGKILL") is None
        restarted(restarts)
        assert store.get(engine_key("down", "rollout", 1)) == str(count).encode()
        assert store.get(engine_key("up", "rollout", 1)) == str(count).encode()
    assert worker.launched == 3
    refused = restarts.restart("its SGLang server exited with code 1")
    assert refused == "its SGLang server exited with code 1, for the 4th time (3 restarts allowed)"
    assert worker.launched == 3


def test_a_prefill_half_starts_again_only_once_its_decode_halves_forgot_it(monkeypatch):
    """Its restart is counted at once, its launch waits ``PARTNER_FORGETS_S`` (on the
    watchdog's ticks: ``proceed``), then it is counted up as any other engine's. The hold is
    long and aged by hand: a short real one could pass before the first tick on a loaded
    machine."""
    monkeypatch.setattr("relax_launch.runtime.engine_restart.PARTNER_FORGETS_S", 60.0)
    store, worker = DictStore(), FakeWorker()
    worker.engine.disaggregation = "prefill"
    restarts = EngineRestarts(store, worker, timeout_s=1)
    assert restarts.restart("its SGLang server was killed by SIGKILL") is None
    assert restarts.pending and worker.launched == 0
    assert store.get(engine_key("down", "rollout", 1)) == b"1"
    assert restarts.proceed() is None and worker.launched == 0  # still held
    restarts.held[0].end -= 60  # a tick once the hold is over
    assert restarts.proceed() is None and worker.launched == 1
    restarted(restarts)
    assert store.get(engine_key("up", "rollout", 1)) == b"1"
    assert restarts.proceed() is None and worker.launched == 1  # launched once


def test_a_server_that_does_not_start_again_ends_the_job():
    not_ready = EngineRestarts(DictStore(), FakeWorker(ready=False), timeout_s=1)
    assert not_ready.restart("died") is None
    restarted(not_ready)
    assert not_ready.failure == "died; restarting it failed: TimeoutError: not ready within 1 s"
    not_launched = EngineRestarts(DictStore(), FakeWorker(launches=False), timeout_s=1)
    assert not_launched.restart("died") == (
        "died; restarting it failed: OSError: no such file: python"
    )
    assert not not_launched.pending


def test_the_engine_taken_out_is_the_one_that_dropped_the_request_not_a_url_prefix_of_it():
    """Engines at ports 4335 and 43357: a request to 43357 that was dropped, while 43357 fails
    its health check, takes out engine 43357 only (a scripted session stands in for both)."""
    manager = rollout(0)
    manager.attach(
        [
            EngineHandle("m/0", "http://127.0.0.1:4335", "rollout", False),
            EngineHandle("m/1", "http://127.0.0.1:43357", "rollout", False),
        ]
    )
    probe = HealthProbe(timeout_s=1, attempts=2, window_s=0.1)  # 503 twice: gone
    client = EngineClient(
        manager, resolver=RouteResolver(), timeout_s=5, metrics=ControllerMetrics(), probe=probe
    )
    client.session = HealthSession()
    dropped = EngineUnreachable("http://127.0.0.1:43357/generate", "Server disconnected")
    assert asyncio.run(client._engine_died(dropped)) is True
    assert serving(manager) == ["m/0"] and list(manager.lost) == ["m/1"]
    assert manager.lost["m/1"].startswith("Server disconnected; 2 probes")
