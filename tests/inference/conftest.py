"""Fixtures for the control-plane tests: real gateways on 127.0.0.1 over managers whose engines
are a scripted upstream (to observe what reached an engine), a real SGLang server, or a pair of
them that tells which engine answered."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
from fake_upstream import FakeUpstream

from relax_launch.inference.config import GatewayConfig
from relax_launch.inference.discovery import RoutingSpec, WeightSource
from relax_launch.inference.engine import EngineHandle, get_json, post
from relax_launch.inference.gateway import InferenceGateway
from relax_launch.inference.generation_routes import Renderer
from relax_launch.inference.manager import InferenceManager
from relax_launch.inference.serve import GatewayServer

ADMIN_TOKEN = "test-admin-token"


def make_manager(
    role: str,
    urls: list[str],
    *,
    served: str = "/models/m",
    ready: bool = True,
    router_url: str | None = None,
    **routing,
) -> InferenceManager:
    """A manager for ``role`` over engines at ``urls`` (behind ``router_url`` when given);
    rollout's first sync is marked done."""
    manager = InferenceManager(
        role=role,
        model_id="m",
        served_model_name=served,
        weight_source=WeightSource.TRAINER if role == "rollout" else WeightSource.STATIC,
        routing=RoutingSpec(default_model="m", **routing),
        drain_timeout_s=30,
        vocab_size=320,  # the tiny Llama's
    )
    if ready:
        handles = [
            EngineHandle(f"m/{i}", url, role=role, static=role != "rollout")
            for i, url in enumerate(urls)
        ]
        manager.attach(handles, router_url=router_url)
        if role == "rollout":
            manager.weights_valid, manager.weight_version = True, "0"
    return manager


@contextmanager
def serve(
    managers: dict[str, InferenceManager],
    *,
    admin_token: str | None = ADMIN_TOKEN,
    renderers: dict[str, Renderer] | None = None,
    leases: Callable | None = None,
    scaler: object | None = None,
    **config,
) -> Iterator[str]:
    """A real gateway (uvicorn thread) for ``managers``; yields its URL. ``leases``: the
    coordinator's state, as a split/defer job sets it; ``scaler``: rank 0's scaler of the
    elastic roles, as a job's session sets it."""
    app = InferenceGateway(
        managers, config=GatewayConfig(**config), admin_token=admin_token, renderers=renderers
    )
    app.admin.leases = leases
    if scaler is not None:
        app.scaling.scaler, app.admin.scaling = scaler, scaler.scaling
    server = GatewayServer(app, "127.0.0.1", 0)
    server.start()
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture(scope="session")
def fake() -> Iterator[FakeUpstream]:
    upstream = FakeUpstream().start()
    yield upstream
    upstream.stop()


@pytest.fixture
def upstream(fake: FakeUpstream) -> FakeUpstream:
    fake.reset()
    return fake


@pytest.fixture
def gateway_over(upstream: FakeUpstream) -> Callable:
    """``with gateway_over(role, ...) as (url, manager):`` — one role over the fake upstream."""

    @contextmanager
    def open_gateway(role: str = "teacher", engines: int = 1, routing=None, **config):
        urls = [f"{upstream.url}/e{i}" for i in range(engines)]
        manager = make_manager(role, urls, **(routing or {}))
        with serve({role: manager}, **config) as url:
            yield url, manager

    return open_gateway


@pytest.fixture
def engine_pair(tiny_server, second_tiny_server) -> Iterator[dict[str, str]]:
    """Two real engines, each labelled by its weight_version (which every generation reply
    carries in ``meta_info``): ``{label: url}``. The labels are restored afterwards."""
    pair = {"engine-a": tiny_server.url, "engine-b": second_tiny_server.url}
    before = {url: get_json(url, "/model_info", 30)["weight_version"] for url in pair.values()}
    for label, url in pair.items():
        post(url, "/update_weight_version", {"new_version": label}, 30)
    yield pair
    for url, label in before.items():
        post(url, "/update_weight_version", {"new_version": label}, 30)
