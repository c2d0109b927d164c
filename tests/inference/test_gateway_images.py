"""Images in generation requests (gateway.images), against a real gateway over the scripted
upstream: every refusal is a 400 in the OpenAI error form before any engine is contacted; an
accepted image reaches the engine as a data URL of its real type, local files read by the
gateway only under allowed_dirs. The controller's in-process client holds only the images user
code made (a rollout function's tool) to the same limits; its own dataset images, read before the
job started, go as they are."""

from __future__ import annotations

import base64
import dataclasses
import io
import json
import os
import struct
import zlib
from pathlib import Path

import httpx
import pytest
from conftest import make_manager, serve
from PIL import Image
from pydantic import ValidationError

from relax_launch.inference.client import InferenceError
from relax_launch.inference.config import GatewayConfig
from relax_launch.inference.image_config import ImageLimits
from relax_launch.inference.images import ImagePolicy, ImageRefused
from relax_launch.inference.inprocess import EngineClients


def encoded(kind: str = "PNG", size: tuple[int, int] = (8, 6)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, (200, 30, 30)).save(buffer, format=kind)
    return buffer.getvalue()


def as_data(raw: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(raw).decode()}"


def bomb(width: int = 10_000, height: int = 10_000) -> bytes:
    """A 1x1 PNG whose header claims ``width`` x ``height``: decoding it would take the claim."""
    raw = encoded(size=(1, 1))
    header = b"IHDR" + struct.pack(">II", width, height) + raw[24:29]
    return raw[:12] + header + struct.pack(">I", zlib.crc32(header)) + raw[33:]


PNG = encoded()
PAD = 8  # the image placeholder token


def chat(*urls: str, text: str = "How many?") -> dict:
    parts = [{"type": "image_url", "image_url": {"url": url}} for url in urls]
    return {"messages": [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]}


def vision_manager(role: str, url: str, vision: bool = True):
    manager = make_manager(role, [url])
    image_token = PAD if vision else None
    manager.models["m"] = dataclasses.replace(manager.models["m"], image_token_id=image_token)
    return manager


@pytest.fixture
def images_dir(tmp_path: Path) -> Path:
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    (allowed / "shape.png").write_bytes(PNG)
    (tmp_path / "secret.png").write_bytes(PNG)
    (allowed / "escape.png").symlink_to(tmp_path / "secret.png")
    os.mkfifo(allowed / "pipe.png")  # opened blocking, it would hold a worker thread forever
    return allowed


def refused_cases(allowed: Path) -> dict[str, tuple[dict, dict, str]]:
    """what -> (request body, gateway.images, words the 400 says)."""
    small, only = {"max_bytes": 64}, {"allowed_dirs": [str(allowed)]}
    video = {"type": "video_url", "video_url": {"url": "x"}}
    cases = [
        ("http URL", chat("http://example.com/a.png"), {}, "scheme 'http' is not fetched"),
        ("https URL", chat("https://example.com/a.png"), {}, "give a data: URL"),
        ("ftp URL", chat("ftp://example.com/a.png"), {}, "not fetched"),
        ("not an image", chat(as_data(b"hello, not pixels")), {}, "not a decodable PNG"),
        ("BMP", chat(as_data(encoded("BMP"), "image/bmp")), {}, "other types are not served"),
        ("TIFF", chat(as_data(encoded("TIFF"))), {}, "not a decodable PNG, JPEG, WebP or GIF"),
        ("truncated", chat(as_data(PNG[: len(PNG) // 2])), {}, "not a decodable"),
        ("not base64", chat("data:image/png;base64,@@@@"), {}, "not valid base64"),
        ("not base64 form", chat("data:image/png,rawbytes"), {}, "must be base64"),
        ("bytes", chat(as_data(encoded(size=(64, 64)))), small, "exceeds 64 bytes"),
        ("pixels", chat(as_data(encoded(size=(50, 40)))), {"max_pixels": 1999}, "50x40"),
        ("count", chat(*[as_data(PNG)] * 3), {"max_images": 2}, "more than 2 images"),
        ("files off", chat(str(allowed / "shape.png")), {}, "local files are off"),
        ("outside", chat(str(allowed.parent / "secret.png")), only, "not allowed"),
        ("symlink out", chat(f"file://{allowed}/escape.png"), only, "not allowed"),
        ("dot-dot", chat(f"{allowed}/../secret.png"), only, "not allowed"),
        ("relative", chat("shape.png"), only, "not absolute"),
        ("missing", chat(f"{allowed}/none.png"), only, "cannot be read"),
        (
            "video part",
            {"messages": [{"role": "user", "content": [video]}]},
            {},
            "'video_url' is not served",
        ),
        ("not a string", chat(7), {}, "not int"),
        ("NUL in path", chat(f"file://{allowed}/shape.png%00"), only, "is malformed"),
        ("malformed URL", chat("http://[x"), {}, "malformed"),
        ("bomb", chat(as_data(bomb())), {}, "a 10000x10000 image exceeds"),
        ("FIFO", chat(f"{allowed}/pipe.png"), only, "not a regular file"),
        ("video_data", {**chat(), "video_data": ["http://x/v.mp4"]}, {}, "video_data not served"),
        ("audio_data", {**chat(), "audio_data": "/etc/passwd"}, {}, "audio_data not served"),
        ("input_embeds", {**chat(), "input_embeds": [[0.0]]}, {}, "input_embeds not served"),
    ]
    return {what: (body, limits, words) for what, body, limits, words in cases}


REFUSED = ["http URL", "https URL", "ftp URL", "not an image", "BMP", "TIFF", "truncated"]
REFUSED += ["not base64", "not base64 form", "bytes", "pixels", "count", "files off", "outside"]
REFUSED += ["symlink out", "dot-dot", "relative", "missing", "video part", "not a string"]
REFUSED += ["NUL in path", "malformed URL", "bomb", "FIFO", "video_data", "audio_data"]
REFUSED += ["input_embeds"]


@pytest.mark.parametrize("what", REFUSED)
def test_a_bad_image_is_refused_before_any_engine(upstream, images_dir, what):
    body, limits, words = refused_cases(images_dir)[what]
    manager = vision_manager("rollout", f"{upstream.url}/e0")
    with serve({"rollout": manager}, images=limits) as url:  # a FIFO waited on: a timeout
        reply = httpx.post(f"{url}/rollout/v1/chat/completions", json=body, timeout=10)
    assert reply.status_code == 400, (what, reply.text)
    error = reply.json()["error"]
    assert error["code"] == 400 and words in error["message"], (what, error)
    assert upstream.requests == []


def test_a_text_model_refuses_images_saying_so(upstream):
    manager = vision_manager("rollout", f"{upstream.url}/e0", vision=False)
    with serve({"rollout": manager}) as url:
        chat_reply = httpx.post(f"{url}/rollout/v1/chat/completions", json=chat(as_data(PNG)))
        native = {"text": "<|image_pad|>", "image_data": [as_data(PNG)]}
        generate_reply = httpx.post(f"{url}/rollout/generate", json=native)
        text_only = httpx.post(f"{url}/rollout/v1/chat/completions", json=chat())
        none = httpx.post(f"{url}/rollout/generate", json={"text": "x", "image_data": []})
        unserved = {
            field: httpx.post(f"{url}/rollout/generate", json={"text": "x", field: value})
            for field, value in (
                ("video_data", "http://example.com/v.mp4"),
                ("audio_data", ["/etc/passwd"]),
                ("input_embeds", [[0.0, 1.0]]),
            )
        }
    for reply in (chat_reply, generate_reply):
        assert reply.status_code == 400
        assert "model 'm' is not a vision-language model" in reply.json()["error"]["message"]
    for field, reply in unserved.items():  # an engine would fetch or open what they name
        assert reply.status_code == 400, field
        assert f"{field} not served" in reply.json()["error"]["message"]
    assert text_only.status_code == none.status_code == 200  # text alone; no images is none
    paths = [r["path"] for r in upstream.requests]
    assert paths == ["/e0/v1/chat/completions", "/e0/generate"]


def test_images_reach_the_engine_as_data_urls_of_their_real_type(upstream, images_dir):
    jpeg = encoded("JPEG")
    manager = vision_manager("rollout", f"{upstream.url}/e0")
    allowed = {"allowed_dirs": [str(images_dir)]}
    body = chat(as_data(PNG), f"file://{images_dir}/shape.png", as_data(jpeg, "image/png"))
    with serve({"rollout": manager}, images=allowed) as url:
        reply = httpx.post(f"{url}/rollout/v1/chat/completions", json=body)
        native = {"text": "x", "image_data": [str(images_dir / "shape.png")]}
        generated = httpx.post(f"{url}/rollout/generate", json=native)
        streamed = httpx.post(f"{url}/rollout/v1/chat/completions", json={**body, "stream": True})
    assert reply.status_code == generated.status_code == streamed.status_code == 200
    sent = json.loads(upstream.requests[0]["body"])
    urls = [p["image_url"]["url"] for p in sent["messages"][0]["content"][:3]]
    assert urls == [as_data(PNG), as_data(PNG), as_data(jpeg, "image/jpeg")]
    assert sent["return_prompt_token_ids"] is True  # the prompt's ids as the engine saw them
    assert json.loads(upstream.requests[1]["body"])["image_data"] == [as_data(PNG)]
    assert "return_prompt_token_ids" not in json.loads(upstream.requests[2]["body"])


def test_input_ids_show_each_image_by_one_placeholder(upstream):
    # an expanded run hangs SGLang's Qwen-VL processor (StopIteration in a future): never sent
    manager = vision_manager("rollout", f"{upstream.url}/e0")
    image = [as_data(PNG)]
    with serve({"rollout": manager}) as url:
        replies = {
            ids_name: httpx.post(f"{url}/rollout/generate", json=body)
            for ids_name, body in (
                ("one", {"input_ids": [1, PAD, 2], "image_data": image}),
                ("expanded", {"input_ids": [1, PAD, PAD, 2], "image_data": image}),
                ("missing", {"input_ids": [1, 2], "image_data": image}),
                ("batch", {"input_ids": [[1, PAD, 2]], "image_data": [image]}),
            )
        }
    assert replies.pop("one").status_code == 200
    for name, reply in replies.items():
        assert reply.status_code == 400, name
        assert "one placeholder token 8" in reply.text or "one prompt per request" in reply.text
    assert len(upstream.requests) == 1


def test_the_judge_form_sends_its_images_with_the_rendered_prompt(upstream):
    manager = vision_manager("genrm", f"{upstream.url}/e0")
    renderers = {"genrm": lambda messages, kwargs: "<|image_pad|> Score:"}
    with serve({"genrm": manager}, renderers=renderers) as url:
        judged = httpx.post(f"{url}/genrm/generate", json=chat(as_data(PNG)))
        remote = httpx.post(f"{url}/genrm/generate", json=chat("https://x/a.png"))
    assert judged.status_code == 200 and remote.status_code == 400
    sent = json.loads(upstream.requests[0]["body"])
    assert sent["image_data"] == [as_data(PNG)] and len(upstream.requests) == 1


def shown_as_qwen(messages, kwargs) -> str:
    """The judge prompt as Qwen-VL's template renders it: each image, then the text."""
    parts = messages[0]["content"]
    images = "<|vision_start|><|image_pad|><|vision_end|>" * sum(p["type"] != "text" for p in parts)
    return images + "".join(p.get("text", "") for p in parts) + " Score:"


def test_a_judge_prompt_spelling_out_a_placeholder_is_refused_naming_the_count(upstream):
    manager = vision_manager("genrm", f"{upstream.url}/e0")
    renderers = {"genrm": shown_as_qwen}
    spelled = [chat(as_data(PNG), text=t) for t in ("a <image>", "<|video_pad|>", "<|image_pad|>")]
    with serve({"genrm": manager}, renderers=renderers) as url:
        refused = [httpx.post(f"{url}/genrm/generate", json=body) for body in spelled]
        judged = httpx.post(f"{url}/genrm/generate", json=chat(as_data(PNG), text="< image>"))
    for reply in refused:
        assert reply.status_code == 400, reply.text
        assert "shows 2 media placeholders for 1 images" in reply.text
    assert judged.status_code == 200 and len(upstream.requests) == 1
    upstream.reset()
    engines = EngineClients(
        {"genrm": vision_manager("genrm", f"{upstream.url}/e0")}, timeout_s=10, renderers=renderers
    )
    engines.start()
    try:
        with pytest.raises(InferenceError, match="2 media placeholders for 1 images") as error:
            engines.run(engines.client("genrm").request("/generate", spelled[0]), "judge")
    finally:
        engines.close()
    assert error.value.status == 400 and upstream.requests == []


def dataset_image(tmp_path: Path) -> tuple[bytes, str]:
    """A JPEG dataset row read before start as a job reads it, and its engine form: a PNG
    ``data:`` URL, larger than the JPEG (noise compresses badly without loss)."""
    from relax_launch.rl.config import RewardConfig, RewardSource
    from relax_launch.rl.data_config import DataConfig
    from relax_launch.rl.inputs import read_inputs
    from relax_launch.rl.vision_prompts import EngineImages, read_images

    jpeg = tmp_path / "photo.jpg"
    Image.effect_noise((64, 64), 60).convert("RGB").save(jpeg, quality=90)
    part = {"type": "image", "image": str(jpeg)}
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"messages": [{"role": "user", "content": [part]}]}) + "\n")
    reward = RewardConfig(sources=(RewardSource(name="r", function="builtin:exact_numeric"),))
    (prompt,) = read_inputs(DataConfig(dataset=str(rows)), reward, vision=True).prompts
    (found,) = read_images(prompt)
    return jpeg.read_bytes(), EngineImages().url(*found)


def test_the_controllers_dataset_images_are_not_held_to_gateway_images(upstream, tmp_path):
    """A dataset image read before start goes to the engine whatever gateway.images says: its
    PNG form exceeds max_bytes though the JPEG file does not (refused mid-run before)."""
    jpeg, url = dataset_image(tmp_path)
    png_size = len(base64.b64decode(url.partition(",")[2]))
    assert len(jpeg) < png_size
    limits = ImageLimits(max_bytes=len(jpeg), max_pixels=64 * 64, max_images=1)
    manager = vision_manager("rollout", f"{upstream.url}/e0")
    engines = EngineClients({"rollout": manager}, timeout_s=10, images=ImagePolicy(limits))
    engines.start()
    body = {"input_ids": [1, PAD, 2], "image_data": [url]}
    try:
        reply = engines.run(engines.client("rollout").request("/generate", body), "generate")
    finally:
        engines.close()
    assert reply["received"]["image_data"] == [url]
    assert ImagePolicy(limits).checked(chat(as_data(jpeg, "image/jpeg")), "m", PAD)  # passes
    with pytest.raises(ImageRefused, match=f"an image of {png_size} bytes exceeds"):
        ImagePolicy(limits).checked(body, "m", PAD)  # what an external caller sending it gets


def test_user_codes_images_are_checked_as_an_external_callers(images_dir):
    """Images a rollout function's conversation adds (the agent client's ``made``) are held to
    gateway.images, the refusal naming the message and the tool; allowed files go as data; the
    controller's own (index 0) go as they are."""
    policy = ImagePolicy(ImageLimits(allowed_dirs=(str(images_dir),), max_bytes=len(PNG)))
    own, large = as_data(PNG), as_data(encoded(size=(64, 64)))
    made = {1: "messages[3], tool 'zoom'"}
    file = f"file://{images_dir}/shape.png"
    assert policy.checked_user_images(["own", file], made) == ["own", as_data(PNG)]
    for url, words in ((large, "gateway.images.max_bytes"), ("http://x/a.png", "not fetched")):
        with pytest.raises(ImageRefused, match=words) as refused:
            policy.checked_user_images([own, url], made)
        assert "(messages[3], tool 'zoom') is refused" in str(refused.value)


def test_the_in_process_client_sends_the_controllers_images_as_they_are(upstream):
    """No gateway.images check on the controller's requests (user code's images were checked
    by the agent client); a model that takes no images and ids not showing one placeholder per
    image are still refused before any engine."""
    manager = vision_manager("rollout", f"{upstream.url}/e0")
    engines = EngineClients({"rollout": manager}, timeout_s=10, images=ImagePolicy())
    engines.start()
    client = engines.client("rollout")
    remote = {"input_ids": [1, PAD, 2], "image_data": ["data:x"]}  # the policy would refuse it
    try:
        reply = engines.run(client.request("/generate", remote), "generate")
        with pytest.raises(InferenceError, match="one placeholder token") as error:
            body = {"input_ids": [1, PAD, PAD, 2], "image_data": ["data:x"]}
            engines.run(client.request("/generate", body), "generate")
    finally:
        engines.close()
    assert reply["received"]["image_data"] == ["data:x"] and error.value.status == 400
    assert len(upstream.requests) == 1


def test_allowed_dirs_must_be_absolute(tmp_path):
    with pytest.raises(ValidationError, match="'relative/dir' is not an absolute path"):
        GatewayConfig(images={"allowed_dirs": ["relative/dir"]})
    assert GatewayConfig(images={"allowed_dirs": [str(tmp_path)]}).images.allowed_dirs
