"""The gateway in front of a real SGLang engine on the CPU: generation, chat and SSE through the
official openai client, readiness after the first weight commit, the lifecycle (drain, offload,
onload) with the engine's answers unchanged, the judge form, and sglang-router route mode."""

from __future__ import annotations

import time

import httpx
import openai
import psutil
import pytest
from conftest import ADMIN_TOKEN, make_manager, serve

from relax_launch.inference.client import AsyncInferenceClient, InferenceClient
from relax_launch.inference.control_plane import chat_renderer
from relax_launch.inference.discovery import State
from relax_launch.inference.engine import EngineHandle
from relax_launch.inference.router import SGLangRouter
from relax_launch.runtime.leases import BatchFailed, LeaseError
from relax_launch.runtime.lifecycle import LifecycleCoordinator

pytestmark = pytest.mark.e2e
GREEDY = {"text": "The weather today", "sampling_params": {"max_new_tokens": 6, "temperature": 0}}
ADMIN = {"authorization": f"Bearer {ADMIN_TOKEN}"}


@pytest.fixture
def rollout(tiny_server):
    manager = make_manager("rollout", [tiny_server.url], served=tiny_server.model_path)
    with serve({"rollout": manager}) as url:
        yield url, manager
    manager.onload()  # leave the shared engine serving whatever a test did


def test_openai_client_chat_and_streaming_chat(rollout):
    url, _ = rollout
    client = openai.OpenAI(base_url=f"{url}/rollout/v1", api_key="unused")
    assert [m.id for m in client.models.list().data] == ["m"]
    messages = [{"role": "user", "content": "Say hi"}]
    fixed = {"max_tokens": 5, "extra_body": {"ignore_eos": True}}  # 5 tokens, whatever is drawn
    reply = client.chat.completions.create(model="m", messages=messages, **fixed)
    assert reply.choices[0].message.content and reply.usage.completion_tokens == 5
    chunks = list(
        client.chat.completions.create(model="m", messages=messages, stream=True, **fixed)
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert len(chunks) >= 5 and streamed
    client.close()


def test_raw_generate_keeps_logprob_fields(rollout):
    url, _ = rollout
    body = {
        "input_ids": [5, 17, 42, 99],
        "return_logprob": True,
        "logprob_start_len": 0,
        "sampling_params": {"max_new_tokens": 1, "temperature": 0},
    }
    through = httpx.post(f"{url}/rollout/generate", json=body, timeout=60).json()
    direct = httpx.post(f"{rollout[1].engines[0].url}/generate", json=body, timeout=60).json()
    assert (
        through["meta_info"]["input_token_logprobs"] == direct["meta_info"]["input_token_logprobs"]
    )


def test_readiness_flips_only_after_the_first_weight_commit(tiny_server):
    manager = make_manager("rollout", [tiny_server.url], ready=False)
    label = httpx.get(f"{tiny_server.url}/model_info").json()["weight_version"]
    with serve({"rollout": manager}) as url:
        manager.attach([EngineHandle("m/0", tiny_server.url, role="rollout", static=False)])
        assert httpx.post(f"{url}/rollout/generate", json=GREEDY).status_code == 503
        manager.weights_updating()
        handle = manager.engines[0]
        try:
            handle.call("update_weight_version", {"new_version": "7"})  # what a sync commits
            assert httpx.post(f"{url}/rollout/generate", json=GREEDY).status_code == 503
            manager.weights_committed(7)
            reply = httpx.post(f"{url}/rollout/generate", json=GREEDY, timeout=60)
            assert reply.status_code == 200 and reply.json()["meta_info"]["weight_version"] == "7"
            assert httpx.get(f"{url}/ready").status_code == 200
        finally:  # leave the shared engine's label as it was
            handle.call("update_weight_version", {"new_version": label})


def test_lifecycle_on_a_real_engine_keeps_its_answers(rollout):
    url, manager = rollout
    before = httpx.post(f"{url}/rollout/generate", json=GREEDY, timeout=60).json()["text"]
    for _ in range(2):  # idempotent
        reply = httpx.post(f"{url}/rollout/admin/offload", json={}, headers=ADMIN, timeout=120)
        assert reply.status_code == 200 and reply.json()["models"]["m"]["state"] == "SLEEPING"
    assert httpx.post(f"{url}/rollout/generate", json=GREEDY).status_code == 503
    partial = httpx.post(
        f"{url}/rollout/admin/onload", json={"tags": ["weights"]}, headers=ADMIN, timeout=120
    )
    assert partial.json()["models"]["m"]["state"] == "ONLOADING"
    assert httpx.post(f"{url}/rollout/generate", json=GREEDY).status_code == 503
    for _ in range(2):
        reply = httpx.post(f"{url}/rollout/admin/onload", json={}, headers=ADMIN, timeout=120)
        # every tag is back, but a rollout model whose weights were released serves only once
        # a weight sync has republished them
        assert reply.json()["ready"] is False, reply.json()
    assert httpx.post(f"{url}/rollout/generate", json=GREEDY).status_code == 503
    handle, label = manager.engines[0], manager.engines[0].weight_version()
    try:
        handle.call("update_weight_version", {"new_version": "8"})  # what a sync commits
        manager.weights_committed(8)
        after = httpx.post(f"{url}/rollout/generate", json=GREEDY, timeout=60).json()["text"]
    finally:  # leave the shared engine's label as it was
        handle.call("update_weight_version", {"new_version": label})
    assert after == before
    operations = [op for op, status, _ in manager.engines[0].history if status == "ok"]
    assert operations.count("release_memory_occupation") == 1
    assert operations.count("resume_memory_occupation") == 2  # weights, then the rest


def test_drain_closes_admission_until_onload(rollout):
    url, manager = rollout
    assert httpx.post(f"{url}/rollout/admin/drain", headers=ADMIN, timeout=120).status_code == 200
    assert manager.state is State.DRAINING
    assert httpx.post(f"{url}/rollout/generate", json=GREEDY).status_code == 503
    httpx.post(f"{url}/rollout/admin/onload", json={}, headers=ADMIN, timeout=120)
    assert httpx.post(f"{url}/rollout/generate", json=GREEDY, timeout=60).status_code == 200


def late_offload_done(manager, timeout_s: float) -> None:
    """Wait until the engine has answered the offload that the coordinator gave up on."""
    deadline = time.monotonic() + timeout_s
    while ("release_memory_occupation", "ok") not in [h[:2] for h in manager.engines[0].history]:
        assert time.monotonic() < deadline, f"no late offload: {list(manager.engines[0].history)}"
        time.sleep(0.1)


def test_engine_offload_timeout_keeps_the_lease_blocked_until_a_confirmed_cleanup(tiny_server):
    """Fault injection on a real engine: frozen (SIGSTOP) during an offload, the coordinator's
    lease stays BLOCKED even after the late call succeeds; a retry after recovery releases it."""
    manager = make_manager("teacher", [tiny_server.url], served=tiny_server.model_path)
    coordinator = LifecycleCoordinator(operation_timeout_s=2.0)
    coordinator.register(
        "teacher",
        ranks=(0,),
        parts=("weights", "kv_cache"),
        onload=lambda parts: manager.onload(parts),
        offload=lambda parts: manager.offload(parts),
        resident=("weights", "kv_cache"),
    )
    server = psutil.Process(tiny_server.pid)
    frozen = [server, *server.children(recursive=True)]
    coordinator.begin_batch(0)
    try:
        for process in frozen:
            process.suspend()
        with pytest.raises(LeaseError, match=r"teacher \(rank 0\): offload failed \(no answer"):
            coordinator.deactivate("teacher")
    finally:
        for process in frozen:
            process.resume()
    coordinator.operation_timeout_s = 60  # the recovery calls below get a loaded machine's time
    try:
        with pytest.raises(BatchFailed, match=r"teacher \(rank 0\)"):
            coordinator.wait_committed(0, 1)
        late_offload_done(manager, 60)  # the late offload completes ...
        assert coordinator.state()["teacher"]["lease"] == "blocked"  # ... and releases nothing
        with pytest.raises(LeaseError, match="BLOCKED"):
            coordinator.begin_batch(1)
        coordinator.deactivate("teacher")  # the cleanup, confirmed this time
        coordinator.begin_batch(1)
        coordinator.activate("teacher")
        assert coordinator.state()["teacher"]["lease"] == "active" and manager.ready
    finally:
        manager.onload()
        coordinator.close()


def test_judge_form_with_the_models_chat_template(tiny_server, tiny_model):
    manager = make_manager("genrm", [tiny_server.url], served=tiny_server.model_path)
    with serve({"genrm": manager}, renderers={"genrm": chat_renderer(tiny_model)}) as url:
        body = {
            "messages": [{"role": "user", "content": "Score this: 2+2=4"}],
            "sampling_params": {"max_new_tokens": 4},
        }
        reply = httpx.post(f"{url}/genrm/generate", json=body, timeout=60)
        body["messages"].append({"role": "assistant", "content": "Score:"})  # prefilled reply
        prefilled = httpx.post(f"{url}/genrm/generate", json=body, timeout=60)
    assert reply.status_code == 200 and isinstance(reply.json()["response"], str)
    assert set(reply.json()) == {"response"}
    assert prefilled.status_code == 200 and isinstance(prefilled.json()["response"], str)


def test_judge_prompt_continues_a_prefilled_reply(tiny_model):
    render = chat_renderer(tiny_model)
    question = [{"role": "user", "content": "Rate 2+2=4"}]
    opened = render(question, {})
    prefilled = render([*question, {"role": "assistant", "content": "Score:"}], {})
    # the prompt ends inside the assistant turn the template opened, right after the prefill
    assert prefilled.endswith("Score:") and prefilled.startswith(opened.rstrip())


@pytest.mark.asyncio
async def test_async_client_direct_and_through_gateway(rollout):
    url, _ = rollout
    for direct in (True, False):
        client = AsyncInferenceClient(url, "rollout", direct=direct)
        reply = await client.generate(GREEDY)
        async with client.stream("/generate", GREEDY) as chunks:
            streamed = b"".join([c async for c in chunks])
        await client.aclose()
        assert reply["meta_info"]["completion_tokens"] == 6
        assert streamed.rstrip().endswith(b"data: [DONE]")


def test_sync_client_resolves_again_once_on_503(tiny_server):
    manager = make_manager("rollout", [tiny_server.url], ready=False)
    with serve({"rollout": manager}) as url:
        client = InferenceClient(url, "rollout", direct=True, cache_ttl_s=60)
        client.discovery()  # cached: not ready
        manager.attach([EngineHandle("m/0", tiny_server.url, role="rollout", static=False)])
        manager.weights_valid = True
        assert client.generate(GREEDY)["meta_info"]["completion_tokens"] == 6
        client.close()


def test_router_route_mode_goes_through_sglang_router(tiny_server, tmp_path):
    router = SGLangRouter(
        worker_urls=[tiny_server.url], log_path=tmp_path / "router.log", policy="round_robin"
    )
    router.start(120)
    try:
        manager = make_manager("rollout", [], ready=False)
        manager.attach(
            [EngineHandle("m/0", tiny_server.url, role="rollout", static=False)],
            router_url=router.url,
        )
        manager.weights_valid = True
        with serve({"rollout": manager}) as url:
            discovery = httpx.get(f"{url}/rollout/engines").json()["models"]["m"]
            assert discovery["route_mode"] == "ROUTER" and discovery["router_url"] == router.url
            reply = httpx.post(f"{url}/rollout/generate", json=GREEDY, timeout=60)
            assert reply.status_code == 200 and reply.json()["meta_info"]["completion_tokens"] == 6
    finally:
        pid = router.pid
        router.stop()
    from relax_launch.processes import group_alive

    assert not group_alive(pid)
