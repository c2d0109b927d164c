"""A real sglang-router is ready only once every worker is registered and healthy.

The router answers generations as soon as one worker has registered; under ``affinity`` the
keys it pins then stay on that worker for hours. Here the second worker comes up late; once both
are in, new keys sent while the earlier ones are in flight spread evenly. Scripted upstreams
stand in for engines: what is under test is the router's readiness and key placement.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import psutil
import pytest
from fake_upstream import FakeUpstream

from relax_launch import http
from relax_launch.deadline import wait_until
from relax_launch.inference.process import (
    LOWEST_PORT,
    ProcessStartError,
    free_port,
    lowest_ephemeral_port,
)
from relax_launch.inference.router import SGLangRouter
from relax_launch.inference.routing import ROUTING_KEY_HEADER

# A bound only a hang reaches: beside CI's e2e pass a router's own start took 10-45 s
START_S = 240


def registered(router: SGLangRouter) -> set[str]:
    try:
        listed = http.call("GET", router.url + "/workers", timeout_s=5).raise_for_status()
    except (http.TransportError, TimeoutError):
        return set()
    return {worker["url"] for worker in listed.json()["workers"]}


def generations(*workers: FakeUpstream) -> list[int]:
    return [sum(r["path"] == "/generate" for r in w.requests) for w in workers]


def keyed(url: str, key: str) -> httpx.Response:
    return httpx.post(
        url + "/generate", json={"text": "hi"}, headers={ROUTING_KEY_HEADER: key}, timeout=START_S
    )


def test_router_waits_for_a_late_worker_then_spreads_keys_over_both(tmp_path):
    early, late_port = FakeUpstream().start(), free_port("127.0.0.1")
    late_url = f"http://127.0.0.1:{late_port}"
    router = SGLangRouter(
        worker_urls=[early.url, late_url], log_path=tmp_path / "router.log", policy="affinity"
    )
    router.launch()
    late = None
    try:
        with ThreadPoolExecutor(1) as pool:
            ready = pool.submit(router.wait_ready, START_S)
            deadline = time.monotonic() + START_S
            while registered(router) != {early.url}:  # serving, with one worker of two
                assert time.monotonic() < deadline, router.log_tail()
                time.sleep(0.2)
            time.sleep(2)
            assert not ready.done(), "the router was called ready with a worker missing"
            late = FakeUpstream(port=late_port).start()
            ready.result(timeout=START_S)
        for worker in (early, late):
            worker.reset("held")  # each request stays in flight while the next key arrives
        with ThreadPoolExecutor(8) as pool:
            replies = []
            try:
                for i in range(8):  # one new key at a time, the earlier ones still in flight
                    replies.append(pool.submit(keyed, router.url, f"k{i}"))
                    while sum(generations(early, late)) <= i:
                        assert time.monotonic() < deadline + START_S, generations(early, late)
                        time.sleep(0.02)
            finally:  # else a failure above leaves the pool's exit waiting on the held ones
                early.release()
                late.release()
            assert all(reply.result().status_code == 200 for reply in replies)
        assert generations(early, late) == [4, 4]  # each went to the worker with fewer in flight
    finally:
        router.stop()
        early.stop()
        if late:
            late.stop()


def test_a_router_missing_a_worker_says_which_when_its_start_times_out(tmp_path):
    worker, absent = FakeUpstream().start(), f"http://127.0.0.1:{free_port()}"
    router = SGLangRouter(
        worker_urls=[worker.url, absent], log_path=tmp_path / "r.log", policy="affinity"
    )
    try:
        # serving with the one worker first: the short wait's last probe then names the other
        # (a wait that times out before the router listens says only that, as beside CI's
        # e2e pass, where the router's own start took past 30 s)
        router.launch()
        assert wait_until(lambda: registered(router) == {worker.url}, START_S), router.log_tail()
        with pytest.raises(ProcessStartError, match="not yet registered and healthy") as failed:
            router.wait_ready(2)
        assert absent in str(failed.value) and worker.url not in str(failed.value).split(":\n")[0]
        assert router.process.poll() is not None  # stopped by its PID on the failure
    finally:
        router.stop()
        worker.stop()


def test_a_server_whose_port_was_taken_moves_to_a_new_one(tmp_path):
    """Another server took the chosen port before the router bound it, and answers /generate
    there itself: the router is not ready until its own process listens, on a new port."""
    worker = FakeUpstream().start()
    router = SGLangRouter(worker_urls=[worker.url], log_path=tmp_path / "r.log", policy="affinity")
    taken = router.port
    squatter = FakeUpstream(port=taken).start()  # a 200 for any request, as a stale probe wants
    try:
        router.start(START_S)
        assert router.port != taken and router._listening()
        assert "address already in use" in (tmp_path / "r.log").read_text().lower()
        assert not [r for r in squatter.requests if r["path"] == "/generate"]
        assert keyed(router.url, "k").status_code == 200
    finally:
        router.stop()
        squatter.stop()
        worker.stop()


def test_free_ports_come_from_below_the_kernels_ephemeral_range():
    low = lowest_ephemeral_port()
    assert all(LOWEST_PORT <= free_port() < low for _ in range(20))


def test_a_tree_that_cannot_be_inspected_leaves_readiness_to_the_probe(tmp_path, monkeypatch):
    """Where procfs hides the server's sockets (AccessDenied), the listener check must not
    hold the start until its timeout: the probe alone decides."""
    worker = FakeUpstream().start()
    router = SGLangRouter(worker_urls=[worker.url], log_path=tmp_path / "r.log", policy="affinity")

    def denied(self, kind="inet"):
        raise psutil.AccessDenied(self.pid)

    monkeypatch.setattr(psutil.Process, "net_connections", denied)
    try:
        router.start(START_S)
        assert keyed(router.url, "k").status_code == 200
    finally:
        router.stop()
        worker.stop()
