"""Gateway contracts against a real gateway (uvicorn on 127.0.0.1) and a scripted upstream that
records what reached the "engine": routing, refusals before any engine call, byte-faithful
forwarding, SSE piping and closing, error mapping, admin auth, the GenRM judge form."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from conftest import ADMIN_TOKEN, make_manager, serve
from fake_upstream import SSE_CHUNKS
from prometheus_client.parser import text_string_to_metric_families

from relax_launch.inference.client import InferenceClient
from relax_launch.inference.discovery import State

GEN = {"text": "hi", "sampling_params": {"max_new_tokens": 2}}


def test_sleeping_model_has_discovery_and_liveness_but_no_engine_call(gateway_over, upstream):
    with gateway_over("teacher") as (url, manager):
        manager.state = State.SLEEPING
        reply = httpx.post(f"{url}/teacher/generate", json=GEN)
        assert reply.status_code == 503 and reply.headers["retry-after"] == "1"
        assert "SLEEPING" in reply.json()["error"]["message"]
        engines = httpx.get(f"{url}/teacher/engines").json()
        assert engines["models"]["m"]["state"] == "SLEEPING"
        assert httpx.get(f"{url}/health").json()["alive"] is True
        assert httpx.get(f"{url}/ready").status_code == 503
    assert upstream.requests == []


def test_health_is_alive_before_any_role_is_ready(upstream):
    manager = make_manager("rollout", [], ready=False)
    with serve({"rollout": manager}) as url:
        health = httpx.get(f"{url}/rollout/health").json()
        assert health["gateway_alive"] and not health["ready"]
        assert health["models"]["m"]["state"] == "STARTING"
        assert httpx.get(f"{url}/health").json() == {
            "alive": True,
            "ready": False,
            "roles": {"rollout": False},
        }


@pytest.mark.parametrize(
    "path,body,message",
    [
        ("generate", b"{not json", "not valid JSON"),
        ("generate", b"[1, 2]", "JSON object"),
        ("generate", b'{"text": "a", "input_ids": [1]}', "exactly one of"),
        ("generate", b'{"sampling_params": {}}', "exactly one of"),
        ("generate", b'{"text": "a", "stream": "yes"}', "stream"),
        ("generate", b'{"text": "a", "sampling_params": {"temperature": -1}}', "temperature"),
        ("generate", b'{"text": "a", "sampling_params": {"max_tokens": 3}}', "max_tokens"),
        ("generate", b'{"text": "a", "sampling_params": {"regex": "(1"}}', "not a regular"),
        ("generate", b'{"text": "a", "model": 7}', "model"),
        ("generate", b'{"messages": [{"role": "user", "content": "x"}]}', "genrm"),
        ("v1/chat/completions", b'{"messages": "hello"}', "messages"),
        ("v1/chat/completions", b'{"messages": []}', "messages"),
        ("v1/completions", b'{"max_tokens": 3}', "prompt"),
        ("generate", b'{"input_ids": [1, 320]}', "outside the vocabulary"),
        ("generate", b'{"text": ""}', "text"),
        ("generate", b'{"input_ids": []}', "input_ids"),
        ("generate", b'{"input_ids": [[1], []]}', "input_ids"),
        ("v1/completions", b'{"prompt": ""}', "prompt"),
        ("generate", b'{"input_ids": [[1], [-1]]}', "outside the vocabulary"),
        ("v1/completions", b'{"prompt": [5, 9999]}', "outside the vocabulary"),
    ],
)
def test_invalid_payload_is_refused_before_any_engine(gateway_over, upstream, path, body, message):
    with gateway_over("teacher") as (url, _):
        reply = httpx.post(f"{url}/teacher/{path}", content=body)
    assert reply.status_code == 400 and message in reply.json()["error"]["message"]
    assert upstream.requests == []


def test_explicit_unknown_model_never_falls_back(gateway_over, upstream):
    with gateway_over("teacher", routing={"route_key_map": {"math": "m"}}) as (url, _):
        for body in ({**GEN, "model": "other"}, {**GEN, "model": "other", "route_key": "math"}):
            reply = httpx.post(f"{url}/teacher/generate", json=body)
            assert reply.status_code == 400 and "no model 'other'" in reply.text
        assert (
            httpx.post(f"{url}/teacher/generate", json={**GEN, "route_key": "x"}).status_code == 400
        )
        assert (
            httpx.post(f"{url}/teacher/generate", json={**GEN, "route_key": "math"}).status_code
            == 200
        )
    assert len(upstream.requests) == 1


def test_generate_is_byte_faithful_minus_routing_fields(gateway_over, upstream):
    raw = (
        b'{"input_ids": [1, 2, 3],  "return_logprob": true, "logprob_start_len": 0, '
        b'"token_ids_logprob": [5, 9], "rid": "req-1", '
        b'"sampling_params": {"max_new_tokens": 1, "temperature": 0.0}}'
    )
    with gateway_over("teacher", routing={"aliases": {"teacher-ckpt": "m"}}) as (url, _):
        assert httpx.post(f"{url}/teacher/generate", content=raw).status_code == 200
        routed = json.loads(raw) | {"model": "teacher-ckpt", "route_key": None}
        del routed["route_key"]
        assert httpx.post(f"{url}/teacher/generate", json=routed).status_code == 200
    assert upstream.requests[0]["body"] == raw  # untouched, whitespace and all
    second = json.loads(upstream.requests[1]["body"])
    assert second == json.loads(raw)  # model removed, every other field preserved
    assert upstream.requests[0]["path"] == "/e0/generate"


def test_chat_normalizes_the_model_and_strips_transport_headers(gateway_over, upstream):
    headers = {
        "connection": "keep-alive, x-secret",
        "x-secret": "1",
        "keep-alive": "timeout=5",
        "cookie": "a=b",
        "x-smg-routing-key": "s1",
        "authorization": "Bearer user",
        "x-request-id": "req-7",
    }
    body = {"model": "m", "route_key": None, "messages": [{"role": "user", "content": "hi"}]}
    with gateway_over("teacher") as (url, _):
        reply = httpx.post(f"{url}/teacher/chat/completions", json=body, headers=headers)
    assert reply.status_code == 200 and reply.headers["x-request-id"] == "upstream-1"
    sent = upstream.requests[0]
    assert sent["path"] == "/e0/v1/chat/completions"
    assert json.loads(sent["body"])["model"] == "/models/m"  # the engine's served name
    assert "route_key" not in json.loads(sent["body"])
    assert sent["headers"]["authorization"] == "Bearer user"
    assert sent["headers"]["x-request-id"] == "req-7"
    for dropped in ("x-secret", "keep-alive", "cookie", "x-smg-routing-key"):
        assert dropped not in sent["headers"], dropped


def test_stream_preserves_sse_bytes_and_calls_upstream_once(gateway_over, upstream):
    body = {"messages": [{"role": "user", "content": "hi"}], "stream": True}
    with gateway_over("teacher") as (url, _):
        with httpx.stream("POST", f"{url}/teacher/v1/chat/completions", json=body) as reply:
            assert reply.status_code == 200
            assert reply.headers["content-type"].startswith("text/event-stream")
            received = b"".join(reply.iter_raw())
        direct = InferenceClient(url, "teacher", direct=True)
        with direct.stream("/v1/chat/completions", body) as chunks:
            direct_bytes = b"".join(chunks)
        direct.close()
    assert received == direct_bytes == b"".join(SSE_CHUNKS)
    assert len(upstream.requests) == 2  # one per stream, never replayed


@pytest.mark.parametrize("status", [400, 503])
def test_stream_upstream_error_is_an_http_error_before_headers(gateway_over, upstream, status):
    upstream.reset("error_400")
    body = {"text": "hi", "stream": True}
    with gateway_over("teacher") as (url, manager):
        if status == 503:
            manager.state = State.DRAINING
        reply = httpx.post(f"{url}/teacher/generate", json=body)
    assert reply.status_code == status
    assert reply.headers["content-type"].startswith("application/json")


def test_stream_failure_after_first_chunk_is_never_replayed(gateway_over, upstream):
    upstream.reset("fail_after_first")
    with gateway_over("teacher") as (url, _):
        with httpx.stream("POST", f"{url}/teacher/generate", json={**GEN, "stream": True}) as r:
            assert r.status_code == 200
            received = b"".join(r.iter_raw())
        assert httpx.get(f"{url}/health").status_code == 200  # the gateway carries on
    assert received == SSE_CHUNKS[0]
    assert len(upstream.requests) == 1


def test_client_disconnect_closes_the_upstream_stream(gateway_over, upstream):
    upstream.reset("hang_after_first")
    with gateway_over("teacher") as (url, _):
        with httpx.stream("POST", f"{url}/teacher/generate", json={**GEN, "stream": True}) as r:
            assert next(r.iter_raw()) == SSE_CHUNKS[0]
        deadline = time.monotonic() + 60  # only a hang: it closes at once
        while upstream.disconnects == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
    assert upstream.disconnects == 1 and len(upstream.requests) == 1


def test_stream_deadline_closes_the_upstream(gateway_over, upstream):
    upstream.reset("hang_after_first")
    with gateway_over("teacher", request_timeout_s=1.0) as (url, _):
        # without the gateway's deadline the read would hang, then raise httpx.ReadTimeout
        body = {**GEN, "stream": True}
        with httpx.stream("POST", f"{url}/teacher/generate", json=body, timeout=30) as r:
            received = b"".join(r.iter_raw())
        deadline = time.monotonic() + 60  # only a hang: it closes at once
        while upstream.disconnects == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
    assert received == SSE_CHUNKS[0]
    assert upstream.disconnects == 1


def test_timeout_is_504_and_unreachable_engine_is_502(gateway_over, upstream):
    upstream.reset("held")
    with gateway_over("teacher", request_timeout_s=1.0) as (url, _):
        reply = httpx.post(f"{url}/teacher/generate", json=GEN, timeout=30)
        assert reply.status_code == 504 and "did not answer" in reply.text
    upstream.release()
    dead = make_manager("teacher", ["http://127.0.0.1:9"])
    with serve({"teacher": dead}) as url:
        reply = httpx.post(f"{url}/teacher/generate", json=GEN)
        assert reply.status_code == 502 and "unavailable" in reply.text


def test_body_above_the_limit_is_413(gateway_over, upstream):
    with gateway_over("teacher", max_body_bytes=2048) as (url, _):
        reply = httpx.post(f"{url}/teacher/generate", json={"text": "x" * 4096})
    assert reply.status_code == 413 and upstream.requests == []


@pytest.mark.parametrize("role", ["rollout", "genrm", "teacher"])
def test_gateway_and_direct_client_choose_the_same_engine(gateway_over, upstream, role):
    keys = [f"session-{i}" for i in range(12)]
    with gateway_over(role, engines=4, routing={"policy": "affinity"}) as (url, _):
        direct = InferenceClient(url, role, direct=True)
        for key in keys:
            direct.generate(GEN, affinity_key=key)
        through_gateway = InferenceClient(url, role)
        for key in keys:
            through_gateway.generate(GEN, affinity_key=key)
        direct.close()
        through_gateway.close()
    engine = [r["path"].split("/")[1] for r in upstream.requests]
    assert engine[:12] == engine[12:]  # the same engine for the same key, both ways
    assert len(set(engine)) > 1


@pytest.mark.parametrize("policy", ["round_robin", "affinity"])
def test_routing_key_reaches_the_router_only_under_affinity(upstream, policy):
    """The scripted upstream stands in for sglang-router (route mode router)."""
    manager = make_manager("rollout", [], ready=False, policy=policy)
    manager.attach([], router_url=f"{upstream.url}/router")
    manager.weights_valid = True
    key = {"x-smg-routing-key": "session-3"}
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    with serve({"rollout": manager}, routing_policy=policy) as url:
        assert httpx.post(f"{url}/rollout/generate", json=GEN, headers=key).status_code == 200
        assert httpx.post(f"{url}/rollout/v1/chat/completions", json=chat, headers=key).is_success
        direct = InferenceClient(url, "rollout", direct=True)
        direct.generate(GEN, affinity_key="session-3")
        direct.close()
    sent = [r["headers"].get("x-smg-routing-key") for r in upstream.requests]
    assert [r["path"] for r in upstream.requests] == [
        "/router/generate",
        "/router/v1/chat/completions",
        "/router/generate",
    ]
    assert sent == (["session-3"] * 3 if policy == "affinity" else [None] * 3)


def test_admin_routes_need_the_token(gateway_over, upstream):
    with gateway_over("teacher", admin_token=None) as (url, _):
        reply = httpx.post(f"{url}/teacher/admin/offload", json={})
        assert reply.status_code == 401 and "RELAX_ADMIN_TOKEN" in reply.text
    with gateway_over("teacher") as (url, manager):
        for auth in ({}, {"authorization": "Bearer wrong"}):
            assert httpx.post(f"{url}/teacher/admin/drain", headers=auth).status_code == 401
            assert httpx.get(f"{url}/teacher/admin/engines", headers=auth).status_code == 401
        assert manager.state is State.READY
        good = {"authorization": f"Bearer {ADMIN_TOKEN}"}
        engines = httpx.get(f"{url}/teacher/admin/engines", headers=good).json()
        assert engines["engines"][0]["loaded"] == ["cuda_graph", "kv_cache", "weights"]
    assert upstream.requests == []


def test_coordinated_roles_show_their_lease_and_refuse_admin_memory_operations(
    gateway_over, upstream
):
    lease = {"lease": "sleeping", "resident": [], "ranks": [0]}
    with gateway_over("teacher", leases=lambda: {"teacher": lease}) as (url, manager):
        good = {"authorization": f"Bearer {ADMIN_TOKEN}"}
        assert httpx.get(f"{url}/teacher/admin/engines", headers=good).json()["lease"] == lease
        for op in ("drain", "offload", "onload"):
            reply = httpx.post(f"{url}/teacher/admin/{op}", json={}, headers=good)
            assert reply.status_code == 409 and "coordinator" in reply.text, reply.text
        assert manager.state is State.READY
    assert upstream.requests == []


def test_no_weight_mutation_route_is_exposed(gateway_over, upstream):
    with gateway_over("teacher") as (url, _):
        for op in ("update_weights_from_disk", "init_weights_update_group", "load_lora_adapter"):
            assert httpx.post(f"{url}/teacher/{op}", json={}).status_code == 404
        reply = httpx.post(f"{url}/genrm/generate", json=GEN)
        assert reply.status_code == 404 and "no genrm role" in reply.text
    assert upstream.requests == []


def judge_manager(upstream):
    return make_manager("genrm", [f"{upstream.url}/e0"], route_key_map={"math": "m"})


def test_genrm_judge_form_renders_and_answers_legacy_shape(upstream):
    rendered = []

    def render(messages, kwargs):
        rendered.append((messages, kwargs))
        return "<judge>" + messages[-1]["content"]

    body = {
        "messages": [{"role": "user", "content": "2+2=4?"}],
        "sampling_params": {"max_new_tokens": 9},
        "chat_template_kwargs": {"enable_thinking": False},
        "route_key": "math",
    }
    with serve({"genrm": judge_manager(upstream)}, renderers={"genrm": render}) as url:
        reply = httpx.post(f"{url}/genrm/generate", json=body)
        unknown = httpx.post(f"{url}/genrm/generate", json={**body, "route_key": "nope"})
    assert reply.status_code == 200 and reply.json() == {"response": "judged: 7"}
    assert rendered == [(body["messages"], {"enable_thinking": False})]
    sent = json.loads(upstream.requests[0]["body"])
    assert sent == {
        "text": "<judge>2+2=4?",
        "sampling_params": {"temperature": 0.0, "max_new_tokens": 9},
    }
    assert unknown.status_code == 400 and len(upstream.requests) == 1


def test_genrm_judge_form_refuses_bad_template_input_before_the_engine(upstream):
    def render(messages, kwargs):
        raise ValueError("unknown role layout")

    with serve({"genrm": judge_manager(upstream)}, renderers={"genrm": render}) as url:
        messages = [{"role": "user", "content": "x"}]
        bad_kwargs = httpx.post(
            f"{url}/genrm/generate", json={"messages": messages, "chat_template_kwargs": [1]}
        )
        rejected = httpx.post(f"{url}/genrm/generate", json={"messages": messages})
    assert bad_kwargs.status_code == 400 and "chat_template_kwargs" in bad_kwargs.text
    assert rejected.status_code == 400 and "unknown role layout" in rejected.text
    assert upstream.requests == []


def test_genrm_rechecks_state_after_rendering(upstream):
    manager = judge_manager(upstream)

    def render(messages, kwargs):
        manager.state = State.SLEEPING  # went to sleep while the prompt was rendered
        return "prompt"

    with serve({"genrm": manager}, renderers={"genrm": render}) as url:
        reply = httpx.post(
            f"{url}/genrm/generate", json={"messages": [{"role": "user", "content": "x"}]}
        )
    assert reply.status_code == 503 and upstream.requests == []


def test_genrm_rendering_obeys_the_request_deadline(upstream):
    release = threading.Event()

    def render(messages, kwargs):
        release.wait(10)
        return "late"

    config = {"renderers": {"genrm": render}, "request_timeout_s": 0.5}
    with serve({"genrm": judge_manager(upstream)}, **config) as url:
        reply = httpx.post(
            f"{url}/genrm/generate", json={"messages": [{"role": "user", "content": "x"}]}
        )
        release.set()
    assert reply.status_code == 504 and upstream.requests == []


def sample(exposition: str, name: str, **labels: str) -> float | None:
    """The value of sample ``name{labels}`` in a Prometheus text exposition (None: absent)."""
    for family in text_string_to_metric_families(exposition):
        for found in family.samples:
            if found.name == name and found.labels == labels:
                return found.value
    return None


def test_metrics_count_requests_by_role_model_and_status(gateway_over, upstream):
    with gateway_over("teacher") as (url, manager):
        httpx.post(f"{url}/teacher/generate", json=GEN)
        httpx.post(f"{url}/teacher/generate", content=b"nope")
        text = httpx.get(f"{url}/metrics").text
    requests, where = "relax_gateway_requests_total", {"role": "teacher", "endpoint": "generate"}
    assert sample(text, requests, **where, model="m", status="200") == 1
    assert sample(text, requests, **where, model="-", status="400") == 1
    assert sample(text, "relax_gateway_request_seconds_count", **where) == 2
    assert sample(text, "relax_gateway_in_flight", role="-") == 1  # the /metrics request itself
    assert sample(text, "relax_model_ready", role="teacher", model="m") == 1


def test_gateways_in_one_process_count_apart(upstream):
    """Each gateway has a registry of its own (two on the process-wide one would collide)."""
    first, second = (make_manager("teacher", [f"{upstream.url}/e0"]) for _ in range(2))
    with serve({"teacher": first}) as url_a, serve({"teacher": second}) as url_b:
        httpx.post(f"{url_a}/teacher/generate", json=GEN)
        counts = [
            sample(
                httpx.get(f"{url}/metrics").text,
                "relax_gateway_request_seconds_count",
                role="teacher",
                endpoint="generate",
            )
            for url in (url_a, url_b)
        ]
    assert counts == [1, None]
