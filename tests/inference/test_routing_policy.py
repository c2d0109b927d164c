"""``gateway.routing_policy`` through the gateway over a real engine pair, in both route modes
(the gateway picks the engine, or sglang-router does): ``round_robin`` takes the engines in turn
whatever routing key a request carries; ``affinity`` sends one key to one engine, spreads several
keys over both, refuses a request without a key, and the direct client agrees with the gateway.

Which engine answered: each engine of ``engine_pair`` serves its own weight_version label, which
SGLang returns in every generation reply.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from conftest import make_manager, serve

from relax_launch.inference.client import InferenceClient
from relax_launch.inference.router import SGLangRouter
from relax_launch.inference.routing import ROUTING_KEY_HEADER

pytestmark = pytest.mark.e2e
GEN = {"text": "The weather today", "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
# long enough that the first requests of new keys are still in flight when the next arrive
LONG_GEN = {
    "text": "The weather today",
    "sampling_params": {"max_new_tokens": 32, "ignore_eos": True},
}
KEYS = [f"session-{i}" for i in range(8)]


@contextmanager
def rollout_gateway(pair: dict[str, str], mode: str, policy: str, log_dir: Path) -> Iterator[str]:
    """A gateway over the pair with ``routing_policy: policy``, in route mode ``mode``."""
    urls = list(pair.values())
    if mode == "direct":
        with serve(
            {"rollout": make_manager("rollout", urls, policy=policy)}, routing_policy=policy
        ) as url:
            yield url
        return
    router = SGLangRouter(worker_urls=urls, log_path=log_dir / "router.log", policy=policy)
    router.start(120)
    try:  # the router's metrics listen on a port of their own, not a fixed default
        metrics = f"http://{router.host}:{router.prometheus_port}/metrics"
        assert httpx.get(metrics, timeout=10).status_code == 200
        manager = make_manager("rollout", urls, router_url=router.url, policy=policy)
        with serve({"rollout": manager}, routing_policy=policy) as url:
            discovery = httpx.get(f"{url}/rollout/engines").json()["models"]["m"]
            assert discovery["route_mode"] == "ROUTER"
            yield url
    finally:
        router.stop()


def served_by(url: str, key: str, body: dict = GEN) -> str:
    """The label of the engine that answered a generation sent with routing key ``key``."""
    reply = httpx.post(
        f"{url}/rollout/generate", json=body, headers={ROUTING_KEY_HEADER: key}, timeout=60
    )
    assert reply.status_code == 200, reply.text
    return reply.json()["meta_info"]["weight_version"]


@pytest.mark.parametrize("mode", ["direct", "router"])
def test_round_robin_ignores_the_routing_key(engine_pair, mode, tmp_path):
    with rollout_gateway(engine_pair, mode, "round_robin", tmp_path) as url:
        served = [served_by(url, "one-session") for _ in range(4)]
        keyless = httpx.post(f"{url}/rollout/generate", json=GEN, timeout=60)
    # one key, yet the engines in turn
    assert set(served) == set(engine_pair) and served[:2] == served[2:]
    assert keyless.status_code == 200


@pytest.mark.parametrize("mode", ["direct", "router"])
def test_affinity_sends_each_key_to_one_engine(engine_pair, mode, tmp_path):
    with rollout_gateway(engine_pair, mode, "affinity", tmp_path) as url:
        keyless = httpx.post(f"{url}/rollout/generate", json=GEN, timeout=60)
        pinned = [served_by(url, "one-session") for _ in range(4)]
        with ThreadPoolExecutor(len(KEYS)) as pool:  # new keys in flight together (below)
            first = list(pool.map(served_by, [url] * len(KEYS), KEYS, [LONG_GEN] * len(KEYS)))
        again = [served_by(url, key) for key in KEYS]
        client = InferenceClient(url, "rollout", direct=True)
        try:
            direct = [
                client.generate(GEN, affinity_key=key)["meta_info"]["weight_version"]
                for key in KEYS
            ]
        finally:
            client.close()
    assert keyless.status_code == 400 and ROUTING_KEY_HEADER in keyless.text
    assert len(set(pinned)) == 1
    assert first == again == direct  # the same engine per key, gateway and direct client alike
    # several keys use both engines: rendezvous hashing spreads these keys (direct); the router
    # gives a new key to the engine with fewer keys in flight (random only on a tie)
    assert set(first) == set(engine_pair)
