"""Teacher and genrm engines that come back (``fault_tolerance`` of a static role):
``StaticMembership`` (rank 0 routes an engine out while its head restarts it and back once it is
ready, no weight sync), the controller's requests that were on a dead engine sent again, and a
role with no engine left waiting (``inference/outage.py``) instead of failing with 503. The
engines here are small real HTTP servers on localhost; the job test with a real SGLang teacher
is in test_job_ends.py."""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time

import pytest
from aiohttp import web
from test_engine_restart import DictStore, membership

from relax_launch import http
from relax_launch.config import ConfigError, build_config
from relax_launch.console import CONSOLE_LOGGER
from relax_launch.inference.client import InferenceError
from relax_launch.inference.discovery import RoutingSpec, WeightSource
from relax_launch.inference.engine import EngineHandle
from relax_launch.inference.health import HealthProbe
from relax_launch.inference.inprocess import ControllerMetrics, EngineClient
from relax_launch.inference.manager import InferenceManager
from relax_launch.inference.routing import RouteResolver
from relax_launch.runtime.engine_restart import engine_key
from relax_launch.runtime.static_membership import StaticMembership

SCORE = {"input_ids": [1, 2, 3], "return_logprob": True, "sampling_params": {"max_new_tokens": 1}}
TEACHER_JOB = {  # trainer 0, rollout 1, teacher 2, genrm 3
    "cluster": {"nnodes": 1, "nproc_per_node": 4, "device": "cpu"},
    "trainer": {"model": "builtin:tiny-llama", "ranks": 1},
    "rollout": {"ranks": 1, "engine": {"max_total_tokens": 2048}},
    "teacher": {"model": "builtin:tiny-llama", "ranks": 1, "engine": {"max_total_tokens": 2048}},
    "genrm": {"model": "builtin:tiny-llama", "ranks": 1, "engine": {"max_total_tokens": 2048}},
    "algorithm": {"n_samples_per_prompt": 2, "distill_coef": 0.1},
    "data": {"prompts_per_step": 2},
    "reward": {"sources": [{"name": "j", "genrm": True}]},
}
JUDGE = {"messages": [{"role": "user", "content": "2+2=4?"}], "sampling_params": {}}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def static_role(role: str, ports: list[int], restart_wait_s: float = 5.0) -> InferenceManager:
    manager = InferenceManager(
        role=role,
        model_id="m",
        served_model_name="/models/m",
        weight_source=WeightSource.STATIC,
        routing=RoutingSpec(default_model="m"),
        fault_tolerant=True,
        restart_wait_s=restart_wait_s,
    )
    manager.attach(
        [
            EngineHandle(f"m/{i}", f"http://127.0.0.1:{port}", role, True, index=i)
            for i, port in enumerate(ports)
        ]
    )
    return manager


class Engine:
    """A stand-in SGLang server at ``port``: /health and /generate, which says who answered."""

    def __init__(self, port: int) -> None:
        self.port, self.runner = port, None

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/health", lambda request: web.Response(text="ok"))
        app.router.add_post("/generate", self.generate)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()

    async def generate(self, request: web.Request) -> web.Response:
        body = await request.json()
        return web.json_response({"text": f" {self.port}", "got": sorted(body)})

    async def stop(self) -> None:
        await self.runner.cleanup()


def client_of(manager: InferenceManager, session: object) -> EngineClient:
    probe = HealthProbe(timeout_s=1, attempts=2, window_s=0.1)
    client = EngineClient(
        manager,
        resolver=RouteResolver(),
        timeout_s=5,
        metrics=ControllerMetrics(),
        renderers={"genrm": lambda messages, kwargs: "judge this"},  # its chat template
        probe=probe,
    )
    client.session = session
    return client


def test_a_restarting_engine_leaves_routing_and_comes_back_once_ready_without_a_sync():
    store, manager = DictStore(), static_role("teacher", [1])  # one engine is enough
    members = StaticMembership(store, [manager], alive=lambda url: False)
    members.poll()
    assert [e.engine_id for e in manager.serving()] == ["m/0"]
    store.set(engine_key("down", "teacher", 0), "1")  # its head restarts it
    members.poll()
    assert manager.serving() == [] and "m/0" in manager.lost
    assert members.metrics() == {"teacher/engines_serving": 0.0, "teacher/engine_restarts": 0.0}
    store.set(engine_key("up", "teacher", 0), "1")  # ready again: routed at once
    members.poll()
    assert [e.engine_id for e in manager.serving()] == ["m/0"] and manager.ready
    assert manager.engines[0].generation == 2  # a new server behind the same id
    assert members.metrics() == {"teacher/engines_serving": 1.0, "teacher/engine_restarts": 1.0}
    members.poll()  # counted once
    assert members.metrics()["teacher/engine_restarts"] == 1.0


def test_an_engine_lost_without_a_restart_comes_back_once_it_answers():
    answers = {"yes": False}
    manager = static_role("genrm", [1, 2])
    members = StaticMembership(DictStore(), [manager], alive=lambda url: answers["yes"])
    manager.engine_lost("m/1", "Server disconnected; 3 probes failed")
    members.poll()
    assert [e.engine_id for e in manager.serving()] == ["m/0"]
    answers["yes"] = True
    members.poll()
    assert [e.engine_id for e in manager.serving()] == ["m/0", "m/1"]
    assert members.metrics()["genrm/engine_restarts"] == 0.0  # not a restart


def test_only_fault_tolerant_static_roles_get_a_membership():
    teacher = static_role("teacher", [1])
    assert StaticMembership.started(DictStore(), {"rollout": membership()[2]}) is None
    teacher.fault_tolerant = False
    assert StaticMembership.started(DictStore(), {"teacher": teacher}) is None


@pytest.mark.parametrize(("role", "payload"), [("teacher", SCORE), ("genrm", JUDGE)])
def test_a_request_on_a_dead_engine_goes_to_another(role, payload):
    """Teacher scoring (logprob requests) and the genrm judge form: the engine a request went
    to is dead (nothing listens), so it leaves routing and the request is answered by the
    other one."""
    live, dead = free_port(), free_port()
    manager = static_role(role, [live, dead])  # the judge form routes twice: 2nd is the post

    async def scenario() -> dict:
        engine = Engine(live)
        await engine.start()
        session = http.session()
        try:
            client = client_of(manager, session)
            return [await client.request("/generate", payload) for _ in range(2)]
        finally:
            await session.close()
            await engine.stop()

    replies = asyncio.run(scenario())
    assert [r.get("text", r.get("response")).strip() for r in replies] == [str(live)] * 2
    assert list(manager.lost) == ["m/1"]


def test_with_no_engine_left_requests_wait_for_the_restart_announced_once(caplog):
    """The role's only engine is dead; its head restarts it (the counts in the store), and
    the requests sent meanwhile wait and are answered by the restarted server."""
    port, store = free_port(), DictStore()
    manager = static_role("teacher", [port], restart_wait_s=60.0)  # only a hang reaches it
    members = StaticMembership(store, [manager], alive=lambda url: False)
    caplog.set_level(logging.INFO, logger=CONSOLE_LOGGER)
    order: list[str] = []  # the restart and the replies, as they happened

    async def head_restarts(engine: Engine) -> None:
        store.set(engine_key("down", "teacher", 0), "1")
        await asyncio.sleep(0.6)  # loading its model
        await engine.start()
        order.append("restarted")
        store.set(engine_key("up", "teacher", 0), "1")

    async def ask(client) -> dict:
        reply = await client.request("/generate", SCORE)
        order.append("reply")
        return reply

    async def scenario() -> list[dict]:
        engine, session = Engine(port), http.session()
        polling = threading.Event()

        def poll() -> None:
            while not polling.wait(0.05):
                members.poll()

        threading.Thread(target=poll, daemon=True).start()
        try:
            client = client_of(manager, session)
            restart = asyncio.ensure_future(head_restarts(engine))
            replies = await asyncio.gather(*(ask(client) for _ in range(3)))
            await restart
            return replies
        finally:
            polling.set()
            await session.close()
            await engine.stop()

    replies = asyncio.run(scenario())
    assert [r["text"].strip() for r in replies] == [str(port)] * 3
    assert order == ["restarted", "reply", "reply", "reply"]  # they waited for the restart
    assert members.metrics() == {"teacher/engines_serving": 1.0, "teacher/engine_restarts": 1.0}
    lines = [r.getMessage() for r in caplog.records if r.name == CONSOLE_LOGGER]
    waits = [line for line in lines if "every teacher engine is out of routing" in line]
    assert len(waits) == 1 and "wait up to 60 s for one to serve again" in waits[0], lines
    assert any("teacher engine 0 serves again (restarted, 1 of 3 restarts" in x for x in lines)


def test_the_wait_for_a_restart_is_bounded():
    manager = static_role("genrm", [free_port()], restart_wait_s=1.0)

    async def scenario() -> None:
        session = http.session()
        try:
            await client_of(manager, session).request("/generate", JUDGE)
        finally:
            await session.close()

    began = time.monotonic()
    with pytest.raises(InferenceError, match="no genrm engine came back within 1 s") as refused:
        asyncio.run(scenario())
    # ended by its own bound: without one it would wait on (30: room for a loaded machine)
    assert refused.value.status == 503 and 1.0 <= time.monotonic() - began < 30


def test_a_rollout_sync_with_no_engine_left_waits_for_a_restart():
    members, store, manager = membership(2)
    manager.restart_wait_s = 60.0  # only a hang reaches it
    for index in (0, 1):
        store.set(engine_key("down", "rollout", index), "1")

    def head_restarts() -> None:
        time.sleep(0.5)
        store.set(engine_key("up", "rollout", 1), "1")

    threading.Thread(target=head_restarts, daemon=True).start()
    assert members.before_sync() == (1,)  # the restarted engine takes the sync
    assert members.restarts == 1


def test_one_teacher_engine_may_be_fault_tolerant_and_its_head_restarts_it():
    """Unlike rollout, a static role with a single engine is accepted: requests wait for it."""
    job = build_config(TEACHER_JOB, ["teacher.fault_tolerance=true", "genrm.fault_tolerance=true"])
    assert job.teacher.num_engines == 1
    assert [job.fault_tolerant(r) for r in ("rollout", "teacher", "genrm")] == [False, True, True]
    with pytest.raises(ConfigError, match="teacher.fault_tolerance needs placement.mode=decoupled"):
        build_config(TEACHER_JOB, ["teacher.fault_tolerance=true", "placement.mode=split"])
