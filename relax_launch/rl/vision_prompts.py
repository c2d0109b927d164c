"""Prompts with images for a vision-language policy: their image parts read (on rank 0), and
encoded once for both sides of the step.

A chat message's content may be a list of parts: ``{"type": "text", "text": ...}``, and images
as ``{"type": "image_url", "image_url": {"url": URL}}`` or ``{"type": "image", "image":
SOURCE}``. An image is a ``data:`` URL, a local file (a path or ``file://`` URL), or the
image file's bytes (a Parquet binary field, or an HF ``datasets`` Image value ``{"bytes",
"path"}``); remote URLs are refused (nothing is downloaded). A row's ``images`` list (TRL's
layout: ``{"type": "image"}`` parts without an image, the images in a column) fills them in
order; a row without such parts keeps its ``images`` field as data (``rl/data.py``), and a
content of text parts alone reads as one string.

``VisionEncoder.encode`` gives the trainer's token ids (the chat template with each image's
placeholder expanded to its token count, ``models/vlm_processor.py``) and the ``PromptImages``
the rollout and the trainer need: the images as ``data:`` URLs with the template's ids (one
placeholder per image: SGLang's Qwen-VL processor expands them itself) for the engine, and the
patches and grids for the trainer. The engine's expansion is the trainer's: the rollout checks
every reply's prompt token count against it. Each image's ``data:`` URL is made once for the
job (``EngineImages``) and becomes the prompt's image part, so every request of the prompt (its
samples, a teacher, a judge, an agentic turn) sends that one string, not checked again
(``inference/inprocess.py``): ``rl/inputs.py`` read every image before the job started.
"""

from __future__ import annotations

import base64
import hashlib
import io
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from relax_launch.rl.prompt import Prompt

if TYPE_CHECKING:  # torch: only on rank 0's encoder (the CLI's input check reads images alone)
    from relax_launch.trainer.batch import RowImages

IMAGE_TYPES = ("image", "image_url")
# What SGLang's Qwen-VL processor reads as media in a prompt's decoded text: the family's
# placeholder tokens, and its /generate form's image sentinel
# (``sglang/srt/multimodal/processors/qwen_vl.py``, ``image_token_regex``)
MEDIA_PLACEHOLDERS = ("<|image_pad|>", "<|video_pad|>", "<|audio_pad|>", "<image>")
# Dataset images are held to PIL's decompression-bomb bound (Image.MAX_IMAGE_PIXELS), not to
# gateway.images: that bounds what external callers send the gateway
MAX_PIXELS = 89_478_485
BOUND = "dataset images are held to PIL's decompression-bomb bound: downscale it"
ENCODED_BYTES = 2**30  # rank 0 keeps at most this much of the dataset's PNG data: URLs


@dataclass(frozen=True)
class PromptImages:
    """One prompt's images, encoded: for the engine (``urls``, ``engine_ids``) and the
    trainer (``rows``)."""

    urls: tuple[str, ...]
    engine_ids: tuple[int, ...]
    rows: RowImages


def image_parts(
    messages: tuple[dict[str, Any], ...] | list[dict[str, Any]],
) -> list[tuple[str, Any]]:
    """(where, part) of every image part of ``messages``, in order."""
    found = []
    for m, message in enumerate(messages):
        content = message.get("content")
        if not isinstance(content, list):
            continue
        for k, part in enumerate(content):
            if isinstance(part, dict) and part.get("type") in IMAGE_TYPES:
                found.append((f"messages[{m}].content[{k}]", part))
    return found


def attach_images(
    messages: tuple[dict[str, Any], ...], images: Any, where: str
) -> tuple[dict[str, Any], ...]:
    """A row's ``images`` column (TRL's layout; an HF datasets ``Sequence(Image)`` reads as
    ``{"bytes", "path"}`` values) given to its image parts without an image, in order."""
    if images is None:
        return messages
    if not isinstance(images, list):
        raise ValueError(f"{where}: images must be a list of images, one per image part")
    left = list(images)
    out = []
    for message in messages:
        content = message["content"]
        if isinstance(content, list):
            content = [
                {**part, "image": left.pop(0)}
                if part.get("type") == "image" and not part.get("image") and left
                else part
                for part in content
            ]
        out.append({**message, "content": content})
    if left:
        raise ValueError(f"{where}: {len(images)} images for {len(images) - len(left)} image parts")
    return tuple(out)


def shows_media(ids_or_text: list[int] | str, tokenizer: Any) -> bool:
    """Whether tokens (or their text) show a media placeholder where SGLang's multimodal
    processor looks for one: it decodes a prompt's ids, special tokens kept, and reads each
    placeholder as one more image, video or audio than it may be sent (a sampled one: the tiny
    random policy samples them), refusing the request (400)."""
    text = ids_or_text
    if not isinstance(text, str):
        text = tokenizer.decode(list(text), skip_special_tokens=False) if text else ""
    return any(placeholder in text for placeholder in MEDIA_PLACEHOLDERS)


def text_of(content: Any) -> str:
    """A message's text: its content, or its text parts joined."""
    if isinstance(content, str):
        return content
    return "".join(p.get("text") or "" for p in content if isinstance(p, dict))


def image_source(part: dict[str, Any]) -> Any:
    """The image an image part names, as the row gives it (the module docstring's sources)."""
    source = part.get("image_url") if part.get("type") == "image_url" else part.get("image")
    if isinstance(source, dict):  # {"url": ...} (OpenAI), {"bytes", "path"} (HF datasets Image)
        source = source.get("url") or source.get("bytes") or source.get("path")
    return source


def image_bytes(part: dict[str, Any]) -> bytes:
    """The image file's bytes of one image part (the module docstring's sources); a ValueError
    saying what is wrong."""
    source = image_source(part)
    if isinstance(source, bytes | bytearray):
        return bytes(source)
    if not isinstance(source, str) or not source:
        raise ValueError(f"an {part.get('type')} part needs an image (a data: URL, a path, bytes)")
    if source.startswith("data:"):
        try:
            return base64.b64decode(source.partition(",")[2], validate=True)
        except ValueError:
            raise ValueError("its data: URL is not base64") from None
    if "://" in source and not source.startswith("file://"):
        raise ValueError(f"remote image URLs are not read (only data: URLs and files): {source}")
    path = Path(source.removeprefix("file://")).expanduser()
    if not path.is_file():
        raise ValueError(f"image file {path} does not exist")
    return path.read_bytes()


def opened(data: bytes, decode: bool = True) -> Any:
    """The PIL image of an image file's bytes, in its own mode; ``decode`` False: its header
    alone (type and size, no pixels: the CLI's check, rank 0 decodes in full). A ValueError when
    they are not an image or exceed ``MAX_PIXELS``."""
    from PIL import Image, UnidentifiedImageError

    try:
        image = Image.open(io.BytesIO(data))
    except Image.DecompressionBombError as exc:  # above twice the bound: PIL refuses to open
        raise ValueError(f"the image exceeds {MAX_PIXELS} pixels ({exc}); {BOUND}") from None
    except (UnidentifiedImageError, OSError) as exc:
        raise ValueError(f"not an image ({exc})") from None
    width, height = image.size
    if width * height > MAX_PIXELS:
        raise ValueError(f"a {width}x{height} image exceeds {MAX_PIXELS} pixels; {BOUND}")
    try:
        if decode:
            image.load()  # a truncated or corrupt file fails here, not at a draw
    except Exception as exc:  # noqa: BLE001 - OSError, SyntaxError, EOFError, struct.error ...
        raise ValueError(f"not an image ({exc})") from None
    return image


def open_image(data: bytes) -> Any:
    """The RGB PIL image of an image file's bytes; a ValueError when they are not an image."""
    return opened(data).convert("RGB")


def read_images(prompt: Prompt, decode: bool = True) -> list[tuple[Any, bytes, Any]]:
    """(source, file bytes, ``opened`` image) of each of ``prompt``'s image parts; a
    ValueError naming the row and the part."""
    found = []
    for where, part in image_parts(prompt.messages):
        try:
            data = image_bytes(part)
            found.append((image_source(part), data, opened(data, decode)))
        except ValueError as exc:
            raise ValueError(f"row {prompt.index} {where}: {exc}") from None
    return found


def png_url(image: Any) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def sent_as_is(source: Any, image: Any) -> bool:
    """Whether ``source`` (its ``opened`` ``image``) already is what engines are sent: an RGB
    PNG ``data:`` URL."""
    is_data = isinstance(source, str) and source.startswith("data:")
    return is_data and image.format == "PNG" and image.mode == "RGB"


def engine_url(source: Any, image: Any) -> str:
    """What engines are sent of an image (``source``, its ``opened`` ``image``): a PNG ``data:``
    URL of its RGB pixels, the trainer's; never a JPEG, which SGLang decodes on a GPU with
    nvJPEG, whose pixels are not PIL's."""
    return source if sent_as_is(source, image) else png_url(image.convert("RGB"))


class EngineImages:
    """Each dataset image as the engines are sent it (``engine_url``), made once for the job:
    a source that already is an RGB PNG ``data:`` URL is sent as it is (no copy); any other is
    encoded at its first draw and kept, by its bytes' hash, while the kept URLs total at most
    ``budget`` bytes (first come: a shuffled epoch finds that share of its images), later ones
    encoded again at each draw."""

    def __init__(self, budget: int = ENCODED_BYTES) -> None:
        self.budget, self.held = budget, 0
        self.urls: dict[bytes, str] = {}

    def url(self, source: Any, data: bytes, image: Any) -> str:
        if sent_as_is(source, image):
            return source
        key = hashlib.blake2b(data, digest_size=16).digest()
        url = self.urls.get(key)
        if url is None:
            url = engine_url(source, image)
            if self.held + len(url) <= self.budget:
                self.urls[key], self.held = url, self.held + len(url)
        return url


def with_urls(messages: tuple[dict[str, Any], ...], urls: list[str]) -> tuple[dict[str, Any], ...]:
    """``messages`` with their image parts, in order, as OpenAI ``image_url`` parts of
    ``urls``: what a rollout function, a judge and the agent client read (a chat template
    renders either part type as the same image)."""
    left = iter(urls)
    out = []
    for message in messages:
        content = message["content"]
        if isinstance(content, list):
            content = [
                {"type": "image_url", "image_url": {"url": next(left)}}
                if isinstance(part, dict) and part.get("type") in IMAGE_TYPES
                else part
                for part in content
            ]
        out.append({**message, "content": content})
    return tuple(out)


class VisionEncoder:
    """Prompts -> token ids and ``PromptImages`` with the processor of the model in
    ``model_dir`` (a vision-language policy's)."""

    def __init__(self, model_dir: str | Path) -> None:
        from relax_launch.models.vlm_processor import VisionProcessor  # torch, transformers

        self.processor = VisionProcessor(model_dir)
        self.engine_images = EngineImages()

    def encode(self, prompt: Prompt) -> tuple[Prompt, list[int]]:
        """``prompt`` with its ``images`` encoded and its image parts as the engine's ``data:``
        URLs (``EngineImages``; none: unchanged), and the trainer's ids."""
        tokenizer = self.processor.tokenizer
        found = read_images(prompt)
        if found:
            urls = [self.engine_images.url(*image) for image in found]
            prompt = replace(prompt, messages=with_urls(prompt.messages, urls))
        text = tokenizer.apply_chat_template(
            list(prompt.messages), add_generation_prompt=True, tokenize=False
        )
        if not found:
            return prompt, tokenizer.encode(text, add_special_tokens=False)
        from relax_launch.trainer.batch import RowImages  # torch, loaded with the processor

        encoded = self.processor.encode_text(text, [image.convert("RGB") for *_, image in found])
        vision = PromptImages(
            urls=tuple(urls),
            engine_ids=tuple(tokenizer.encode(text, add_special_tokens=False)),
            rows=RowImages(encoded.pixel_values.float(), encoded.image_grid_thw.long()),
        )
        return replace(prompt, images=vision), list(encoded.ids)
