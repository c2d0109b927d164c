"""A real sglang-router is ready only once every worker is registered and healthy.

The router answers generations as soon as one worker has registered; under ``affinity`` the
keys it pins then stay on that worker for hours. Here the second worker comes up late, and once
both are in, keys sent together spread evenly (scripted upstreams stand in for engines: what is
under test is the router's readiness and key placement, not generation).
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
from fake_upstream import FakeUpstream

from relax_launch import http
from relax_launch.inference.router import SGLangRouter
from relax_launch.inference.routing import ROUTING_KEY_HEADER
from relax_launch.inference.server import free_port


def registered(router: SGLangRouter) -> set[str]:
    try:
        listed = http.call("GET", router.url + "/workers", timeout_s=5).raise_for_status()
    except (http.TransportError, TimeoutError):
        return set()
    return {worker["url"] for worker in listed.json()["workers"]}


def keyed(url: str, key: str) -> httpx.Response:
    return httpx.post(
        url + "/generate", json={"text": "hi"}, headers={ROUTING_KEY_HEADER: key}, timeout=30
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
            ready = pool.submit(router.wait_ready, 90)
            deadline = time.monotonic() + 60
            while registered(router) != {early.url}:  # serving, with one worker of two
                assert time.monotonic() < deadline, router.log_tail()
                time.sleep(0.2)
            time.sleep(2)
            assert not ready.done(), "the router was called ready with a worker missing"
            late = FakeUpstream(port=late_port).start()
            ready.result(timeout=90)
        for worker in (early, late):
            worker.reset("slow")  # each request stays in flight while the next key arrives
        with ThreadPoolExecutor(8) as pool:
            replies = list(pool.map(keyed, [router.url] * 8, [f"k{i}" for i in range(8)]))
        assert all(reply.status_code == 200 for reply in replies)
        served = [sum(r["path"] == "/generate" for r in w.requests) for w in (early, late)]
        assert served == [4, 4]  # each new key went to the worker with fewer keys in flight
    finally:
        router.stop()
        early.stop()
        if late:
            late.stop()
