"""Images in generation requests, checked before any engine sees them (``gateway.images``).

An image reaches an engine only as a ``data:`` URL of a PNG, JPEG, WebP or GIF that PIL
decodes within the limits: an OpenAI chat ``image_url`` content part, or an item of SGLang's
``image_data`` on ``/generate``. A local file (``file://`` URL or absolute path) is read here,
only under ``allowed_dirs``, and sent as data, so an engine never opens a path or fetches a URL
a client names. Remote URLs are refused. That is the gateway's ``ImagePolicy``, for external
callers. The controller's own images (the prompts', read before the job started,
``rl/inputs.py``) go as they are, so a job never fails mid-run on a limit its data passed: its
in-process client refuses only what no engine can take (``controller_images_problem``). Images
user code makes at run time (a rollout function's tool) are held to the policy by the agent
client before it sends them (``ImagePolicy.checked_user_images``, ``rl/agent_images.py``).
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import re
import stat
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

from PIL import Image

from relax_launch.inference.image_config import ImageLimits

FORMATS = {"PNG": "image/png", "JPEG": "image/jpeg", "WEBP": "image/webp", "GIF": "image/gif"}
CONTENT_PARTS = ("text", "image_url")
ALLOWED = "a data: URL (base64 PNG, JPEG, WebP or GIF)"


class ImageRefused(ValueError):
    """An image input the policy does not take: the request is answered 400 with the message."""

    status = 400


def image_parts(messages: object) -> list[dict[str, Any]]:
    """The content parts of ``messages`` that are not text (no checks)."""
    if not isinstance(messages, list):
        return []
    return [
        part
        for message in messages
        if isinstance(message, dict) and isinstance(message.get("content"), list)
        for part in message["content"]
        if not (isinstance(part, dict) and part.get("type") == "text")
    ]


def image_urls(messages: object) -> list[str]:
    """The URLs of the image parts of ``messages``, in the order a chat template shows them."""
    urls = []
    for part in image_parts(messages):
        image = part.get("image_url") if isinstance(part, dict) else None
        urls.append(image.get("url") if isinstance(image, dict) else image)
    return urls


UNSERVED = ("video_data", "audio_data", "input_embeds")  # SGLang would fetch or open these


def has_images(payload: dict[str, Any]) -> bool:
    """Whether ``payload`` carries anything for the image policy to check (an empty
    ``image_data`` is none; ``UNSERVED`` fields are refused by ``ImagePolicy.checked``)."""
    if any(payload.get(field) is not None for field in UNSERVED):
        return True
    images = payload.get("image_data")
    return bool(image_parts(payload.get("messages"))) or images not in (None, [])


def placeholders_problem(payload: dict[str, Any], image_token: int) -> None:
    """Refuse ``input_ids`` that do not show each of ``image_data`` by one placeholder token.
    SGLang decodes such ids to text and expands each placeholder itself; given a run already
    expanded, its Qwen-VL processor raises StopIteration in a future and the request never
    answers (SGLang 0.5.23), so it must not reach an engine."""
    ids, images = payload.get("input_ids"), payload["image_data"]
    if ids is None:
        return
    if not (isinstance(images, list) and all(isinstance(i, str) for i in images)) or (
        ids and isinstance(ids[0], list)
    ):
        raise ImageRefused("input_ids with image_data: one prompt per request, its images a list")
    shown = ids.count(image_token)
    adjacent = any(a == b == image_token for a, b in zip(ids, ids[1:], strict=False))
    if shown != len(images) or adjacent:
        raise ImageRefused(
            f"input_ids with image_data show each image by one placeholder token {image_token} "
            f"as the chat template renders it (found {shown} for {len(images)} images"
            f"{', some adjacent' if adjacent else ''}); the engine expands each to the "
            "image's patches itself"
        )


# What SGLang's Qwen-VL processor reads as media in a prompt's text: an image as the template
# shows it, its /generate form's sentinel (``qwen_vl.py``, ``image_token_regex``), and a bare
# image, video or audio placeholder
MEDIA_IN_TEXT = re.compile(
    r"<\|vision_start\|>(?:<\|image_pad\|>)+<\|vision_end\|>|<image>"
    r"|<\|image_pad\|>|<\|video_pad\|>|<\|audio_pad\|>"
)


def text_placeholders_problem(text: str, images: list[str]) -> None:
    """Refuse a rendered prompt that does not show each of ``images`` by one media placeholder
    (a message spelling one out): the engine would count one more image or a video, answering
    400 or never."""
    shown = len(MEDIA_IN_TEXT.findall(text))
    if shown != len(images):
        raise ImageRefused(
            f"the rendered prompt shows {shown} media placeholders for {len(images)} images: "
            "a message's text spells one out (<image>, <|image_pad|>, <|video_pad|>); break it "
            "(e.g. '< image>')"
        )


def not_vision_message(model: str) -> str:
    return (
        f"model {model!r} is not a vision-language model: it takes no images "
        "(image_url content parts, image_data); send text, or choose a VLM"
    )


def controller_images_problem(payload: dict[str, Any], model: str, image_token: int | None) -> None:
    """Refuse what no engine takes of the controller's ``payload``, whose images go as they are
    (its own were read before start, user code's checked by ``checked_user_images``): images for
    a model that takes none, ``input_ids`` not showing each image by one placeholder."""
    if not has_images(payload):
        return
    if image_token is None:
        raise ImageRefused(not_vision_message(model))
    if payload.get("image_data") is not None:
        placeholders_problem(payload, image_token)


class ImagePolicy:
    """``limits`` applied to one request's images; each method raises ``ImageRefused``."""

    def __init__(self, limits: ImageLimits | None = None) -> None:
        self.limits = limits or ImageLimits()
        self.dirs = [Path(d).resolve() for d in self.limits.allowed_dirs]

    def checked(
        self, payload: dict[str, Any], model: str, image_token: int | None
    ) -> dict[str, Any]:
        """``payload`` with every image as a checked data URL (a copy where one changed); the
        model it is routed to (``model``) must be a vision-language model (its placeholder
        token ``image_token``)."""
        if not has_images(payload):
            return payload
        unserved = [field for field in UNSERVED if payload.get(field) is not None]
        if unserved:
            raise ImageRefused(
                f"{', '.join(unserved)} not served: an engine would fetch or open what they "
                "name; images go as image_data or image_url content parts"
            )
        if image_token is None:
            raise ImageRefused(not_vision_message(model))
        counted = [0]
        payload = dict(payload)
        if payload.get("messages") is not None:
            payload["messages"] = [self._message(m, counted) for m in payload["messages"]]
        if payload.get("image_data") is not None:
            payload["image_data"] = self._image_data(payload["image_data"], counted)
            placeholders_problem(payload, image_token)
        return payload

    def checked_user_images(self, images: list[Any], made: dict[int, str]) -> list[Any]:
        """``images`` (one request's ``image_data``) with each one user code made (``made``:
        its index -> where it is) checked as ``checked`` checks an external caller's, the refusal
        naming where. ``max_images`` counts every image of the request, the controller's own
        too, so only user code's can take a request past it."""
        held = "images user code makes are held to gateway.images"
        if made and len(images) > self.limits.max_images:
            raise ImageRefused(
                f"a rollout function's conversation carries {len(images)} images, more than "
                f"{self.limits.max_images} (gateway.images.max_images): {len(made)} made by user "
                f"code ({'; '.join(made[k] for k in sorted(made))}); {held}"
            )
        images, counted = list(images), [len(images) - len(made)]
        for k, where in sorted(made.items()):
            try:
                images[k] = self.data_url(images[k], counted)
            except ImageRefused as exc:
                raise ImageRefused(
                    f"an image a rollout function's conversation carries ({where}) is refused: "
                    f"{exc}; {held}"
                ) from None
        return images

    def _message(self, message: Any, counted: list[int]) -> Any:
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            return message
        return {**message, "content": [self._part(p, counted) for p in content]}

    def _part(self, part: Any, counted: list[int]) -> Any:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in CONTENT_PARTS:
            raise ImageRefused(
                f"content part type {kind!r} is not served; parts are "
                f"{' or '.join(CONTENT_PARTS)} (images as {ALLOWED})"
            )
        if kind == "text":
            return part
        image = part.get("image_url")
        url = image.get("url") if isinstance(image, dict) else image
        data = self.data_url(url, counted)
        return {**part, "image_url": {**image, "url": data} if isinstance(image, dict) else data}

    def _image_data(self, items: Any, counted: list[int]) -> Any:
        if isinstance(items, list):
            return [self._image_data(item, counted) for item in items]
        return self.data_url(items, counted)

    def data_url(self, url: Any, counted: list[int]) -> str:
        """The image ``url`` names, as a data URL; ``counted`` counts the request's images."""
        counted[0] += 1
        if counted[0] > self.limits.max_images:
            raise ImageRefused(
                f"more than {self.limits.max_images} images in one request "
                "(gateway.images.max_images)"
            )
        if not isinstance(url, str) or not url:
            raise ImageRefused(f"an image must be {self._allowed()}, not {type(url).__name__}")
        try:
            scheme = urlparse(url).scheme.lower() if not url.startswith("/") else ""
        except ValueError:
            raise ImageRefused(f"the image URL is malformed: give {self._allowed()}") from None
        if scheme == "data":
            return self._decoded(self._data_bytes(url), payload=url)
        if scheme in ("", "file"):
            return self._decoded(self._file_bytes(url))
        raise ImageRefused(f"image URL scheme {scheme!r} is not fetched: give {self._allowed()}")

    def _allowed(self) -> str:
        if not self.dirs:
            return f"{ALLOWED}; local files are off (gateway.images.allowed_dirs is empty)"
        dirs = ", ".join(str(d) for d in self.dirs)
        return f"{ALLOWED} or a file:// URL or absolute path under {dirs}"

    def _data_bytes(self, url: str) -> bytes:
        header, comma, encoded = url.partition(",")
        if not comma or not header.endswith(";base64"):
            raise ImageRefused("a data: image URL must be base64 (data:image/png;base64,...)")
        if len(encoded) * 3 // 4 > self.limits.max_bytes + 2:
            raise ImageRefused(self._too_big(len(encoded) * 3 // 4))
        try:
            return base64.b64decode(encoded, validate=True)
        except (binascii.Error, ValueError):
            raise ImageRefused("the data: image URL is not valid base64") from None

    def _file_bytes(self, url: str) -> bytes:
        try:
            path = unquote(urlparse(url).path) if url.startswith("file:") else url
            if not os.path.isabs(path):
                raise ImageRefused(f"image path {url!r} is not absolute: give {self._allowed()}")
            resolved = Path(path).resolve()  # symlinks followed: where the bytes really are
        except ValueError as exc:  # a NUL byte, a malformed URL
            if isinstance(exc, ImageRefused):
                raise
            raise ImageRefused(f"image path {url!r} is malformed: {exc}") from None
        if not any(resolved.is_relative_to(d) for d in self.dirs):
            raise ImageRefused(f"image file {path!r} is not allowed: give {self._allowed()}")
        try:
            return self._read_regular(resolved)
        except OSError as exc:
            raise ImageRefused(f"image file {path!r} cannot be read: {exc.strerror}") from None

    def _read_regular(self, resolved: Path) -> bytes:
        """At most ``max_bytes`` + 1 of a regular file: never blocks on a FIFO or a device."""
        fd = os.open(resolved, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        with os.fdopen(fd, "rb") as file:
            info = os.fstat(file.fileno())
            if not stat.S_ISREG(info.st_mode):
                raise ImageRefused(f"image file {str(resolved)!r} is not a regular file")
            if info.st_size > self.limits.max_bytes:
                raise ImageRefused(self._too_big(info.st_size))
            return file.read(self.limits.max_bytes + 1)

    def _too_big(self, size: int) -> str:
        return (
            f"an image of {size} bytes exceeds {self.limits.max_bytes} bytes "
            "(gateway.images.max_bytes)"
        )

    def _decoded(self, raw: bytes, payload: str | None = None) -> str:
        """``raw`` as a data URL of its real type, once PIL has decoded it within the limits."""
        if len(raw) > self.limits.max_bytes:
            raise ImageRefused(self._too_big(len(raw)))
        try:
            # the header only: the size is read lazily, so a bomb is refused before decoding
            with Image.open(io.BytesIO(raw), formats=list(FORMATS)) as image:
                kind, (width, height) = image.format, image.size
                if width * height <= self.limits.max_pixels:
                    image.load()  # a truncated or corrupt file fails here
        except Exception:  # noqa: BLE001 - malformed files raise EOFError, struct.error, ...
            raise ImageRefused(
                f"the image is not a decodable PNG, JPEG, WebP or GIF ({len(raw)} bytes; "
                "other types are not served)"
            ) from None
        if width * height > self.limits.max_pixels:
            raise ImageRefused(
                f"a {width}x{height} image exceeds {self.limits.max_pixels} pixels "
                "(gateway.images.max_pixels)"
            )
        encoded = payload.partition(",")[2] if payload else base64.b64encode(raw).decode()
        return f"data:{FORMATS[kind]};base64,{encoded}"
