"""The built-in visual task: shapes drawn with PIL, labels that the pixels confirm, images the
tiny Qwen2.5-VL's processor turns into a handful of tokens."""

from __future__ import annotations

import base64
import io
from collections import Counter

from PIL import Image

from relax_launch.models.vlm_processor import VisionProcessor
from relax_launch.rl.visual_tasks import (
    KINDS,
    count_shapes,
    draw_shapes,
    read_shapes,
    shape_counting,
)


def image_of(prompt) -> Image.Image:
    (part,) = [p for p in prompt.messages[0]["content"] if p["type"] == "image_url"]
    header, data = part["image_url"]["url"].split(",", 1)
    assert header == "data:image/png;base64"
    return Image.open(io.BytesIO(base64.b64decode(data))).convert("RGB")


def test_every_label_is_the_count_the_pixels_show():
    prompts = shape_counting(60, seed=3)
    for prompt in prompts:
        question = prompt.messages[0]["content"][1]["text"]
        colour, kind = question.split()[2], question.split()[3].removesuffix("s")
        assert count_shapes(image_of(prompt), colour, kind) == int(prompt.label), question
    labels = Counter(p.label for p in prompts)
    assert len(labels) >= 4  # answers vary: a constant reply does not score
    assert shape_counting(5, seed=3) == prompts[:5]  # the seed alone decides the data


def test_each_kind_is_read_back_from_its_drawing():
    shapes = {0: ("red", "circle"), 4: ("blue", "square"), 8: ("green", "triangle")}
    shapes |= {2: ("yellow", "triangle"), 6: ("red", "square")}
    assert read_shapes(draw_shapes(shapes)) == shapes
    assert set(KINDS) == {kind for _, kind in shapes.values()}


def test_the_tiny_vlm_sees_an_image_as_nine_tokens():
    from relax_launch.models.build import ensure_model
    from relax_launch.models.vlm_processor import VisionProcessor

    processor = VisionProcessor(ensure_model("builtin:tiny-qwen2.5-vl"))
    prompt = shape_counting(1, seed=0)[0]
    encoded = processor.encode_chat(list(prompt.messages), [image_of(prompt)])
    assert encoded.image_grid_thw.tolist() == [[1, 6, 6]]
    image_token = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert encoded.ids.count(image_token) == 9


class BosTokenizer:
    """Adds a BOS id (1) unless told not to, as a Llama-style tokenizer does."""

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [1] * add_special_tokens + [ord(c) for c in text]}


def test_the_rendered_prompt_gets_no_special_tokens_the_template_did_not_write():
    # SGLang tokenizes the rendered chat without adding special tokens: the trainer's ids too
    processor = VisionProcessor.__new__(VisionProcessor)
    processor.tokenizer = BosTokenizer()
    assert processor.encode_text("hi", []).ids == [ord("h"), ord("i")]
