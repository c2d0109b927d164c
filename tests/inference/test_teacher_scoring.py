"""Teacher scoring (``rollout.score_with_teacher``) through the controller's in-process client
over the scripted upstream: a sample whose response shows a media placeholder beside its
prompt's images is never requested (the engine would count one more image, 400, and fail the
whole step's scoring) and gets no teacher logprobs, counted as ``teacher/unscored``."""

from __future__ import annotations

import dataclasses
import json

import torch
from conftest import make_manager
from transformers import AutoTokenizer

from relax_launch.inference.inprocess import EngineClients
from relax_launch.models.build import ensure_model
from relax_launch.rl import rollout
from relax_launch.rl.batch import sample_metrics
from relax_launch.rl.samples import Sample
from relax_launch.rl.vision_prompts import PromptImages, png_url
from relax_launch.rl.visual_tasks import draw_shapes
from relax_launch.trainer.batch import RowImages

PAD = 8  # the tiny Qwen2.5-VL's image placeholder


def image_sample(response: list[int]) -> Sample:
    urls = (png_url(draw_shapes({0: ("red", "circle")})),)
    rows = RowImages(torch.ones(4, 6), torch.tensor([[1, 2, 2]]))
    sample = Sample(0, "How many?", "1", [6, PAD, 7], response, [-1.0] * len(response), "", "1")
    sample.prompt_images = PromptImages(urls, (6, PAD, 7), rows)
    return sample


def test_a_sample_showing_a_placeholder_is_not_requested_and_is_counted_unscored(upstream):
    upstream.reset("score")
    manager = make_manager("teacher", [f"{upstream.url}/e0"])
    manager.models["m"] = dataclasses.replace(manager.models["m"], image_token_id=PAD)
    tokenizer = AutoTokenizer.from_pretrained(str(ensure_model("builtin:tiny-qwen2.5-vl")))
    shows_pad = image_sample([50, PAD])
    text = Sample(1, "q", None, [1, 2], [3, 4], [-1.0, -1.0], "", "1")
    empty = Sample(2, "q", None, [1, 2], [], [], "", "1")
    engines = EngineClients({"teacher": manager}, timeout_s=10)
    engines.start()
    try:
        rollout.score_with_teacher(engines, [shows_pad, text, empty], tokenizer)
    finally:
        engines.close()
    (sent,) = [json.loads(r["body"]) for r in upstream.requests]  # the text sample's alone
    assert sent["input_ids"] == [1, 2, 3, 4] and "image_data" not in sent
    assert text.teacher_logprobs == [-0.5, -0.5]
    assert shows_pad.teacher_logprobs == [] and empty.teacher_logprobs == []
    metrics = sample_metrics([shows_pad, text, empty], 1.0)
    assert metrics["teacher/unscored"] == 2 and metrics["reverse_kl"] == -0.5
    assert "teacher/unscored" not in sample_metrics(
        [Sample(0, "q", None, [1], [2], [-1.0], "", "1")], 1.0
    )
