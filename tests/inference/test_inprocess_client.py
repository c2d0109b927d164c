"""The controller's in-process engine clients (``ControlPlane.engines``) against the job's own
gateway over a real engine pair: the same 503 before the first weight commit, the same engine
for each affinity key after it, and not one request through the gateway.

Which engine answered: each engine of ``engine_pair`` serves its own weight_version label, which
SGLang returns in every generation reply.
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from relax_launch.inference.client import InferenceClient, InferenceError
from relax_launch.inference.config import GatewayConfig, RolloutConfig
from relax_launch.inference.control_plane import ControlPlane, RoleSpec
from relax_launch.inference.engine import post
from relax_launch.inference.inprocess import EngineClients
from relax_launch.inference.routing import ROUTING_KEY_HEADER

pytestmark = pytest.mark.e2e
MODEL = "builtin:tiny-llama"
GEN = {"text": "The weather today", "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
KEYS = [f"session-{i}" for i in range(8)]


def counted(plane: ControlPlane, name: str, **labels: str) -> float:
    """The sum of the samples ``name`` with ``labels`` on the gateway's /metrics."""
    text = httpx.get(f"{plane.url}/metrics", timeout=30).text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name and labels.items() <= sample.labels.items()
    )


def gateway_requests(plane: ControlPlane) -> float:
    return counted(plane, "relax_gateway_requests_total", role="rollout")


def in_process(plane: ControlPlane, key: str) -> dict:
    client = plane.engines.client("rollout")
    return plane.engines.run(client.request("/generate", GEN, affinity_key=key), what=key)


def commit_first_weights(plane: ControlPlane, pair: dict[str, str]) -> None:
    """The first weight sync's commit (both engines serve version 1); then each engine gets
    its label back, so that a reply tells which engine served it."""
    for url in pair.values():
        post(url, "/update_weight_version", {"new_version": "1"}, 30)
    manager = plane.managers["rollout"]
    manager.weights_updating()
    manager.weights_committed(1)
    for label, url in pair.items():
        post(url, "/update_weight_version", {"new_version": label}, 30)


def test_controller_refuses_and_routes_as_the_gateway_without_it(engine_pair, tiny_model, tmp_path):
    spec = RoleSpec("rollout", MODEL, tiny_model, RolloutConfig(), "serving")
    config = GatewayConfig(routing_policy="affinity")
    plane = ControlPlane([spec], gateway=config, admin_token=None, log_dir=tmp_path)
    plane.start()
    try:
        plane.attach("rollout", list(engine_pair.values()), startup_timeout_s=60)
        # before the first weight commit: the same 503, through the gateway and in process
        raw = httpx.post(
            f"{plane.url}/rollout/generate", json=GEN, headers={ROUTING_KEY_HEADER: "k"}, timeout=60
        )
        through_gateway = InferenceClient(plane.url, "rollout")
        with pytest.raises(InferenceError) as gateway_refusal:
            through_gateway.generate(GEN, affinity_key="k")
        through_gateway.close()
        before = gateway_requests(plane)
        with pytest.raises(InferenceError) as controller_refusal:
            in_process(plane, "k")
        assert gateway_requests(plane) == before == 3  # the raw post, the client's two tries

        commit_first_weights(plane, engine_pair)
        gateway_served = [
            httpx.post(
                f"{plane.url}/rollout/generate",
                json=GEN,
                headers={ROUTING_KEY_HEADER: key},
                timeout=60,
            ).json()["meta_info"]["weight_version"]
            for key in KEYS
        ]
        before = gateway_requests(plane)
        with ThreadPoolExecutor(2) as threads:  # as the RL loop and its background rollout do
            replies = list(threads.map(lambda key: in_process(plane, key), KEYS))
        assert gateway_requests(plane) == before
        # the controller's requests, counted on the gateway's /metrics beside its own
        controller = {
            (model, status): counted(
                plane, "relax_controller_requests_total", model=model, status=status
            )
            for model, status in (("tiny-llama", "200"), ("-", "503"))
        }
    finally:
        plane.close()
    assert raw.status_code == 503 and raw.headers["retry-after"] == "1"
    message = raw.json()["error"]["message"]
    assert "ONLOADING" in message
    for refusal in (gateway_refusal.value, controller_refusal.value):
        assert (refusal.status, refusal.message) == (503, message)
    # the same engine for every key, both ways, and the keys spread over both engines
    assert [r["meta_info"]["weight_version"] for r in replies] == gateway_served
    assert set(gateway_served) == set(engine_pair)
    assert controller == {("tiny-llama", "200"): len(KEYS), ("-", "503"): 1}


def test_a_stuck_phase_is_cancelled_at_its_bound_and_named():
    engines = EngineClients({}, timeout_s=5)
    engines.start()
    cancelled = threading.Event()

    async def stuck() -> None:
        try:
            await asyncio.sleep(600)
        finally:
            cancelled.set()

    try:
        with pytest.raises(TimeoutError, match="12 rollout requests did not finish within 0 s"):
            engines.run(stuck(), what="12 rollout requests", timeout_s=0.2)
        assert cancelled.wait(10)
    finally:
        engines.close()
    never_run = stuck()
    with pytest.raises(RuntimeError, match="not running"):
        engines.run(never_run, what="after close")
    assert not engines.running
