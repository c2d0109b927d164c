"""Prompts with images for a vision-language policy: images as data: URLs, files, Parquet bytes
and HF datasets Image values, read before the job starts (an unreadable one named by row and
part); the built-in visual task as data.dataset; the rollout's engine request and the trainer's
batch carrying them."""

from __future__ import annotations

import base64
import io
import itertools
import json
import zlib

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from relax_launch.config import ConfigError
from relax_launch.rl.batch import to_batch
from relax_launch.rl.config import RewardConfig, RewardSource
from relax_launch.rl.data import load_prompts
from relax_launch.rl.data_config import DataConfig, EvalConfig
from relax_launch.rl.inputs import read_inputs
from relax_launch.rl.prompt import Prompt
from relax_launch.rl.rollout import prompt_inputs, reply_sample
from relax_launch.rl.samples import Sample
from relax_launch.rl.vision_prompts import (
    EngineImages,
    PromptImages,
    image_parts,
    read_images,
    text_of,
    with_urls,
)
from relax_launch.trainer.batch import RowImages


def rgb_images(prompt: Prompt) -> list:
    """The images of ``prompt`` as the trainer's processor gets them (``VisionEncoder.encode``)."""
    return [image.convert("RGB") for *_, image in read_images(prompt)]


REWARD = RewardConfig(sources=(RewardSource(name="count", function="builtin:exact_numeric"),))


def png(colour: str = "red", size: tuple[int, int] = (28, 28)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, colour).save(buffer, format="PNG")
    return buffer.getvalue()


def chat(part: dict) -> list[dict]:
    return [{"role": "user", "content": [part, {"type": "text", "text": "What colour?"}]}]


def test_every_image_source_opens(tmp_path):
    path = tmp_path / "red.png"
    path.write_bytes(png())
    url = "data:image/png;base64," + base64.b64encode(png()).decode()
    parts = [
        {"type": "image_url", "image_url": {"url": url}},
        {"type": "image_url", "image_url": {"url": f"file://{path}"}},
        {"type": "image", "image": str(path)},
        {"type": "image", "image": png()},  # Parquet binary
        {"type": "image", "image": {"bytes": png(), "path": None}},  # HF datasets Image
        {"type": "image", "image": {"bytes": None, "path": str(path)}},
    ]
    for part in parts:
        (image,) = rgb_images(Prompt(0, tuple(chat(part))))
        assert image.size == (28, 28) and image.getpixel((3, 3)) == (255, 0, 0)


@pytest.mark.parametrize(
    ("part", "message"),
    [
        ({"type": "image", "image": "/nonexistent/a.png"}, "image file /nonexistent/a.png does"),
        ({"type": "image", "image": b"not a png"}, "not an image"),
        ({"type": "image_url", "image_url": {"url": "https://x.org/a.png"}}, "remote image URLs"),
        ({"type": "image"}, "an image part needs an image"),
    ],
)
def test_an_unreadable_image_is_refused_before_the_job_naming_row_and_part(tmp_path, part, message):
    path = tmp_path / "rows.jsonl"
    text = [{"role": "user", "content": [{"type": "text", "text": "no image here"}]}]
    rows = [{"messages": text, "label": "1"}, {"messages": chat(part), "label": "1"}]
    path.write_text("\n".join(json.dumps(r, default=str) for r in rows) + "\n")
    if isinstance(part.get("image"), bytes):  # bytes travel in Parquet, not JSON
        path = tmp_path / "rows.parquet"
        pq.write_table(pa.Table.from_pylist([{"messages": chat(part), "label": "1"}]), path)
    with pytest.raises(ConfigError, match=rf"row \d messages\[0\]\.content\[0\]: {message}"):
        read_inputs(DataConfig(dataset=str(path)), REWARD, vision=True)


def test_parquet_rows_with_image_bytes_are_read(tmp_path):
    path = tmp_path / "rows.parquet"
    rows = [{"messages": chat({"type": "image", "image": png("blue")}), "label": "3"}] * 2
    pq.write_table(pa.Table.from_pylist(rows), path)
    prompts = read_inputs(DataConfig(dataset=str(path)), REWARD, vision=True).prompts
    assert len(prompts) == 2 and prompts[0].label == "3"
    (image,) = rgb_images(prompts[0])
    assert image.getpixel((0, 0)) == (0, 0, 255)


def test_a_text_policy_refuses_rows_with_images(tmp_path):
    path = tmp_path / "rows.jsonl"
    url = "data:image/png;base64," + base64.b64encode(png()).decode()
    path.write_text(json.dumps({"messages": chat({"type": "image_url", "image_url": url})}) + "\n")
    with pytest.raises(ConfigError, match="row 0 has image parts, and trainer.model is not"):
        read_inputs(DataConfig(dataset=str(path)), REWARD)


def test_eval_rows_with_images_are_checked_as_the_training_rows(tmp_path):
    path, text = tmp_path / "images.jsonl", tmp_path / "text.jsonl"
    url = "data:image/png;base64," + base64.b64encode(png()).decode()
    path.write_text(json.dumps({"messages": chat({"type": "image_url", "image_url": url})}) + "\n")
    text.write_text(json.dumps({"prompt": "What is 1 + 1?", "label": "2"}) + "\n")
    evaluation = EvalConfig(data={"dataset": str(path)})
    with pytest.raises(ConfigError, match="eval.data.dataset: row 0 has image parts"):
        read_inputs(DataConfig(dataset=str(text)), REWARD, evaluation)
    missing = chat({"type": "image", "image": str(tmp_path / "none.png")})
    path.write_text(json.dumps({"messages": missing}) + "\n")
    with pytest.raises(ConfigError, match="eval.data.dataset: row 0 .* does not exist"):
        read_inputs(DataConfig(dataset=str(text)), REWARD, evaluation, vision=True)


def test_arrow_merged_part_fields_are_dropped_and_text_parts_read_as_text(tmp_path):
    """Arrow gives every part of a column every struct field: a text part with ``image: None``
    would be an image to Qwen2.5-VL's template (it tests ``'image' in content``). A text row's
    unrelated ``images`` column is not TRL's image column."""
    path = tmp_path / "rows.parquet"
    texts = [{"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text"}]}]
    rows = [
        {"messages": chat({"type": "image", "image": png("blue")}), "images": "a caption"},
        {"messages": texts, "images": "not images"},
    ]
    pq.write_table(pa.Table.from_pylist(rows), path)
    imaged, text = read_inputs(DataConfig(dataset=str(path)), REWARD, vision=True).prompts
    image_part, text_part = imaged.messages[0]["content"]
    assert set(image_part) == {"type", "image"} and set(text_part) == {"type", "text"}
    assert text.messages[0]["content"] == "Hi"  # a string: a text template prints it as text
    assert [p for _, p in image_parts(text.messages)] == []


def test_the_built_in_visual_task_is_a_dataset_with_checkable_labels():
    data = DataConfig(dataset="builtin:shape_counting", seed=5)
    prompts = read_inputs(data, REWARD, vision=True).prompts
    assert len(prompts) == 1000 and all(p.label.isdigit() for p in prompts)
    assert [where for where, _ in image_parts(prompts[0].messages)] == ["messages[0].content[0]"]
    assert text_of(prompts[0].messages[0]["content"]).startswith("How many")
    assert load_prompts(data)[:3] == prompts[:3]  # the seed decides


def images_of(prompt: Prompt) -> PromptImages:
    import torch

    rows = RowImages(torch.ones(4, 6), torch.tensor([[1, 2, 2]]))
    return PromptImages(("data:image/png;base64,AAAA",), (5, 9, 6), rows)


def test_the_engine_gets_the_template_ids_and_the_images_and_the_trainer_the_patches():
    import torch

    prompt = Prompt(0, tuple(chat({"type": "image"})), "2")
    prompt = Prompt(0, prompt.messages, "2", images=images_of(prompt))
    ids = [5, 9, 6]  # one image token: 4 patches merged 2 x 2
    assert prompt_inputs(prompt, ids) == {
        "input_ids": [5, 9, 6],
        "image_data": ["data:image/png;base64,AAAA"],
        "return_prompt_token_ids": True,
    }
    reply = {
        "text": "2",
        "output_ids": [7],
        "prompt_token_ids": [5, 9, 6],
        "meta_info": {"output_token_logprobs": [[-0.5, 7, None]]},
    }
    sample = reply_sample(0, prompt, ids, reply)
    assert sample.question == "What colour?" and sample.images is prompt.images.rows
    text = Sample(1, "q", None, [1, 2], [3], [-1.0], "", "1")
    batch = to_batch([sample, text], 0.0)
    assert batch.images == (prompt.images.rows, None)
    assert batch.shape().patches == 4 and torch.equal(batch.pack()[2], torch.ones(4, 6))
    other = reply | {"prompt_token_ids": [5, 9, 9, 6]}
    with pytest.raises(RuntimeError, match=r"prompt 0 \(.*: 4 tokens\) are not the trainer's"):
        reply_sample(0, prompt, ids, other)


def test_an_hf_datasets_image_column_fills_the_rows_image_parts(tmp_path):
    """TRL's layout in a save_to_disk directory: messages with {"type": "image"} parts and an
    ``images`` column of datasets' Image values ({"bytes", "path"} structs in Arrow)."""
    from test_datasets import save_to_disk

    messages = [
        {
            "role": "user",
            "content": [
                {"type": "image", "text": None},
                {"type": "text", "text": "Which colour?"},
            ],
        }
    ]
    rows = [{"messages": messages, "images": [{"bytes": png("green"), "path": None}], "label": "g"}]
    directory = save_to_disk(tmp_path / "ds", rows)
    (prompt,) = read_inputs(DataConfig(dataset=str(directory)), REWARD, vision=True).prompts
    (image,) = rgb_images(prompt)
    assert image.getpixel((0, 0)) == (0, 128, 0)
    extra = [{**rows[0], "images": rows[0]["images"] * 2}]
    with pytest.raises(ConfigError, match="2 images for 1 image parts"):
        read_inputs(DataConfig(dataset=str(save_to_disk(tmp_path / "x", extra))), REWARD)


def test_the_cli_reads_headers_and_rank_0_decodes_each_image_once(tmp_path):
    """A truncated file has a sound header: the CLI's check (decode=False) passes it, rank 0's
    (the job's, before any engine or trainer starts) refuses it naming the row and the part;
    pixels beyond PIL's decompression-bomb bound are refused from the header, before decoding."""
    truncated = tmp_path / "cut.png"
    truncated.write_bytes(png(size=(64, 64))[:-40])
    header = png(size=(1, 1))
    bombs = []
    for side in (10_000, 20_000):  # PIL warns above its bound, refuses to open above twice it
        claim = b"IHDR" + side.to_bytes(4, "big") * 2 + header[24:29]
        bombs.append(tmp_path / f"bomb{side}.png")
        crc = zlib.crc32(claim).to_bytes(4, "big")
        bombs[-1].write_bytes(header[:12] + claim + crc + header[33:])

    def rows(path):
        rows = tmp_path / f"{path.stem}.jsonl"
        rows.write_text(json.dumps({"messages": chat({"type": "image", "image": str(path)})}))
        return DataConfig(dataset=str(rows))

    assert read_inputs(rows(truncated), REWARD, vision=True, decode=False).prompts
    with pytest.raises(ConfigError, match=r"row 0 messages\[0\]\.content\[0\]: not an image"):
        read_inputs(rows(truncated), REWARD, vision=True)
    for bomb, decode in itertools.product(bombs, (False, True)):
        with pytest.raises(ConfigError, match="exceeds 89478485 pixels.*; dataset images are"):
            read_inputs(rows(bomb), REWARD, vision=True, decode=decode)


def test_each_image_is_made_the_engines_png_once_within_the_budget():
    """The engine form is a PNG data: URL of the RGB pixels: an RGB PNG data: URL is its own
    (the same string), any other (a JPEG: SGLang decodes it with nvJPEG on a GPU, pixels not
    PIL's) is encoded once and kept by its bytes while the budget lasts."""
    buffer = io.BytesIO()
    Image.new("RGB", (16, 16), "red").save(buffer, format="JPEG")
    jpeg, rgba = buffer.getvalue(), io.BytesIO()
    Image.new("RGBA", (4, 4), (0, 0, 255, 9)).save(rgba, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(png()).decode()
    parts = [
        {"type": "image_url", "image_url": {"url": url}},
        {"type": "image", "image": jpeg},
        {"type": "image", "image": rgba.getvalue()},
    ]
    prompt = Prompt(0, tuple(chat(parts[0])) + tuple(chat(parts[1])) + tuple(chat(parts[2])))
    engine = EngineImages()
    first = [engine.url(*found) for found in read_images(prompt)]
    again = [engine.url(*found) for found in read_images(prompt)]
    assert first[0] is url and all(a is b for a, b in zip(first, again, strict=True))
    assert engine.held == len(first[1]) + len(first[2])
    for made, (_, _, image) in zip(first[1:], read_images(prompt)[1:], strict=True):
        sent = Image.open(io.BytesIO(base64.b64decode(made.partition(",")[2])))
        assert made.startswith("data:image/png;base64,") and sent.mode == "RGB"
        assert sent.tobytes() == image.convert("RGB").tobytes()  # the trainer's pixels
    tight = EngineImages(budget=len(first[1]))
    assert tight.url(*read_images(prompt)[1]) == first[1] and tight.held == len(first[1])
    tight.url(*read_images(prompt)[2])
    assert len(tight.urls) == 1  # over the budget: made again at each draw
    messages = with_urls(prompt.messages, first)
    assert [p for _, p in image_parts(messages)] == [
        {"type": "image_url", "image_url": {"url": u}} for u in first
    ]
