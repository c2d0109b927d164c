"""An agentic conversation with images (the prompt's, and a tool's PIL-drawn one) becomes a
training sample whose ids are the engine's, each image's placeholder run as long as the
trainer's processor expands it, with the images' patches and grids in row order and every image
token and non-model turn masked; a sample the trainer would read otherwise is rejected naming
its prompt (``agent/rejected``). The engine here expands placeholders as SGLang's Qwen-VL
processor does; tests/rl/test_agent_vision_job.py runs the real engine and trainer."""

from __future__ import annotations

import asyncio
import functools
import io
import json
import logging
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import vlm_agent

from relax_launch.inference.image_config import ImageLimits
from relax_launch.inference.images import ImagePolicy, ImageRefused, image_urls
from relax_launch.models.build import ensure_model
from relax_launch.rl import agent
from relax_launch.rl.agent import AgentClient, to_sample
from relax_launch.rl.agent_vision import AgentVision, image_runs_problem
from relax_launch.rl.async_rollout import ContinuousRollout
from relax_launch.rl.batch import sample_metrics, to_batch
from relax_launch.rl.vision_prompts import (
    VisionEncoder,
    image_bytes,
    open_image,
    text_of,
)
from relax_launch.rl.visual_tasks import data_url, draw_shapes, shape_counting
from relax_launch.trainer.vlm_batches import image_tokens
from relax_launch.trainer.vlm_conversion import VLShape
from relax_launch.trainer.vlm_model import mrope_positions

PAD, START = 8, 6


@pytest.fixture(scope="module")
def model() -> Path:
    return ensure_model("builtin:tiny-qwen2.5-vl")


@pytest.fixture(scope="module")
def encoder(model: Path) -> VisionEncoder:
    return VisionEncoder(model)


class ExpandingEngine:
    """Answers ``replies`` in turn, ending each with <|im_end|>, and returns the prompt's ids
    as SGLang's Qwen-VL processor makes them: each placeholder sent (one per image of
    ``image_data``) expanded to the image's token count, plus ``extra`` for the last image."""

    def __init__(self, encoder: VisionEncoder, *replies: str, extra: int = 0) -> None:
        self.processor, self.replies, self.extra = encoder.processor, list(replies), extra

    async def __call__(self, body: dict) -> dict:
        p = self.processor
        images = [
            open_image(image_bytes({"type": "image_url", "image_url": {"url": u}}))
            for u in body.get("image_data", [])
        ]
        grids = p.images(images=images, return_tensors="pt")["image_grid_thw"] if images else []
        counts = [int(g.prod()) // p.merge**2 for g in grids]
        counts[-1:] = [c + self.extra for c in counts[-1:]]
        seen = []
        for token in body["input_ids"]:
            seen += [token] * (counts.pop(0) if token == p.image_token_id else 1)
        end = p.tokenizer.convert_tokens_to_ids("<|im_end|>")
        text = self.replies.pop(0)
        out = p.tokenizer.encode(text, add_special_tokens=False) + [end]
        meta = {
            "output_token_logprobs": [[-0.5, i, None] for i in out],
            "finish_reason": {"type": "stop", "matched": end},
            "weight_version": "2",
        }
        return {"text": text, "output_ids": out, "meta_info": meta, "prompt_token_ids": seen}


def converse(encoder: VisionEncoder, extra: int = 0):
    """The zoom tool's conversation on the visual task's first prompt: (prompt, its trainer ids,
    the client that recorded it, the conversation)."""
    prompt, ids = encoder.encode(shape_counting(1, seed=3)[0])
    engine = ExpandingEngine(encoder, "3", "two", extra=extra)
    client = AgentClient(engine, encoder.processor.tokenizer, 1.0, budget=64)
    conversation = asyncio.run(vlm_agent.zoom_tool(prompt, client))
    return prompt, ids, client, conversation


def test_a_conversation_with_a_tool_image_trains_the_engines_ids_with_both_images(model, encoder):
    prompt, ids, client, conversation = converse(encoder)
    sample = to_sample(0, (prompt, ids), client, conversation, "")
    AgentVision(encoder.processor).attach(sample, client.trajectory, prompt.index)
    assert sample.valid and sample.outcome == "" and sample.turns == 2
    assert sample.question == text_of(prompt.messages[-1]["content"])  # a judge reads text
    assert sample.prompt_images is prompt.images  # a vision judge is shown them
    sequence = sample.prompt_ids + sample.response_ids

    # the trainer's processor on the whole conversation: the same ids, image runs included
    p = encoder.processor
    pictures = [
        open_image(image_bytes(part))
        for part in [
            prompt.messages[0]["content"][0],
            {"type": "image_url", "image_url": {"url": vlm_agent.zoomed()}},
        ]
    ]
    text = p.tokenizer.apply_chat_template([*conversation], tokenize=False)
    expected = p.encode_text(text, pictures)
    assert sequence == expected.ids[: len(sequence)]
    assert p.tokenizer.decode(expected.ids[len(sequence) :]) == "\n"  # the template's last newline
    assert sample.prompt_ids == ids  # the first turn's context is the one-turn prompt's

    # the images in row order: the prompt's (3 x 3 merged patches), then the tool's (3 x 2)
    assert (
        sample.images.grids.tolist() == expected.image_grid_thw.tolist() == [[1, 6, 6], [1, 6, 4]]
    )
    assert torch.equal(sample.images.pixel_values, expected.pixel_values.float())
    assert torch.equal(sample.images.pixel_values[:36], prompt.images.rows.pixel_values)

    # masks: the engine's two replies alone; image tokens and the tool turn are context
    pads = [i for i, t in enumerate(sequence) if t == p.image_token_id]
    assert len(pads) == 9 + 6
    mask = [0.0] * len(sample.prompt_ids) + sample.response_mask
    trained = [t for t, m in zip(sequence, mask, strict=True) if m]
    assert p.tokenizer.decode(trained) == "3<|im_end|>two<|im_end|>"
    batch = to_batch([sample], distill_coef=0.0)
    assert batch.images == (sample.images,) and not any(batch.loss_mask[0][i] for i in pads)

    # what the trainer reads: both images' runs, at the multimodal positions of their grids
    shape = VLShape.from_hf_config(json.loads((model / "config.json").read_text()))
    row = torch.tensor(sequence)
    assert image_tokens(row, sample.images.grids, shape).nonzero()[:, 0].tolist() == pads
    positions = mrope_positions(row, sample.images.grids, shape)
    tool = positions[:, pads[9:]]  # its (t, h, w) among its merged patches, from one start
    assert (tool - tool[:, :1]).tolist() == [[0] * 6, [0, 0, 1, 1, 2, 2], [0, 1, 0, 1, 0, 1]]


def test_an_engine_expanding_an_image_otherwise_rejects_the_sample_naming_the_prompt(
    encoder, caplog
):
    prompt, ids, client, conversation = converse(encoder, extra=1)
    assert client.trajectory.rejected is None  # the recording alone cannot tell
    sample = to_sample(0, (prompt, ids), client, conversation, "")
    with caplog.at_level(logging.WARNING):
        AgentVision(encoder.processor).attach(sample, client.trajectory, prompt.index)
    assert sample.outcome == "rejected" and not sample.valid and sample.images is None
    assert f"agentic sample of prompt {prompt.index} is rejected" in caplog.text
    assert "image 1: 7 placeholder tokens from the engine, 6 from ours" in caplog.text
    assert sample_metrics([sample], 1.0)["agent/rejected"] == 1
    assert not any(to_batch([sample], distill_coef=0.0).loss_mask[0])


@pytest.mark.parametrize(
    ("ids", "mask", "why"),
    [
        ([1, START, PAD, PAD, 2, 3, START, PAD, 4], [0] * 9, None),
        ([1, START, PAD, PAD, 2, START, PAD, 3, PAD], [0] * 8 + [1], None),  # sampled after
        # a placeholder the policy sampled before an image's run: the trainer would give it
        # the image (the engine's text after the images is text to both)
        (
            [1, START, PAD, PAD, 2, PAD, START, PAD, 4],
            [0] * 5 + [1] + [0] * 3,
            "image 1: its placeholders do not follow",
        ),
        ([1, START, PAD, PAD, 2, 3, START, PAD, PAD], [0] * 9, "image 1: 2 placeholder tokens"),
        ([1, START, PAD, PAD, 2, 3, START, 4, 5], [0] * 9, "1 image placeholder runs for 2"),
        (
            [1, START, PAD, PAD, 2, 3, START, PAD, 4],
            [0] * 7 + [1, 0],
            "image 1: its placeholder tokens were sampled",
        ),
        ([1, PAD, PAD, 2, 3, 3, START, PAD, 4], [0] * 9, "image 0: its placeholders do not follow"),
    ],
)
def test_the_image_runs_must_be_the_trainers(ids, mask, why):
    problem = image_runs_problem(ids, mask, [2, 1], PAD, START)
    assert problem is None if why is None else problem.startswith(why)


class LoopEngines:
    """The controller's engine clients, answered by ``engine`` (the bodies recorded)."""

    def __init__(self, engine: ExpandingEngine, images: ImagePolicy | None = None) -> None:
        self.engine, self.images, self.bodies = engine, images or ImagePolicy(), []

    def client(self, role: str) -> LoopEngines:
        return self

    async def request(self, path: str, body: dict, affinity_key: str) -> dict:
        self.bodies.append(body)
        return await self.engine(body)

    def run(self, coro, what: str):
        return asyncio.run(coro)


def test_the_fully_asynchronous_rollout_trains_a_conversation_with_its_images(encoder):
    """``algorithm.max_staleness`` with ``rollout.function``: the conversation gets its images
    as in the synchronous rollout, not trained as text with image placeholders."""
    prompt, ids = encoder.encode(shape_counting(1, seed=3)[0])
    rollout = ContinuousRollout(
        LoopEngines(ExpandingEngine(encoder, "3", "two")),
        None,
        None,
        encoder.processor.tokenizer,
        agent=vlm_agent.zoom_tool,
        n=1,
        max_staleness=1,
        sampling={"temperature": 1.0},
        max_tokens=64,
        version=2,
        vision=AgentVision(encoder.processor),
    )

    async def one():
        rollout.running = asyncio.Event()
        rollout.running.set()
        return await rollout._conversation(prompt, ids, "b1")

    sample = asyncio.run(one())
    assert sample.valid and sample.turns == 2 and sample.token_versions
    assert sample.images is not None
    assert sample.images.grids.tolist() == [[1, 6, 6], [1, 6, 4]]


@pytest.mark.parametrize("first", ["a<|video_pad|>", "a <image> b", "<|image_pad|>"])
def test_a_reply_showing_media_rejects_the_conversation_before_a_turn_with_images(encoder, first):
    """Sent with the images, the engine would read the sampled placeholder as one more image
    or a video and refuse the turn (400), failing the step: the conversation is rejected."""
    prompt, ids = encoder.encode(shape_counting(1, seed=3)[0])
    engine = ExpandingEngine(encoder, first, "two")
    client = AgentClient(engine, encoder.processor.tokenizer, 1.0, budget=64)
    conversation, outcome = asyncio.run(agent.converse(vlm_agent.zoom_tool, prompt, client))
    assert engine.replies == ["two"]  # the tool's turn was not sent
    sample = to_sample(0, (prompt, ids), client, conversation, outcome)
    assert outcome == "rejected" and not sample.valid
    assert sample_metrics([sample], 1.0)["agent/rejected"] == 1


def test_a_prompts_samples_with_the_same_images_run_the_processor_once(encoder):
    """A prompt's n samples mostly show the same images: the trainer's processor runs once for
    them and they share its rows; other images are processed on their own."""
    vision, calls = AgentVision(encoder.processor), []
    images = encoder.processor.images

    def counted(**kwargs):
        calls.append(len(kwargs["images"]))
        return images(**kwargs)

    vision.processor = SimpleNamespace(images=counted)
    one = data_url(draw_shapes({0: ("red", "circle")}))
    other = data_url(draw_shapes({4: ("blue", "square"), 8: ("green", "triangle")}))
    first, second = vision.rows([one]), vision.rows([one])
    assert first is second and calls == [1]
    assert vision.rows([one, other]).grids.shape[0] == 2 and calls == [1, 2]


def test_a_prompts_images_are_encoded_once_and_its_own_in_an_agentic_turn(encoder):
    """Each draw of a prompt sends the same data: URL objects (a JPEG made a PNG once, an RGB
    PNG data: URL as it is), as its image parts too; in an agentic turn they are the prompt's
    own, and only the tool's image is marked for the gateway.images check, naming the tool."""
    buffer = io.BytesIO()
    draw_shapes({0: ("red", "circle")}).save(buffer, format="JPEG")
    shapes = shape_counting(1, seed=3)[0]
    question = shapes.messages[0]["content"][1]
    part = {"type": "image", "image": buffer.getvalue()}
    jpeg = replace(shapes, messages=({"role": "user", "content": [part, question]},))
    for source in (shapes, jpeg):
        (first, _), (again, _) = encoder.encode(source), encoder.encode(source)
        assert first.images.urls[0] is again.images.urls[0]
        assert first.images.urls[0].startswith("data:image/png;base64,")
        assert image_urls(list(first.messages)) == list(first.images.urls)
    assert list(encoder.engine_images.urls.values()) == [first.images.urls[0]]  # the JPEG's
    (own,) = image_urls(list(shapes.messages))
    prompt, _ = encoder.encode(shapes)
    assert prompt.images.urls[0] is own  # the visual task's RGB PNG: sent as it is
    sent = []
    expanding = ExpandingEngine(encoder, "3", "two")

    async def engine(body: dict) -> dict:
        sent.append(body)
        return await expanding(body)

    client = AgentClient(engine, encoder.processor.tokenizer, 1.0, budget=64)
    conversation, outcome = asyncio.run(agent.converse(vlm_agent.zoom_tool, prompt, client))
    assert outcome == "" and sent[0]["image_data"][0] is own  # the prompt's image alone
    assert sent[1]["image_data"] == [own, vlm_agent.zoomed()]  # the tool's: an RGB PNG already
    assert client.images.made(conversation) == {1: "messages[2], tool 'call_0'"}


async def zoom_too_far(prompt, client, caught: list) -> list:
    """The zoom tool's conversation, its image one gateway.images refuses: the first
    conversation lets the refusal go, the others catch it and answer without the image."""
    catches = bool(caught)
    caught.append(None)
    messages = list(prompt.messages)
    first = await client.chat.completions.create(messages=messages, max_tokens=4)
    messages.append(first.choices[0].message.model_dump(exclude_none=True))
    zoomed = [{"type": "image_url", "image_url": {"url": vlm_agent.zoomed((112, 112))}}]
    shown = {"role": "tool", "content": zoomed, "tool_call_id": "call_0"}
    try:
        await client.chat.completions.create(messages=[*messages, shown], max_tokens=4)
    except ImageRefused as refused:
        if not catches:
            raise
        caught[-1] = str(refused)
    messages.append({"role": "tool", "content": "no image", "tool_call_id": "call_0"})
    second = await client.chat.completions.create(messages=messages, max_tokens=4)
    return [*messages, second.choices[0].message.model_dump(exclude_none=True)]


def test_a_tool_image_gateway_images_refuses_fails_its_sample_not_the_step(encoder):
    """A tool's image over gateway.images is user code's problem of one sample: refused before
    any engine, raised in the rollout function naming the tool; uncaught it fails that sample
    (agent/failed), caught the conversation goes on; the step's other samples train."""
    prompt, ids = encoder.encode(shape_counting(1, seed=3)[0])
    engine = ExpandingEngine(encoder, "3", "3", "two")
    engines = LoopEngines(engine, ImagePolicy(ImageLimits(max_pixels=100 * 100)))
    caught: list = []
    samples = agent.generate(
        engines,
        [(prompt, ids)],
        n=2,
        temperature=1.0,
        max_tokens=64,
        function=functools.partial(zoom_too_far, caught=caught),
        tokenizer=encoder.processor.tokenizer,
        vision=AgentVision(encoder.processor),
    )
    assert [s.outcome for s in samples] == ["failed", ""] and samples[1].valid
    assert sample_metrics(samples, 1.0)["agent/failed"] == 1
    assert samples[1].turns == 2 and samples[1].images.grids.tolist() == [[1, 6, 6]]
    assert "(messages[2], tool 'call_0') is refused" in caught[1]
    assert "gateway.images.max_pixels" in caught[1]
    assert engine.replies == [] and all(len(b["image_data"]) == 1 for b in engines.bodies)
