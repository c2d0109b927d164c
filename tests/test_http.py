"""The one HTTP client: a refused connection reads as gone, a silent server as slow, and the
blocking paths (one-shot ``call``, a ``Portal``) give the async path's answers."""

from __future__ import annotations

import asyncio
import socket
import threading

import pytest

from relax_launch import http
from relax_launch.inference.engine import (
    EngineControl,
    EngineRequestError,
    EngineUnreachable,
    post,
)
from relax_launch.inference.process import free_port


@pytest.fixture
def silent_server():
    """Accepts connections and never answers."""
    listener = socket.create_server(("127.0.0.1", 0))
    accepted: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        listener.settimeout(0.1)
        while not stop.is_set():
            try:
                accepted.append(listener.accept()[0])
            except TimeoutError:
                pass

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    stop.set()
    thread.join(5)
    for conn in accepted:
        conn.close()
    listener.close()


def test_refused_is_unreachable_and_silence_is_a_timeout(silent_server):
    with pytest.raises(http.TransportError) as refused:
        http.call("GET", f"http://127.0.0.1:{free_port()}/health", timeout_s=2)
    assert http.unreachable(refused.value)
    with pytest.raises(TimeoutError) as slow:
        http.call("GET", silent_server + "/health", timeout_s=0.3)
    assert not http.unreachable(slow.value)
    # the engine control's reading of the same two: gone vs. merely slow
    with pytest.raises(EngineUnreachable):
        post(f"http://127.0.0.1:{free_port()}", "/flush_cache", {}, 2)
    with pytest.raises(EngineRequestError) as stalled:
        post(silent_server, "/flush_cache", {}, 0.3)
    assert not isinstance(stalled.value, EngineUnreachable)


def test_kept_alive_control_answers_like_the_one_shot_path(silent_server):
    control = EngineControl()
    try:
        with pytest.raises(EngineUnreachable):
            control.post(f"http://127.0.0.1:{free_port()}", "/flush_cache", {}, 2)
        pending = control.submit(silent_server, "/update_weights", {}, 0.3)
        with pytest.raises(EngineRequestError, match="TimeoutError"):
            pending.result(10)
    finally:
        control.close()
    assert not control.portal.running


def test_portal_cancels_what_it_gave_up_on_and_refuses_after_close():
    runner = http.Portal("test-loop")
    cancelled = threading.Event()

    async def stuck() -> None:
        try:
            await asyncio.sleep(600)
        finally:
            cancelled.set()

    with pytest.raises(TimeoutError, match="the stuck thing: no answer within 0 s"):
        runner.run(stuck(), 0.2, "the stuck thing")
    assert cancelled.wait(5)
    runner.close()
    never_run = stuck()
    with pytest.raises(RuntimeError, match="closed"):
        runner.submit(never_run)
