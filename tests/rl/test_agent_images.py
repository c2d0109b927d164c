"""The recorded context of an agentic turn with images becomes the engine's (each placeholder run
stretched to its length, context masked out), and a re-tokenisation that changed any other token
rejects the conversation. tests/inference/test_vlm_gateway.py runs it against the real engine."""

from __future__ import annotations

import asyncio
import base64
import io

import pytest
from PIL import Image

from relax_launch.inference.image_config import ImageLimits
from relax_launch.inference.images import ImagePolicy, ImageRefused
from relax_launch.rl.agent import Trajectory
from relax_launch.rl.agent_images import (
    ConversationImages,
    as_the_engine_saw,
    collapsed,
    image_request,
    sources,
)
from relax_launch.rl.vision_prompts import image_bytes, open_image

PAD = 8


class Tokenizer:
    def convert_tokens_to_ids(self, token: str) -> int:
        assert token == "<|image_pad|>"
        return PAD


def test_runs_collapse_and_map_back():
    assert collapsed([1, 8, 8, 8, 2, 8, 3], PAD) == [1, 8, 2, 8, 3]
    assert sources([1, 8, 2], [1, 8, 8, 8, 2], PAD) == [0, 1, 1, 1, 2]
    assert sources([1, 8, 8, 2, 8, 3], [1, 8, 8, 2, 8, 8, 3], PAD) == [0, 1, 2, 3, 4, 4, 5]
    assert sources([1, 8, 2], [1, 8, 8, 5], PAD) is None  # another token than sent
    assert sources([1, 2, 2, 8], [1, 2, 8, 8], PAD) is None


def test_a_turn_with_images_sends_one_placeholder_per_image():
    context = [1, 8, 8, 8, 2, 40, 41, 3, 8, 4]
    assert image_request(context, ["data:a", "data:b"], Tokenizer()) == {
        "input_ids": [1, 8, 2, 40, 41, 3, 8, 4],
        "image_data": ["data:a", "data:b"],
        "return_prompt_token_ids": True,
    }
    assert image_request([1, 2], [], Tokenizer()) == {}


def image(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def encoded(size: tuple[int, int], kind: str = "PNG") -> bytes:
    buffer = io.BytesIO()
    Image.effect_noise(size, 60).convert("RGB").save(buffer, format=kind)
    return buffer.getvalue()


def data_url(raw: bytes, kind: str = "image/png") -> str:
    return f"data:{kind};base64," + base64.b64encode(raw).decode()


def tool_turn(*urls: str) -> list[dict]:
    """The prompt's image (``data:own``), a reply, then a tool result showing ``urls``."""
    return [
        {"role": "user", "content": [image("data:own"), {"type": "text", "text": "how many?"}]},
        {"role": "assistant", "content": "zoom"},
        {"role": "tool", "name": "zoom", "content": [image(u) for u in urls]},
    ]


def test_user_codes_images_are_marked_where_they_are_the_prompts_are_not():
    conversation = tool_turn("data:b")
    own = ConversationImages(own=frozenset({"data:own"}))
    assert own.made(conversation) == {1: "messages[2], tool 'zoom'"}
    assert ConversationImages().made(conversation) == {
        0: "messages[0], user",
        1: own.made(conversation)[1],
    }


def test_a_jpeg_tool_image_is_sent_as_the_png_of_the_trainers_pixels():
    """SGLang on a GPU decodes a JPEG with nvJPEG (pixels not PIL's): a tool's JPEG goes as the
    PNG of PIL's RGB decode, which is what the trainer reads (``AgentVision``)."""
    jpeg = encoded((32, 24), "JPEG")
    conversation = tool_turn(data_url(jpeg, "image/jpeg"))
    own, sent = asyncio.run(ConversationImages(own=frozenset({"data:own"})).sent(conversation))
    assert own == "data:own" and sent.startswith("data:image/png;base64,")
    png = Image.open(io.BytesIO(base64.b64decode(sent.partition(",")[2])))
    assert png.format == "PNG" and png.mode == "RGB"
    trainers = open_image(image_bytes(image(data_url(jpeg, "image/jpeg"))))
    assert png.tobytes() == trainers.tobytes()


def test_max_images_counts_the_prompts_images_with_the_tools():
    """A prompt of 2 images and a tool's 2 under max_images=3: refused naming the tool, as the
    request carries 4; the prompt's own alone are never refused."""
    policy = ImagePolicy(ImageLimits(max_images=3))
    small = data_url(encoded((8, 8)))
    conversation = tool_turn(small, small)
    conversation[0]["content"].insert(0, image("data:own2"))
    client = ConversationImages(frozenset({"data:own", "data:own2"}), policy)
    with pytest.raises(ImageRefused, match=r"carries 4 images, more than 3 .*tool 'zoom'"):
        asyncio.run(client.sent(conversation))
    assert len(asyncio.run(client.sent(tool_turn(small)))) == 2
    assert asyncio.run(client.sent(conversation[:1]))[:2] == ["data:own2", "data:own"]
    many = tool_turn()
    many[0]["content"] = [image(f"data:own{k}") for k in range(5)]
    own = ConversationImages(frozenset(f"data:own{k}" for k in range(5)), policy)
    assert len(asyncio.run(own.sent(many))) == 5  # the data's: passed before start


def test_a_refused_tool_image_names_the_tool():
    policy = ImagePolicy(ImageLimits(max_bytes=100))
    client = ConversationImages(frozenset({"data:own"}), policy)
    with pytest.raises(ImageRefused, match=r"\(messages\[2\], tool 'zoom'\) is refused: an image"):
        asyncio.run(client.sent(tool_turn(data_url(encoded((64, 64))))))


def test_the_engines_context_replaces_the_recorded_one():
    # turn 1 answered (40, 41, masked in) from [1, 8, 8, 8, 2]; a tool image (one placeholder)
    # and the generation prompt (3, 4) follow; the engine expands the new image to 2 tokens
    t = Trajectory(prompt_ids=[1, 8, 8, 8, 2], ids=[40, 41, 3, 8, 4])
    t.mask, t.logprobs, t.token_versions = [1, 1, 0, 0, 0], [-0.5, -0.25, 0, 0, 0], [7, 7]
    assert as_the_engine_saw(t, [1, 8, 8, 8, 2, 40, 41, 3, 8, 8, 4], Tokenizer()) is None
    assert t.prompt_ids == [1, 8, 8, 8, 2] and t.ids == [40, 41, 3, 8, 8, 4]
    assert t.mask == [1, 1, 0, 0, 0, 0] and t.logprobs == [-0.5, -0.25, 0, 0, 0, 0]
    assert t.token_versions == [7, 7]
    first = Trajectory(prompt_ids=[1, 8, 2])
    assert as_the_engine_saw(first, [1, 8, 8, 8, 2], Tokenizer()) is None
    assert first.prompt_ids == [1, 8, 8, 8, 2] and first.ids == []


def test_an_engine_that_tokenised_otherwise_rejects_the_conversation():
    t = Trajectory(prompt_ids=[1, 8, 2], ids=[40, 41, 3])
    t.mask, t.logprobs = [1, 1, 0], [-0.5, -0.25, 0]
    why = as_the_engine_saw(t, [1, 8, 8, 2, 42, 3], Tokenizer())
    assert why == "the engine tokenised the conversation with its images otherwise"
