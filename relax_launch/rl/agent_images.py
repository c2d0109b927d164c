"""Images in agentic conversations (a user turn or a tool result with an ``image_url`` part), token
in and token out as for text.

SGLang takes a prompt's images beside its token ids (``image_data``); its multimodal processor
decodes the ids to text to find each image's placeholder run, then keeps the ids sent, each
image's placeholder expanded to its patch count (``SGLANG_MM_AVOID_RETOKENIZE``, on by default
in SGLang 0.5.23, ``BaseMultimodalProcessor.process_and_combine_mm_data``); only where that
fails does it fall back, with a warning, to the decoded text tokenised again. So a turn with
images is sent with one placeholder per image (what the chat template renders; earlier turns'
runs collapsed again) and asks for the prompt's ids as the engine saw them
(``return_prompt_token_ids``). Those replace the recorded context, each placeholder run
stretched to the engine's length, provided they are the ids sent in every other place; if the
fallback's re-tokenisation changed any other token (an earlier reply it would split otherwise)
the conversation cannot be trained exactly and is rejected, as a conversation that does not
extend its last turn is. Because the processor reads the decoded text, a media placeholder the
policy sampled in an earlier reply would count as one more image or a video (refused, 400): the
client rejects such a conversation before sending the turn (``AgentClient._sampled_media``).

The prompt's own images go as they are (the engines' PNG ``data:`` URLs, read before the job
started: ``rl/vision_prompts.py``). Every other image of the conversation is user code's (a
tool's result): held to ``gateway.images`` and sent as the engines' PNG of its RGB pixels, the
pixels the trainer reads (``ConversationImages``); a refusal is raised in the rollout function,
this sample's failure, not the step's.
"""

from __future__ import annotations

import asyncio
import base64
from dataclasses import dataclass, field
from itertools import groupby
from typing import Any

from relax_launch.inference.images import ImagePolicy, image_urls
from relax_launch.models.registry import IMAGE_PAD
from relax_launch.rl.vision_prompts import engine_url, opened


def placeholder(tokenizer: Any) -> int:
    """The id of the image placeholder token of ``tokenizer``'s model."""
    return tokenizer.convert_tokens_to_ids(IMAGE_PAD)


def image_request(context: list[int], images: list[Any], tokenizer: Any) -> dict:
    """The fields a /generate body adds for the conversation's ``images`` (none: {})."""
    if not images:
        return {}
    return {
        "input_ids": collapsed(context, placeholder(tokenizer)),
        "image_data": images,
        "return_prompt_token_ids": True,
    }


@dataclass(frozen=True)
class ConversationImages:
    """A conversation's images as its turns send them: the prompt's ``own`` as they are, the
    others (user code's) checked by ``policy`` (``gateway.images``) and made the engines' PNG."""

    own: frozenset[str] = frozenset()
    policy: ImagePolicy = field(default_factory=ImagePolicy)
    # user code's image URL -> what was sent: each turn sends every image so far, made once
    done: dict[str, str] = field(default_factory=dict)

    def made(self, conversation: list[dict[str, Any]]) -> dict[int, str]:
        """Index in ``image_urls(conversation)`` -> where, of each image user code put there:
        the message, its role and, for a tool's result, the tool."""
        located = []
        for m, message in enumerate(conversation):
            tool = message.get("name") or message.get("tool_call_id")
            role = f"{message.get('role')} {tool!r}" if tool else message.get("role")
            located += [(url, f"messages[{m}], {role}") for url in image_urls([message])]
        return {
            k: where
            for k, (url, where) in enumerate(located)
            if not (isinstance(url, str) and url in self.own)
        }

    @classmethod
    def of(cls, prompt: Any, policy: ImagePolicy | None = None) -> ConversationImages:
        """``prompt``'s own images, the rest held to ``policy`` (None: gateway.images' defaults)."""
        own = frozenset(prompt.images.urls if prompt.images is not None else ())
        return cls(own, policy or ImagePolicy())

    async def sent(self, conversation: list[dict[str, Any]]) -> list[Any]:
        """``conversation``'s images as the engines are sent them: each user code put there
        checked (``ImagePolicy.checked_user_images``: ``ImageRefused`` naming where) and as
        ``engine_url`` makes it (off the event loop: PIL decodes)."""
        images, made = image_urls(conversation), self.made(conversation)
        return await asyncio.to_thread(self._sent, images, made) if made else images

    def _done(self, url: Any) -> bool:
        return isinstance(url, str) and url in self.done

    def _sent(self, images: list[Any], made: dict[int, str]) -> list[Any]:
        over = len(images) > self.policy.limits.max_images  # refused whatever was sent before
        fresh = {k: w for k, w in made.items() if over or not self._done(images[k])}
        checked = self.policy.checked_user_images(images, fresh)
        for k in made:
            if k in fresh:
                data = base64.b64decode(checked[k].partition(",")[2])
                self.done[images[k]] = engine_url(checked[k], opened(data))
            checked[k] = self.done[images[k]]
        return checked


def collapsed(ids: list[int], pad: int) -> list[int]:
    """``ids`` with each run of placeholders ``pad`` as one placeholder."""
    out: list[int] = []
    for token, run in groupby(ids):
        out += [token] if token == pad else list(run)
    return out


def sources(sent: list[int], seen: list[int], pad: int) -> list[int] | None:
    """For each token the engine saw (``seen``), the index of the token sent it stands for
    (a placeholder run maps onto the run sent); None when the two differ elsewhere."""
    if collapsed(sent, pad) != collapsed(seen, pad):
        return None
    runs_sent = [(t, len(list(r))) for t, r in groupby(sent)]
    runs_seen = [(t, len(list(r))) for t, r in groupby(seen)]
    if len(runs_sent) != len(runs_seen):
        return None
    index, start = [], 0
    for (token, length), (_, seen_length) in zip(runs_sent, runs_seen, strict=True):
        if token != pad and length != seen_length:
            return None
        index += [start + min(k, length - 1) for k in range(seen_length)]
        start += length
    return index


def as_the_engine_saw(trajectory: Any, seen: list[int], tokenizer: Any) -> str | None:
    """Take the engine's prompt ids ``seen`` as ``trajectory``'s context (its ``prompt_ids``
    and ``ids`` with their masks, logprobs and versions: placeholder tokens are context, mask
    0); why not, when the engine tokenised the conversation otherwise."""
    t = trajectory
    sent = t.prompt_ids + t.ids
    index = sources(sent, seen, placeholder(tokenizer))
    if index is None:
        return "the engine tokenised the conversation with its images otherwise"
    split = next((j for j, i in enumerate(index) if i >= len(t.prompt_ids)), len(index))
    first, tail = len(t.prompt_ids), index[split:]  # where ids began in what was sent
    t.prompt_ids, t.ids = list(seen[:split]), list(seen[split:])
    t.mask = [t.mask[i - first] for i in tail]
    t.logprobs = [t.logprobs[i - first] for i in tail]
    # versions cover the tokens before this turn's new context (_record adds the rest)
    t.token_versions = [
        t.token_versions[i - first] for i in tail if i - first < len(t.token_versions)
    ]
    return None
