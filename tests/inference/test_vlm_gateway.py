"""Images through the real gateway and the controller's client to SGLang's CPU engine serving
the tiny Qwen2.5-VL: an image chat with the official ``openai`` client whose prompt token ids are
the trainer processor's (image placeholders included), bad images answered 400 (the client's
``BadRequestError``), and an agentic conversation whose tool returns an image, recorded token in,
token out, and scored again by the engine to the same logprobs."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from conftest import make_manager, serve
from test_vlm_engine import tiny_vlm_server

from relax_launch.inference.client import InferenceError
from relax_launch.inference.image_config import ImageLimits
from relax_launch.inference.images import ImagePolicy
from relax_launch.inference.inprocess import EngineClients
from relax_launch.inference.server import SGLangServer
from relax_launch.models.build import ensure_model
from relax_launch.models.vlm_processor import VisionProcessor
from relax_launch.rl.agent import AgentClient
from relax_launch.rl.agent_images import collapsed
from relax_launch.rl.visual_tasks import data_url, draw_shapes

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def vlm_engine(tmp_path_factory) -> Iterator[tuple[Path, SGLangServer]]:
    """The tiny Qwen2.5-VL on SGLang's CPU engine (``tiny_vlm_server``)."""
    model = ensure_model("builtin:tiny-qwen2.5-vl")
    server = tiny_vlm_server(model, tmp_path_factory.mktemp("vlm") / "engine.log")
    server.start(timeout_s=300)
    try:
        yield model, server
    finally:
        server.stop()


def vlm_manager(model: Path, server: SGLangServer):
    manager = make_manager("rollout", [server.url], served=str(model))
    served = dataclasses.replace(manager.models["m"], vocab_size=384, image_token_id=8)
    manager.models["m"] = served
    return manager


def shapes(size: tuple[int, int]):
    image = draw_shapes({0: ("red", "circle"), 4: ("blue", "square"), 8: ("red", "circle")})
    return image.resize(size)


def user(image_url: str, text: str) -> dict:
    parts = [{"type": "image_url", "image_url": {"url": image_url}}, {"type": "text", "text": text}]
    return {"role": "user", "content": parts}


def test_image_chat_through_the_gateway_with_the_openai_client(vlm_engine, tmp_path):
    model, server = vlm_engine
    image = shapes((84, 56))  # 4 x 6 patches of 14: 6 image tokens after the 2 x 2 merge
    image.save(tmp_path / "shapes.png")
    processor = VisionProcessor(model)
    messages = [user(data_url(image), "How many red circles?")]
    expected = processor.encode_chat(messages, [image]).ids
    limits = {"allowed_dirs": [str(tmp_path)], "max_bytes": 200_000, "max_pixels": 100_000}
    with serve({"rollout": vlm_manager(model, server)}, images=limits) as url:
        client = openai.OpenAI(base_url=f"{url}/rollout/v1", api_key="unused")
        answer = client.chat.completions.create(
            model="m", messages=messages, max_tokens=4, temperature=0
        )
        from_file = client.chat.completions.create(
            model="m",
            messages=[user(f"file://{tmp_path}/shapes.png", "How many red circles?")],
            max_tokens=4,
            temperature=0,
        )
        refusals = {}
        for what, url_given in (
            ("remote", "https://example.com/shapes.png"),
            ("wrong type", "data:image/png;base64,aGVsbG8="),
            ("oversized", data_url(shapes((400, 300)))),
            ("outside", "/etc/hostname"),
        ):
            with pytest.raises(openai.BadRequestError) as refused:
                client.chat.completions.create(
                    model="m", messages=[user(url_given, "Hi")], max_tokens=2
                )
            refusals[what] = refused.value
    prompt_ids = answer.choices[0].model_extra["prompt_token_ids"]
    print(f"engine prompt ids {prompt_ids}\ntrainer ids {expected}")
    assert prompt_ids == expected  # image placeholders where the trainer's processor puts them
    assert expected.count(processor.image_token_id) == 6
    assert answer.usage.prompt_tokens == len(expected)
    assert from_file.choices[0].model_extra["prompt_token_ids"] == expected
    assert all(r.status_code == 400 for r in refusals.values())
    assert "not fetched" in refusals["remote"].message
    assert "not a decodable" in refusals["wrong type"].message
    assert "exceeds 100000 pixels" in refusals["oversized"].message
    assert "not allowed" in refusals["outside"].message


async def look_again(prompt, client) -> list[dict]:
    """A rollout function: the model answers about an image, then a tool shows it another."""
    messages = [user(prompt["first"], "Count the shapes.")]
    first = await client.chat.completions.create(messages=messages, max_tokens=3)
    messages.append(first.choices[0].message.model_dump(exclude_none=True))
    shown = [
        {"type": "text", "text": "zoomed:"},
        {"type": "image_url", "image_url": {"url": prompt["second"]}},
    ]
    messages.append({"role": "tool", "content": shown, "tool_call_id": "call_0"})
    second = await client.chat.completions.create(messages=messages, max_tokens=3)
    return [*messages, second.choices[0].message.model_dump(exclude_none=True)]


def test_an_agentic_turn_with_a_tool_image_is_token_in_token_out(vlm_engine):
    model, server = vlm_engine
    processor = VisionProcessor(model)
    first, second = shapes((84, 56)), shapes((56, 56))
    urls = {"first": data_url(first), "second": data_url(second)}
    engines = EngineClients(
        {"rollout": vlm_manager(model, server)}, timeout_s=120, images=ImagePolicy(ImageLimits())
    )
    engines.start()
    rollout = engines.client("rollout")
    agent = AgentClient(
        functools.partial(rollout.request, "/generate"), processor.tokenizer, 1.0, budget=64
    )
    try:
        engines.run(look_again(urls, agent), "the conversation")
        t = agent.trajectory
        sequence = t.prompt_ids + t.ids
        pad = processor.image_token_id
        expanded = {"input_ids": sequence, "image_data": list(urls.values())}
        with pytest.raises(InferenceError, match="one placeholder token 8"):  # hangs SGLang
            engines.run(rollout.request("/generate", expanded), "expanded ids")
        rescored = engines.run(
            rollout.request(
                "/generate",
                {
                    "input_ids": collapsed(sequence, processor.image_token_id),
                    "image_data": list(urls.values()),
                    "sampling_params": {"max_new_tokens": 1},
                    "return_logprob": True,
                    "logprob_start_len": 0,
                    "return_prompt_token_ids": True,
                },
            ),
            "rescoring",
        )
    finally:
        engines.close()
    assert t.rejected is None and t.turns == 2
    first_prompt = processor.encode_chat([user(urls["first"], "Count the shapes.")], [first]).ids
    assert t.prompt_ids == first_prompt  # the first turn's context: the trainer's ids
    assert sequence.count(pad) == 6 + 4  # both images' placeholders, each at the engine's length
    assert all(m == 0 for m, token in zip(t.mask, t.ids, strict=True) if token == pad)
    assert 0 < sum(t.mask) <= 6 and t.images == list(urls.values())
    assert rescored["prompt_token_ids"] == sequence  # the engine reads the record as it was made
    scored = [lp for lp, _, _ in rescored["meta_info"]["input_token_logprobs"][len(t.prompt_ids) :]]
    trained = [(s, r) for s, r, m in zip(scored, t.logprobs, t.mask, strict=True) if m]
    print(f"recorded vs rescored logprobs of the engine's tokens: {trained}")
    assert max(abs(s - r) for s, r in trained) <= TOLERANCE
