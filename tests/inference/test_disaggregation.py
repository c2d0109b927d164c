"""A prefill/decode pair behind the gateway and the direct client, over two scripted upstreams
(real HTTP servers): each request reaches both halves with the prefill engine's bootstrap
address and one room, the decode half's reply is the answer (with the prompt's logprobs from
the prefill half when asked), a failing prefill half answers for the pair at once, and a pair
with a lost half is not routable. The real engines: ``tests/rl/test_pd_job.py``."""

from __future__ import annotations

import json
import time

import httpx
import orjson
import pytest
from conftest import make_manager, serve
from fake_upstream import FakeUpstream

from relax_launch import http
from relax_launch.inference.client import InferenceClient
from relax_launch.inference.disaggregation import with_input_logprobs
from relax_launch.inference.discovery import State
from relax_launch.inference.engine import EngineHandle
from relax_launch.inference.inprocess import EngineClients
from relax_launch.inference.process import free_port
from relax_launch.inference.router import SGLangRouter
from relax_launch.inference.routing import ModelUnavailable, RouteResolver

BOOTSTRAP_PORT = 43210
GREEDY = {"input_ids": [5, 17], "sampling_params": {"max_new_tokens": 2, "temperature": 0}}


@pytest.fixture(scope="module")
def second() -> FakeUpstream:
    upstream = FakeUpstream().start()
    yield upstream
    upstream.stop()


@pytest.fixture
def halves(upstream: FakeUpstream, second: FakeUpstream) -> tuple[FakeUpstream, FakeUpstream]:
    """(decode, prefill) upstreams, reset."""
    second.reset()
    return upstream, second


def pair_manager(decode_url: str, prefill_url: str):
    manager = make_manager("rollout", [], ready=False)
    decode = EngineHandle("m/0", decode_url, role="rollout", static=False, half="decode")
    decode.prefill_id = "m/1"
    prefill = EngineHandle("m/1", prefill_url, role="rollout", static=False, half="prefill")
    prefill.bootstrap_port = BOOTSTRAP_PORT
    manager.attach([decode, prefill])
    manager.weights_valid = True
    return manager


def bodies(upstream: FakeUpstream) -> list[dict]:
    return [json.loads(r["body"]) for r in upstream.requests]


def test_a_request_reaches_both_halves_with_one_bootstrap_room(halves):
    decode, prefill = halves
    manager = pair_manager(f"{decode.url}/d", f"{prefill.url}/p")
    with serve({"rollout": manager}) as url:
        reply = httpx.post(f"{url}/rollout/generate", json=GREEDY, timeout=30)
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        chatted = httpx.post(f"{url}/rollout/v1/chat/completions", json=chat, timeout=30)
        with httpx.stream(
            "POST", f"{url}/rollout/v1/completions", json={"prompt": "a", "stream": True}
        ) as streamed:
            chunks = b"".join(streamed.iter_bytes())
    assert reply.status_code == 200 and reply.json()["path"] == "/d/generate"
    assert chatted.status_code == 200 and chatted.json()["path"] == "/d/v1/chat/completions"
    assert chunks.endswith(b"data: [DONE]\n\n")  # the decode half's stream
    assert [r["path"] for r in prefill.requests] == [
        "/p/generate",
        "/p/v1/chat/completions",
        "/p/v1/completions",
    ]
    for sent_decode, sent_prefill in zip(bodies(decode), bodies(prefill), strict=True):
        assert sent_decode == sent_prefill  # the same request, one room
        assert sent_decode["bootstrap_host"] == "127.0.0.1"
        assert sent_decode["bootstrap_port"] == BOOTSTRAP_PORT
    rooms = [b["bootstrap_room"] for b in bodies(decode)]
    assert len(set(rooms)) == 3  # a fresh room per request


def test_a_failing_prefill_half_answers_for_the_pair_at_once(halves):
    decode, prefill = halves
    decode.reset("held")  # the decode half answers only once released
    prefill.reset("error_400")
    manager = pair_manager(f"{decode.url}/d", f"{prefill.url}/p")
    with serve({"rollout": manager}) as url:
        try:
            reply = httpx.post(f"{url}/rollout/generate", json=GREEDY, timeout=30)
            answered = decode.answered  # what the decode half had answered by then
        finally:
            decode.release()  # else a failure above leaves the gateway's close waiting on it
    # at once: before the decode half answered, not after it
    assert reply.status_code == 400 and answered == 0, reply.text
    assert "prefill engine m/1" in reply.json()["error"]["message"]


def test_an_unreachable_prefill_half_is_a_502_naming_it(upstream):
    gone = f"http://127.0.0.1:{free_port()}"
    manager = pair_manager(f"{upstream.url}/d", gone)
    with serve({"rollout": manager}) as url:
        reply = httpx.post(f"{url}/rollout/generate", json=GREEDY, timeout=30)
        upstream.reset("hang_after_first")  # the decode half's stream would never end alone
        with httpx.stream(
            "POST", f"{url}/rollout/generate", json={**GREEDY, "stream": True}, timeout=30
        ) as streamed:
            streamed.read()  # ended by the gateway once its prefill half failed (else a timeout)
    assert reply.status_code == 502 and f"prefill engine m/1 ({gone})" in reply.text
    deadline = time.monotonic() + 60  # only a hang: it closes at once
    while upstream.disconnects == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert upstream.disconnects == 1  # the decode half's stream was closed, not left open


def test_a_gone_prefill_half_takes_its_pair_out_and_the_request_goes_to_another(halves):
    """rollout.fault_tolerance with two pairs: a request whose prefill half refuses it (its
    server is gone) takes that prefill engine out of routing, not its live decode engine, and
    is generated again by the other pair, counted as regenerated."""
    decode, prefill = halves
    gone = f"http://127.0.0.1:{free_port()}"
    manager = make_manager("rollout", [], ready=False)
    handles = []
    for pair, (decode_url, prefill_url) in enumerate(
        [(f"{decode.url}/dA", gone), (f"{decode.url}/dB", f"{prefill.url}/pB")]
    ):
        decode_half = EngineHandle(f"m/{2 * pair}", decode_url, "rollout", False, half="decode")
        decode_half.prefill_id = f"m/{2 * pair + 1}"
        prefill_half = EngineHandle(f"m/{2 * pair + 1}", prefill_url, "rollout", False)
        prefill_half.half, prefill_half.bootstrap_port = "prefill", BOOTSTRAP_PORT
        handles += [decode_half, prefill_half]
    manager.attach(handles)
    manager.weights_valid, manager.fault_tolerant = True, True
    engines = EngineClients({"rollout": manager}, timeout_s=10)
    engines.start()
    try:
        client = engines.client("rollout")
        replies = [engines.run(client.request("/generate", GREEDY), "gen") for _ in range(2)]
    finally:
        engines.close()
    assert [r["path"] for r in replies] == ["/dB/generate"] * 2  # one of them went to A first
    assert list(manager.lost) == ["m/1"] and manager.lost["m/1"].startswith(f"upstream {gone}")
    assert manager.requests.regenerated == 1
    assert [e.engine_id for e in manager.serving()] == ["m/0", "m/2", "m/3"]  # A's decode half
    (record,) = [r for r in manager.snapshot().models["m"].engines if r.engine_id == "m/0"]
    assert record.state is State.FAILED  # but not routable without its prefill half


def test_the_direct_client_sends_to_both_halves(halves):
    decode, prefill = halves
    manager = pair_manager(f"{decode.url}/d", f"{prefill.url}/p")
    client = InferenceClient(
        "http://unused", "rollout", direct=True, snapshot_provider=manager.snapshot
    )
    try:
        assert client.generate(GREEDY)["path"] == "/d/generate"
        with client.stream("/generate", GREEDY) as chunks:
            assert b"".join(chunks).endswith(b"data: [DONE]\n\n")
    finally:
        client.close()
    assert [r["path"] for r in prefill.requests] == ["/p/generate", "/p/generate"]
    assert bodies(decode)[0]["bootstrap_room"] == bodies(prefill)[0]["bootstrap_room"]


def test_discovery_lists_the_pair_once_and_a_lost_half_takes_it_out(upstream):
    manager = pair_manager(f"{upstream.url}/d", f"{upstream.url}/p")
    (record,) = manager.snapshot().models["m"].engines
    assert record.engine_id == "m/0" and record.direct_eligible
    assert record.prefill.engine_id == "m/1" and record.prefill.bootstrap_port == BOOTSTRAP_PORT
    target = RouteResolver().resolve(manager.snapshot())
    assert (target.prefill.bootstrap_host, target.prefill.url) == ("127.0.0.1", f"{upstream.url}/p")
    manager.engine_lost("m/1", "its server died")
    (record,) = manager.snapshot().models["m"].engines
    assert record.state is State.FAILED and not record.direct_eligible and record.prefill is None
    with pytest.raises(ModelUnavailable, match="no ready engine"):
        RouteResolver().resolve(manager.snapshot())


def test_the_prompt_logprobs_come_from_the_prefill_half_when_asked():
    decoded = {"text": "x", "meta_info": {"input_token_logprobs": [], "id": "d"}}
    prefilled = {"meta_info": {"input_token_logprobs": [[-1.0, 5], [-2.0, 17]]}}
    reply = http.Reply(200, {}, orjson.dumps(prefilled))
    asked = orjson.dumps({**GREEDY, "return_logprob": True})
    merged = orjson.loads(with_input_logprobs(orjson.dumps(decoded), reply, asked))
    assert merged["meta_info"] == {"input_token_logprobs": [[-1.0, 5], [-2.0, 17]], "id": "d"}
    batch = orjson.dumps([decoded, decoded])
    both = orjson.loads(
        with_input_logprobs(batch, http.Reply(200, {}, orjson.dumps([prefilled] * 2)), asked)
    )
    assert [m["meta_info"]["input_token_logprobs"] for m in both] == [[[-1.0, 5], [-2.0, 17]]] * 2
    untouched = orjson.dumps(decoded)
    assert with_input_logprobs(untouched, reply, orjson.dumps(GREEDY)) == untouched
    assert with_input_logprobs(untouched, None, asked) == untouched
    assert with_input_logprobs(b'{"error": "x"}', reply, asked) == b'{"error": "x"}'


def test_sglang_router_routes_a_pair_in_its_prefill_decode_mode(tmp_path):
    router = SGLangRouter(
        worker_urls=[],
        prefill=[("http://127.0.0.1:31100", 31190)],
        decode_urls=["http://127.0.0.1:31200"],
        log_path=tmp_path / "router.log",
        policy="round_robin",
    )
    args = router.command()
    assert "--worker-urls" not in args
    pd = args[args.index("--pd-disaggregation") :]
    assert pd == [
        "--pd-disaggregation",
        "--prefill",
        "http://127.0.0.1:31100",
        "31190",
        "--decode",
        "http://127.0.0.1:31200",
    ]
