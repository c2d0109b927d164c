"""A vision-language judge's requests from the RL step (``Rewards`` -> ``rollout.judge`` -> the
controller's in-process client, the judge form rendered with the tiny Qwen2.5-VL's own chat
template) over the scripted upstream: the prompt's images reach the engine as ``image_data``
with one placeholder each in the rendered prompt, whatever the gateway's image limits
(``gateway.images``, for external callers): the prompt's images were read before the job
started, so a judge never fails mid-run on them."""

from __future__ import annotations

import dataclasses
import functools
import json

import torch
from conftest import make_manager

from relax_launch.inference.control_plane import chat_renderer
from relax_launch.inference.image_config import ImageLimits
from relax_launch.inference.images import ImagePolicy
from relax_launch.inference.inprocess import EngineClients
from relax_launch.models.build import ensure_model
from relax_launch.rl import rollout
from relax_launch.rl.config import RewardConfig, RewardSource
from relax_launch.rl.rewards import Rewards
from relax_launch.rl.samples import Sample
from relax_launch.rl.vision_prompts import PromptImages, png_url
from relax_launch.rl.visual_tasks import draw_shapes
from relax_launch.trainer.batch import RowImages

SHOWN = "<|vision_start|><|image_pad|><|vision_end|>"


def sample_with_two_images() -> Sample:
    urls = tuple(png_url(draw_shapes({c: ("red", "circle")})) for c in (0, 4))
    rows = RowImages(torch.ones(8, 6), torch.tensor([[1, 2, 2], [1, 2, 2]]))
    sample = Sample(0, "How many red circles?", "1", [1, 2], [3], [-1.0], "Two.", "1")
    sample.prompt_images = PromptImages(urls, (6, 8, 7, 6, 8, 7), rows)
    return sample


def judged(upstream, limits: ImageLimits) -> tuple[dict[str, float], list[dict]]:
    manager = make_manager("genrm", [f"{upstream.url}/e0"])
    manager.models["m"] = dataclasses.replace(manager.models["m"], image_token_id=8)
    renderers = {"genrm": chat_renderer(ensure_model("builtin:tiny-qwen2.5-vl"))}
    engines = EngineClients(
        {"genrm": manager}, timeout_s=60, renderers=renderers, images=ImagePolicy(limits)
    )
    engines.start()
    try:
        judge = functools.partial(rollout.judge, engines, max_tokens=4)
        config = RewardConfig(sources=(RewardSource(name="judge", genrm=True, fallback=0.0),))
        rewards = Rewards(config, judge=judge, vision_judges=frozenset({"judge"}))
        metrics = rewards.score([sample_with_two_images()])
    finally:
        engines.close()
    return metrics, [json.loads(r["body"]) for r in upstream.requests]


def test_a_vlm_judges_request_carries_the_prompts_images(upstream):
    metrics, sent = judged(upstream, ImageLimits())
    (body,) = sent
    assert body["image_data"] == list(sample_with_two_images().prompt_images.urls)
    assert body["text"].count(SHOWN) == 2 and body["text"].endswith("Score:")
    assert body["text"].index(SHOWN) < body["text"].index("You are grading an answer")
    assert metrics["reward/judge/images"] == 2

    upstream.reset()
    metrics, sent = judged(upstream, ImageLimits(max_images=1, max_bytes=1, max_pixels=1))
    (body,) = sent  # not held to gateway.images
    assert len(body["image_data"]) == metrics["reward/judge/images"] == 2
