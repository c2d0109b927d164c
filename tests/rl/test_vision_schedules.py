"""A vision-language policy in the other schedules, the logic without engines: the fully
asynchronous rollout's requests carry a prompt's images, and an interrupted generation whose
continuation the engine read otherwise, or tokens so far showing a media placeholder, start
again, and a sample started again too often is given up (invalid, counted) rather than failing
the job; eval prompts with images are encoded as the training's are. The real jobs:
``test_vlm_schedules_job.py`` (slow)."""

from __future__ import annotations

import asyncio
import itertools
import logging
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from relax_launch.rl.async_rollout import MAX_RESTARTS, ContinuousRollout
from relax_launch.rl.data_config import DataConfig, EvalConfig
from relax_launch.rl.evaluation import Evaluation
from relax_launch.rl.prompt import Prompt
from relax_launch.rl.rollout import prompt_inputs
from relax_launch.rl.vision_prompts import PromptImages
from relax_launch.trainer.batch import RowImages

ENGINE_IDS = (5, 9, 6)  # the template's: one placeholder (9) per image
TRAINER_IDS = [5, 9, 9, 9, 9, 6]  # the image expanded to its 4 tokens
ROWS = RowImages(torch.ones(16, 6), torch.tensor([[1, 4, 4]]))
SPECIAL = {9: "<|image_pad|>", 10: "<|video_pad|>", 11: "<im", 12: "age>"}  # the stub's text


def image_prompt(index: int = 0) -> Prompt:
    messages = ({"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "?"}]},)
    images = PromptImages(("data:image/png;base64,AAAA",), ENGINE_IDS, ROWS)
    return Prompt(index, messages, "2", images=images)


def reply(prompt_ids: list[int] | None, out: list[int], finish: str) -> dict:
    meta = {
        "output_token_logprobs": [[-0.5, t, None] for t in out],
        "finish_reason": {"type": finish},
        "weight_version": "0",
    }
    return {"text": "", "output_ids": out, "prompt_token_ids": prompt_ids, "meta_info": meta}


class ScriptedEngine:
    """The rollout client: answers each /generate with the next scripted reply, records the
    bodies."""

    def __init__(self, replies: list[dict]) -> None:
        self.replies, self.bodies = list(replies), []

    def client(self, role: str) -> ScriptedEngine:
        return self

    async def request(self, path: str, body: dict, affinity_key: str) -> dict:
        self.bodies.append(body)
        return self.replies.pop(0)


def sampled(engine: ScriptedEngine) -> tuple[ContinuousRollout, object]:
    tokenizer = SimpleNamespace(
        decode=lambda ids, skip_special_tokens: "".join(SPECIAL.get(i, " ") for i in ids),
        convert_tokens_to_ids=lambda token: 9,
    )
    rollout = ContinuousRollout(
        engine,
        None,
        None,
        tokenizer,
        agent=None,
        n=1,
        max_staleness=1,
        sampling={"temperature": 1.0},
        max_tokens=4,
        version=0,
    )

    async def one() -> object:
        rollout.running = asyncio.Event()
        rollout.running.set()
        return await rollout._sample(image_prompt(), TRAINER_IDS, "b1")

    return rollout, asyncio.run(one())


def test_an_interrupted_generation_with_images_continues_with_them():
    engine = ScriptedEngine(
        [reply(TRAINER_IDS, [7, 8], "abort"), reply(TRAINER_IDS + [7, 8], [3, 4], "length")]
    )
    rollout, sample = sampled(engine)
    first, second = engine.bodies
    assert first["input_ids"] == list(ENGINE_IDS) and second["input_ids"] == [*ENGINE_IDS, 7, 8]
    assert all(b["image_data"] == ["data:image/png;base64,AAAA"] for b in engine.bodies)
    assert all(b["return_prompt_token_ids"] for b in engine.bodies)
    assert sample.prompt_ids == TRAINER_IDS and sample.response_ids == [7, 8, 3, 4]
    assert sample.images is ROWS and rollout.image_restarts() == 0


def test_a_continuation_the_engine_read_otherwise_starts_again_from_the_prompt():
    """The engine decodes the ids and tokenises the text again: 7, 8 read as 78 means the
    continuation followed other tokens than the ones trained, so they go."""
    engine = ScriptedEngine(
        [
            reply(TRAINER_IDS, [7, 8], "abort"),
            reply(TRAINER_IDS + [78], [3, 4], "length"),  # read otherwise: dropped
            reply(TRAINER_IDS, [1, 2, 3, 4], "length"),
        ]
    )
    rollout, sample = sampled(engine)
    assert [b["input_ids"] for b in engine.bodies] == [
        list(ENGINE_IDS),
        [*ENGINE_IDS, 7, 8],
        list(ENGINE_IDS),
    ]
    assert engine.bodies[2]["sampling_params"]["max_new_tokens"] == 4  # the whole budget again
    assert sample.response_ids == [1, 2, 3, 4] and sample.logprobs == [-0.5] * 4
    assert rollout.image_restarts() == 1 and rollout.image_restarts() == 0


@pytest.mark.parametrize("shown", [[7, 9], [10, 7], [11, 12]])  # image, video, "<image>"
def test_tokens_so_far_showing_a_media_placeholder_start_again_from_the_prompt(shown):
    """The random policy samples a placeholder (the image's, the video's, the text <image>):
    sent back with the prompt, the engine would read one image more or a video and refuse it,
    so the interrupted tokens go."""
    engine = ScriptedEngine(
        [reply(TRAINER_IDS, shown, "abort"), reply(TRAINER_IDS, [1, 2, 3, 4], "length")]
    )
    rollout, sample = sampled(engine)
    assert [b["input_ids"] for b in engine.bodies] == [list(ENGINE_IDS)] * 2
    assert sample.response_ids == [1, 2, 3, 4] and rollout.image_restarts() == 1


@pytest.mark.parametrize(
    ("script", "requests"),
    [
        ([reply(TRAINER_IDS, [7, 9], "abort")], MAX_RESTARTS + 1),  # always a placeholder
        (  # always read otherwise: each restart costs the segment and its continuation
            [reply(TRAINER_IDS, [7, 8], "abort"), reply(TRAINER_IDS + [78], [3], "abort")],
            2 * (MAX_RESTARTS + 1),
        ),
    ],
)
def test_a_sample_started_again_too_often_is_given_up_not_the_job(script, requests, caplog):
    engine = ScriptedEngine(list(itertools.islice(itertools.cycle(script), 200)))
    with caplog.at_level(logging.WARNING):
        rollout, sample = sampled(engine)
    assert len(engine.bodies) == requests
    assert not sample.valid and sample.response_ids == [] and sample.images is ROWS
    assert rollout.image_restarts() == MAX_RESTARTS and rollout.image_samples_given_up() == 1
    assert rollout.image_samples_given_up() == 0
    assert "a sample of prompt 0 is given up" in caplog.text


class StubEncoder:
    """A vision-language policy's encoder: every prompt gets the image."""

    def encode(self, prompt: Prompt) -> tuple[Prompt, list[int]]:
        return replace(prompt, images=image_prompt().images), TRAINER_IDS


def test_eval_prompts_with_images_are_encoded_for_the_engine_and_the_trainer():
    data = DataConfig(dataset="builtin:shape_counting", max_prompt_tokens=128)
    config = EvalConfig(data={"dataset": "builtin:shape_counting", "seed": 7}, max_prompts=2)
    evaluation = Evaluation(config, None, data, training=[], vision=StubEncoder())
    assert len(evaluation.prompts) == 2
    for prompt, ids in evaluation.prompts:
        assert ids == TRAINER_IDS and prompt.images is not None
        assert prompt_inputs(prompt, ids)["image_data"] == ["data:image/png;base64,AAAA"]
