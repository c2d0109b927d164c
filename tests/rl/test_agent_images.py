"""The recorded context of an agentic turn with images becomes the engine's (each placeholder run
stretched to its length, context masked out), and a re-tokenisation that changed any other token
rejects the conversation. tests/inference/test_vlm_gateway.py runs it against the real engine."""

from __future__ import annotations

from relax_launch.rl.agent import Trajectory
from relax_launch.rl.agent_images import as_the_engine_saw, collapsed, image_request, sources

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
    conversation = [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:a"}}]},
        {"role": "assistant", "content": "two"},
        {"role": "tool", "content": [{"type": "image_url", "image_url": {"url": "data:b"}}]},
    ]
    body = image_request([1, 8, 8, 8, 2, 40, 41, 3, 8, 4], conversation, Tokenizer())
    assert body == {
        "input_ids": [1, 8, 2, 40, 41, 3, 8, 4],
        "image_data": ["data:a", "data:b"],
        "return_prompt_token_ids": True,
    }
    assert image_request([1, 2], [{"role": "user", "content": "hi"}], Tokenizer()) == {}


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
