"""When the controller takes an engine out of routing, and when it routes it again.

A real HTTP server scripts ``/health`` (slow, failing, answering again): what a real SGLang
engine does only under load (its ``/health`` sleeps 1 s and then waits for its scheduler, up to
20 s). The engine is taken out only when nothing listens on its port or after failed probes
over a window longer than that; once it answers, the next weight sync brings it back.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import aiohttp
import pytest

from relax_launch.inference.discovery import RoutingSpec, WeightSource
from relax_launch.inference.engine import EngineHandle
from relax_launch.inference.health import SGLANG_HEALTH_S, HealthProbe
from relax_launch.inference.inprocess import ControllerMetrics, EngineClient, EngineUnreachable
from relax_launch.inference.manager import InferenceManager
from relax_launch.inference.routing import RouteResolver
from relax_launch.runtime.engine_restart import RolloutMembership

SLOW_S = 2.5  # past the 2 s the controller used to give an engine's /health


class ScriptedHealth(ThreadingHTTPServer):
    """``/health`` answers ``status`` after ``delay_s``; counts the probes."""

    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), HealthHandler)
        self.status, self.delay_s, self.probes = 200, 0.0, 0
        self.url = f"http://127.0.0.1:{self.server_address[1]}"


class HealthHandler(BaseHTTPRequestHandler):
    server: ScriptedHealth

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self.server.probes += 1
        time.sleep(self.server.delay_s)
        self.send_response(self.server.status if self.path == "/health" else 404)
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def engine():
    server = ScriptedHealth()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()
    thread.join(5)


def rollout(*urls: str) -> InferenceManager:
    manager = InferenceManager(
        role="rollout",
        model_id="m",
        served_model_name="/models/m",
        weight_source=WeightSource.TRAINER,
        routing=RoutingSpec(default_model="m"),
        fault_tolerant=True,
    )
    manager.attach(
        [EngineHandle(f"m/{i}", url, "rollout", False, index=i) for i, url in enumerate(urls)]
    )
    return manager


def died(manager: InferenceManager, url: str, probe: HealthProbe | None = None) -> bool:
    """The controller's verdict on the engine at ``url`` after it dropped a request."""
    client = EngineClient(
        manager, resolver=RouteResolver(), timeout_s=5, metrics=ControllerMetrics(), probe=probe
    )

    async def verdict() -> bool:
        async with aiohttp.ClientSession() as session:
            client.session = session
            return await client._engine_died(EngineUnreachable(url + "/generate", "dropped"))

    return asyncio.run(verdict())


def test_the_default_probe_outlasts_sglangs_own_health_latency():
    probe = HealthProbe()
    assert probe.timeout_s > SGLANG_HEALTH_S and probe.window_s > SGLANG_HEALTH_S
    assert probe.attempts >= 2


def test_an_engine_slow_to_answer_health_stays_routed(engine):
    """A busy engine (a long prefill, a weight update) answers /health late: not lost."""
    manager = rollout(engine.url, "http://127.0.0.1:1")  # another engine to route to
    engine.delay_s = SLOW_S
    assert died(manager, engine.url) is False
    assert manager.lost == {} and [e.engine_id for e in manager.serving()] == ["m/0", "m/1"]


def test_an_engine_whose_port_refuses_is_lost_at_once():
    """Its process is gone: no window to wait out."""
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{closed.getsockname()[1]}"  # bound, not listening: refused
        manager = rollout(url, "http://127.0.0.1:1")
        assert died(manager, url, HealthProbe(timeout_s=5, attempts=3, window_s=600)) is True
    assert list(manager.lost) == ["m/0"] and "its server is gone" in manager.lost["m/0"]


def test_a_dropped_connection_is_probed_again_at_once_on_a_new_one():
    """Kept-alive connections a dead server left behind fail as dropped, not refused, and
    aiohttp's own retry of a GET may take a second one from the pool: the probe asks again on a
    connection of its own at once instead of waiting out a share of the window (here the
    server drops its first two connections and answers the next)."""
    connections = 0

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        await reader.readuntil(b"\r\n\r\n")
        if connections > 2:
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
            await writer.drain()
        writer.close()

    async def verdict() -> tuple[str | None, float]:
        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        began = time.monotonic()
        async with aiohttp.ClientSession() as session, server:
            gone = await HealthProbe(timeout_s=5, attempts=3, window_s=300).gone(session, url)
        return gone, time.monotonic() - began

    gone, seconds = asyncio.run(verdict())
    # a share of the window would be 150 s: 60 is at once however loaded the machine
    assert gone is None and connections == 3 and seconds < 60, (gone, seconds)


def test_an_engine_lost_after_failed_probes_is_routed_again_when_it_answers(engine):
    manager = rollout(engine.url, "http://127.0.0.1:1")
    engine.status = 503  # SGLang's answer when its scheduler is silent for 20 s
    probe = HealthProbe(timeout_s=2, attempts=3, window_s=0.4)
    assert died(manager, engine.url, probe) is True
    assert engine.probes == 3 and list(manager.lost) == ["m/0"]
    assert [e.engine_id for e in manager.serving()] == ["m/1"]

    members = RolloutMembership(DictStore(), manager)  # the real probe, before the next sync
    members.synced = (1,)
    engine.status = 200  # it answers again
    assert members.before_sync() == (0, 1)  # it takes the sync, routed once that commits
    assert manager.lost == {} and [e.engine_id for e in manager.serving()] == ["m/0", "m/1"]


def test_a_lost_engine_that_still_fails_stays_out_of_the_sync(engine):
    manager = rollout(engine.url, "http://127.0.0.1:1")
    manager.engine_lost("m/0", "dropped")
    engine.status = 503
    members = RolloutMembership(DictStore(), manager)
    members.synced = (0, 1)
    assert members.before_sync() == (1,)
    assert list(manager.lost) == ["m/0"]


class DictStore:
    """The job's store as RolloutMembership reads it: no engine restarted."""

    def check(self, keys: list[str]) -> bool:
        return False
