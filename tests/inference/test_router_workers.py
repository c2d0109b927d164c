"""sglang-router's worker list follows the rollout engines in routing (route mode ``router``).

A real sglang-router process in front of scripted upstreams (each a real HTTP server that
records what reaches it and reports the weight version it is told to): what is under test is
when an engine enters and leaves the router, and that the router's own routing follows. A
scaled-out engine is added when the weight sync commits on it (not when it joins), a scale-in
removes it before its server is stopped, a restarting engine leaves at once (``RouterRestarts``)
and comes back with the next sync; the router sends a request whose engine died under it to
another worker itself. The real job: tests/runtime/test_elastic_rollout.py (router) and
tests/runtime/test_job_ends.py (a restart behind the router).
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from fake_upstream import FakeUpstream

from relax_launch.config import build_config
from relax_launch.deadline import wait_until
from relax_launch.inference.discovery import RoutingSpec, WeightSource
from relax_launch.inference.engine import EngineHandle
from relax_launch.inference.inprocess import EngineClients
from relax_launch.inference.manager import InferenceManager
from relax_launch.inference.process import free_port
from relax_launch.inference.router import SGLangRouter
from relax_launch.inference.router_workers import RouterWorkers
from relax_launch.placement import plan
from relax_launch.runtime import scaling
from relax_launch.runtime.engine_restart import RolloutMembership, engine_key
from relax_launch.runtime.rank_commands import StartEngine, StopEngine
from relax_launch.runtime.router_restarts import RouterRestarts

JOB = {
    "cluster": {"nnodes": 1, "nproc_per_node": 3, "device": "cpu"},
    "placement": {"mode": "decoupled"},
    "trainer": {"model": "builtin:tiny-llama", "ranks": 1},
    "rollout": {"ranks": 1, "max_engines": 2, "engine": {"max_total_tokens": 2048}},
    "gateway": {"rollout_route_mode": "router"},
    "algorithm": {"n_samples_per_prompt": 2},
    "data": {"prompts_per_step": 2},
}
GENERATE = {"text": "hi", "sampling_params": {"max_new_tokens": 1}}


class Engine(FakeUpstream):
    """A scripted engine that also reports ``version`` as its weight version."""

    version = "0"

    async def app(self, scope, receive, send) -> None:
        if scope["path"] == "/model_info":
            body = json.dumps({"weight_version": self.version}).encode()
            return await self._reply(send, 200, body, "application/json")
        return await super().app(scope, receive, send)


def generations(engine: FakeUpstream) -> int:
    return sum(r["path"] == "/generate" for r in engine.requests)


def through(router: SGLangRouter, times: int) -> list[int]:
    """Statuses of ``times`` generations sent to the router one after the other."""
    return [
        httpx.post(router.url + "/generate", json=GENERATE, timeout=90).status_code
        for _ in range(times)
    ]


def listed(router: SGLangRouter) -> dict[str, bool]:
    workers = httpx.get(router.url + "/workers", timeout=10).json()["workers"]
    return {w["url"]: w["is_healthy"] for w in workers}


def handle(engine: FakeUpstream, index: int) -> EngineHandle:
    return EngineHandle(f"tiny-llama/{index}", engine.url, "rollout", False, index=index)


@pytest.fixture(scope="module")
def router(tmp_path_factory):
    """One router for the module, started with engine 0 of ``engines``."""
    engines = [Engine().start(), Engine().start()]
    log = tmp_path_factory.mktemp("router") / "router.log"
    router = SGLangRouter(worker_urls=[engines[0].url], log_path=log, policy="round_robin")
    router.start(240)  # only a hang: beside CI's e2e pass a router's start took 10-45 s
    router.engines = engines
    try:
        yield router
    finally:
        router.stop()
        for engine in engines:
            engine.stop()


@pytest.fixture
def behind_router(router):
    """Engines 0 and 1 (up), the router routing to engine 0 only, and the rollout manager
    attached to engine 0 with the router's workers following it; the router's workers are
    engine 0 again afterwards."""
    engines = router.engines
    for engine in engines:
        engine.reset()
        engine.version = "0"
    manager = InferenceManager(
        role="rollout",
        model_id="tiny-llama",
        served_model_name="/models/tiny-llama",
        weight_source=WeightSource.TRAINER,
        routing=RoutingSpec(default_model="tiny-llama"),
        fault_tolerant=True,
        elastic=True,
    )
    workers = RouterWorkers(router.url, [engines[0].url])
    manager.attach([handle(engines[0], 0)], router_url=router.url, router=workers)
    manager.weights_committed(0)
    yield engines, router, manager
    workers.registered = set(listed(router))
    workers.match(lambda: [handle(engines[0], 0)])


def synced(manager: InferenceManager, engines: list[Engine], version: int) -> None:
    """A weight sync to ``version`` as rank 0 runs it, the engines' side scripted."""
    manager.weights_updating()
    for engine in engines:
        engine.version = str(version)
    manager.weights_committed(version)


def test_a_worker_added_gets_requests_and_a_removed_one_only_finishes_its_own(behind_router):
    engines, router, manager = behind_router
    workers = manager.router
    assert workers.match(lambda: [handle(e, i) for i, e in enumerate(engines)]) == []
    assert listed(router) == {engines[0].url: True, engines[1].url: True}
    assert through(router, 6) == [200] * 6
    assert generations(engines[0]) >= 3 and generations(engines[1]) >= 3  # round robin
    engines[1].reset("held")  # a request on engine 1 stays in flight while it is removed
    with ThreadPoolExecutor(1) as pool:
        on_one = pool.submit(through, router, 2)
        try:
            assert wait_until(lambda: generations(engines[1]) > 0, 60)
            workers.remove(engines[1].url)
            assert listed(router) == {engines[0].url: True}  # taken: nothing new goes there
        finally:
            engines[1].release()  # else a failure above leaves the pool's exit waiting on it
        assert on_one.result() == [200, 200]  # the one in flight was answered where it ran
    assert generations(engines[1]) == 1
    engines[0].reset()
    assert through(router, 4) == [200] * 4
    assert generations(engines[0]) == 4 and generations(engines[1]) == 1


def test_a_scaled_out_engine_joins_the_router_when_the_sync_commits_and_leaves_before_it_stops(
    behind_router, tmp_path
):
    """EngineScaler over a real plan: the scale-out's engine is healthy and joining, but the
    router learns of it only when the next sync commits on it; a scale-in takes it out of the
    router before the head rank is asked to stop its server."""
    engines, router, manager = behind_router
    at_stop: list[dict[str, bool]] = []

    def ranks(command, heads, timeout_s):
        if isinstance(command, StopEngine):
            at_stop.append(listed(router))
        return {heads[0]: engines[1].url if isinstance(command, StartEngine) else None}

    scaler = scaling.EngineScaler(
        plan=plan(build_config(JOB)),
        managers={"rollout": manager},
        call=ranks,
        startup_timeout_s=30,
        drain_timeout_s=30,
        sync_lock=threading.Lock(),
        log_dir=tmp_path,
    )
    out = scaler.request("rollout", "scale_out", 2)
    while manager.joining != {"tiny-llama/1"}:
        assert out.state == "running", out.error
        time.sleep(0.05)
    time.sleep(0.5)
    assert listed(router) == {engines[0].url: True}  # healthy, joining, not routed
    RolloutMembership(Store(), manager).before_sync()  # the next sync takes it in ...
    assert listed(router) == {engines[0].url: True}
    synced(manager, engines, 1)  # ... and commits on it
    assert listed(router) == {engines[0].url: True, engines[1].url: True}
    while out.state == "running":
        time.sleep(0.05)
    assert out.state == "succeeded", out.error
    assert through(router, 4) == [200] * 4 and generations(engines[1]) >= 2
    back = scaler.request("rollout", "scale_in", 1)
    while back.state == "running":
        time.sleep(0.05)
    assert back.state == "succeeded", back.error
    assert at_stop == [{engines[0].url: True}]  # out of the router before the stop
    assert manager.router.registered == {engines[0].url}


class Store:
    """The job's store as the heads' restart counts use it."""

    def __init__(self) -> None:
        self.values: dict[str, bytes] = {}

    def set(self, key: str, value: str) -> None:
        self.values[key] = value.encode()

    def check(self, keys: list[str]) -> bool:
        return all(key in self.values for key in keys)

    def get(self, key: str) -> bytes:
        return self.values[key]


def test_a_restarting_engine_leaves_the_router_at_once_and_returns_after_the_next_sync(
    behind_router,
):
    engines, router, manager = behind_router
    manager.add_engine(handle(engines[1], 1))
    synced(manager, engines, 1)
    assert listed(router) == {engines[0].url: True, engines[1].url: True}
    store = Store()
    watch = RouterRestarts.started(store, manager)
    try:
        store.set(engine_key("down", "rollout", 1), "1")  # its head begins a restart
        deadline = time.monotonic() + 60  # only a hang: "at once" is its first tick
        while engines[1].url in listed(router):
            assert time.monotonic() < deadline, listed(router)
            time.sleep(0.05)
        assert "tiny-llama/1" in manager.lost
        # back up at once, serving its weights from disk: the router still sends it nothing
        store.set(engine_key("up", "rollout", 1), "1")
        engines[1].version = "from disk"
        engines[0].reset(), engines[1].reset()
        time.sleep(1)
        assert through(router, 4) == [200] * 4 and generations(engines[1]) == 0
        membership = RolloutMembership(store, manager)
        assert membership.before_sync() == (0, 1)  # the next sync takes it in
        assert engines[1].url not in listed(router)  # not yet routed
        synced(manager, engines, 2)
    finally:
        watch.close()
    assert listed(router) == {engines[0].url: True, engines[1].url: True}
    assert through(router, 4) == [200] * 4 and generations(engines[1]) >= 2


SERVER = """
import sys, time
from http.server import ThreadingHTTPServer, BaseHTTPRequestHandler
class Handler(BaseHTTPRequestHandler):
    def _reply(self, body):
        self.send_response(200)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def do_GET(self):
        self._reply(b"{}")
    def do_POST(self):
        self.rfile.read(int(self.headers.get("content-length", 0)))
        time.sleep(60)
    def log_message(self, *args):
        pass
ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
"""


def test_the_router_sends_a_request_whose_engine_died_under_it_to_another(behind_router, tmp_path):
    """What route mode router leaves to sglang-router: a generation in flight on an engine
    that is killed is sent to another worker (a dropped connection is retried), so the
    controller's request is answered."""
    engines, router, manager = behind_router
    port = free_port()
    script = tmp_path / "server.py"
    script.write_text(SERVER)
    dying = subprocess.Popen([sys.executable, str(script), str(port)])
    try:
        dead = EngineHandle("tiny-llama/1", f"http://127.0.0.1:{port}", "rollout", False, index=1)
        assert manager.router.match(lambda: [handle(engines[0], 0), dead]) == []
        with ThreadPoolExecutor(4) as pool:
            replies = [pool.submit(through, router, 1) for _ in range(4)]
            # two answered by engine 0, the other two hang on the dying engine
            assert wait_until(lambda: sum(reply.done() for reply in replies) == 2, 60)
            assert generations(engines[0]) == 2 and sum(reply.done() for reply in replies) == 2
            dying.kill()
            assert [reply.result()[0] for reply in replies] == [200] * 4
        assert generations(engines[0]) == 4  # the two it lost were generated again here
    finally:
        dying.kill()


def test_requests_through_the_router_count_in_the_roles_load(behind_router):
    """The controller's requests through the router are in flight to no engine it knows, but
    to the role: what a load reading (``Autoscaler.read``) adds to the engines' own."""
    engines, router, manager = behind_router
    clients = EngineClients({"rollout": manager}, timeout_s=30)
    clients.start()
    try:
        engines[0].reset("held")
        sent = clients.start_soon(clients.client("rollout").request("/generate", dict(GENERATE)))
        assert wait_until(lambda: generations(engines[0]) > 0, 60)
        assert manager.requests.in_flight() == 1
        assert manager.requests.in_flight("tiny-llama/0") == 0  # the router chose the engine
        engines[0].release()
        assert sent.result(30)["text"]
        assert manager.requests.in_flight() == 0
    finally:
        engines[0].release()  # else a failure above leaves the close waiting on the request
        clients.close()
