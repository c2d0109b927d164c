"""The teacher's and the judge's requests for samples whose prompt has images (a vision-language
policy): the teacher gets the engine's form of the prompt (one placeholder per image, the
images) then the response, which expands to the trainer's ids; a response showing a media
placeholder is not sent; a vision-language judge is shown the images, a text judge the text.
The jobs: ``test_vlm_scorers_job.py`` (slow)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import AutoTokenizer

from relax_launch.models.build import ensure_model
from relax_launch.rl.config import RewardConfig, RewardSource
from relax_launch.rl.prompt import Prompt
from relax_launch.rl.rewards import Rewards
from relax_launch.rl.rollout import reply_sample
from relax_launch.rl.samples import Sample
from relax_launch.rl.vision_prompts import MEDIA_PLACEHOLDERS, PromptImages, png_url
from relax_launch.rl.vision_scoring import (
    check_teacher_ids,
    judge_message,
    teachable,
    teacher_inputs,
    vision_judges,
)
from relax_launch.rl.visual_tasks import draw_shapes
from relax_launch.trainer.batch import RowImages

VLM = "builtin:tiny-qwen2.5-vl"
START, END, PAD, VIDEO = 6, 7, 8, 9  # the tiny Qwen2.5-VL's vision tokens
MERGE = 4  # patches per image token (2 x 2 merged)
ENGINE = {"max_total_tokens": 2048, "image_processor_backend": "pil"}
GRIDS = torch.tensor([[1, 4, 4], [1, 2, 6]])  # two images: 4 and 3 image tokens


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(str(ensure_model(VLM)))


def expanded(engine_ids: list[int], grids: torch.Tensor) -> list[int]:
    """The trainer's ids of the engine's: each placeholder as its image's tokens."""
    counts = iter((grids.prod(-1) // MERGE).tolist())
    return [t for token in engine_ids for t in ([PAD] * next(counts) if token == PAD else [token])]


def image_sample(response: list[int]) -> Sample:
    """A sample as the rollout recorded it (``reply_sample``) of a prompt with two images."""
    urls = (
        png_url(draw_shapes({0: ("red", "circle")})),
        png_url(draw_shapes({4: ("blue", "square")})),
    )
    engine_ids = (4, 20, START, PAD, END, 30, START, PAD, END, 40, 5)
    rows = RowImages(torch.ones(int(GRIDS.prod(-1).sum()), 6), GRIDS)
    messages = ({"role": "user", "content": "How many red circles?"},)
    prompt = Prompt(0, messages, "1", images=PromptImages(urls, engine_ids, rows))
    ids = expanded(list(engine_ids), GRIDS)
    reply = {
        "text": "",
        "output_ids": response,
        "prompt_token_ids": ids,
        "meta_info": {"output_token_logprobs": [[-1.0, t, None] for t in response]},
    }
    return reply_sample(3, prompt, ids, reply)


def test_the_teachers_request_carries_the_images_and_expands_to_the_trainers_ids():
    sample = image_sample([50, 51, 52])
    body = teacher_inputs(sample)
    assert body["image_data"] == list(sample.prompt_images.urls)  # the prompt's images, in order
    assert body["input_ids"] == list(sample.prompt_images.engine_ids) + [50, 51, 52]
    assert body["input_ids"].count(PAD) == 2  # one placeholder per image: the engine expands
    assert expanded(body["input_ids"], GRIDS) == sample.prompt_ids + sample.response_ids
    assert body["return_prompt_token_ids"] is True
    text = Sample(0, "q", None, [1, 2], [3], [-1.0], "", "1")
    assert teacher_inputs(text) == {"input_ids": [1, 2, 3]}  # a text sample as before


def test_the_teacher_engines_ids_must_be_the_trainers():
    sample = image_sample([50, 51])
    check_teacher_ids(sample, {"prompt_token_ids": sample.prompt_ids + [50, 51]})
    for seen, said in (([*sample.prompt_ids[:-1], 50, 51], "17 tokens"), (None, "none returned")):
        with pytest.raises(RuntimeError, match=rf"group 3 \({said}\) are not the trainer's"):
            check_teacher_ids(sample, {"prompt_token_ids": seen})


def test_a_response_showing_a_media_placeholder_is_not_sent_to_the_teacher(tokenizer):
    assert teachable(image_sample([50, 51]), tokenizer)
    assert not teachable(image_sample([]), tokenizer)
    for response in ([50, PAD], [VIDEO, 51], tokenizer.encode("a <image> b")):
        assert not teachable(image_sample(response), tokenizer), response
    # without images the engine reads no media: a placeholder in a text sample is text
    assert teachable(Sample(0, "q", None, [1, 2], [PAD], [-1.0], "", "1"), tokenizer)


def test_a_conversations_images_are_not_sent_to_the_teacher_as_text():
    sample = Sample(0, "q", None, [1, PAD, PAD], [3], [-1.0], "", "1")
    sample.images = RowImages(torch.ones(8, 6), torch.tensor([[1, 2, 4]]))  # an agentic one
    with pytest.raises(RuntimeError, match="images came from its conversation"):
        teacher_inputs(sample)
    agentic = image_sample([50])  # its prompt's images too (for a judge): still refused
    agentic.response_mask = [1.0]
    with pytest.raises(RuntimeError, match="images came from its conversation"):
        teacher_inputs(agentic)


def judged_conversations(vision: frozenset[str]) -> tuple[list[list[dict]], dict[str, float]]:
    sent = []

    def judge(conversations, regex, source):
        sent.extend(conversations)
        return ["7"] * len(conversations)

    config = RewardConfig(sources=(RewardSource(name="judge", genrm=True),))
    samples = [image_sample([50]), Sample(1, "q", None, [1, 2], [3], [-1.0], "x", "1")]
    metrics = Rewards(config, judge=judge, vision_judges=vision).score(samples)
    return sent, metrics


def test_a_vision_language_judge_is_shown_the_prompts_images_before_the_grading_text():
    sent, metrics = judged_conversations(frozenset({"judge"}))
    urls = list(image_sample([50]).prompt_images.urls)
    user = sent[0][0]["content"]
    assert [p["image_url"]["url"] for p in user if p["type"] == "image_url"] == urls
    assert user[-1]["type"] == "text" and "You are grading an answer" in user[-1]["text"]
    assert isinstance(sent[1][0]["content"], str)  # a text prompt's judge gets text
    assert metrics["reward/judge/images"] == 2 and metrics["reward/judge"] == 0.7


def test_a_text_judge_gets_the_text_told_of_the_images_it_is_not_shown():
    sent, metrics = judged_conversations(frozenset())
    assert all(isinstance(c[0]["content"], str) for c in sent)
    told = "(The question showed 2 images, not shown to you: grade against the reference answer.)"
    assert sent[0][0]["content"].startswith(told + "\n\nYou are grading an answer")
    assert sent[1][0]["content"].startswith("You are grading an answer")  # a text prompt's
    assert "reward/judge/images" not in metrics


def test_a_shown_judges_text_spells_no_media_placeholder():
    text = "Is <image> or <|image_pad|><|video_pad|> in <|vision_start|><|image_pad|>?"
    message = judge_message(image_sample([50]), text, with_images=True)
    shown = message["content"][-1]["text"]
    assert shown == "Is < image> or < |image_pad|>< |video_pad|> in <|vision_start|>< |image_pad|>?"
    assert not any(p in shown for p in MEDIA_PLACEHOLDERS)
    assert judge_message(image_sample([50]), text, with_images=False)["content"].endswith(text)


def test_the_images_metric_counts_the_image_parts_sent_and_none_when_the_judge_failed():
    def failing(conversations, regex, source):
        raise RuntimeError("400: refused")

    config = RewardConfig(sources=(RewardSource(name="judge", genrm=True, fallback=0.0),))
    samples = [image_sample([50]), image_sample([51])]
    metrics = Rewards(config, judge=failing, vision_judges=frozenset({"judge"})).score(samples)
    assert metrics["reward/judge/images"] == 0 and metrics["reward/judge/failed"] == 2


def test_the_judges_shown_images_are_those_whose_model_has_an_image_token():
    routing = SimpleNamespace(route_key_map={"plain": "llama", "vl": "vl"}, default_model="vl")
    tokens = {"vl": 151655, "llama": None}
    genrm = SimpleNamespace(routing=routing, image_token_of=tokens.__getitem__)
    sources = (
        RewardSource(name="judge", genrm=True),  # the default model's
        RewardSource(name="plain", genrm=True),
        RewardSource(name="count", function="builtin:exact_numeric"),
    )
    assert vision_judges(genrm, RewardConfig(sources=sources)) == {"judge"}
    routing.default_model = "llama"
    assert vision_judges(genrm, RewardConfig(sources=sources)) == frozenset()
    assert vision_judges(None, RewardConfig(sources=sources)) == frozenset()
