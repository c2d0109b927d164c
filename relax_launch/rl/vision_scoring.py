"""The teacher's and the judge's requests for samples whose prompt has images (a
vision-language policy, docs/vlm.md "Teacher and judge").

**Teacher.** The teacher engine gets the prompt as the rollout engine got it: the chat
template's ids with one placeholder per image (``PromptImages.engine_ids``; SGLang's Qwen-VL
processor expands each to the image's patch count itself) and the images as data URLs, then the
sampled response. It is asked for the ids it scored (``return_prompt_token_ids``), which must be
the trainer's (the prompt with each image expanded, then the response): its logprobs are then of
the sampled tokens, read with the images. A response showing a media placeholder itself (the
tiny random policy samples ``<|image_pad|>`` and ``<|video_pad|>``) cannot be sent so: the
engine would read it as one more image or a video (an image placeholder: the in-process client
refuses the count, 400, and SGLang's processor would never answer; a video one: "No data
iterator found", 400), so such a sample is not scored (no distillation term), as an empty
response is not.

**Judge.** The judge's user message shows the prompt's images (``image_url`` parts, the data
URLs the rollout sent: read before the job started, so not held to ``gateway.images``) before
the grading text when the judge model of the reward source takes images (``vision_judges``),
each media placeholder the text spells out broken; a text judge gets the text, told how many
images it was not shown.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from relax_launch.rl.samples import Sample
from relax_launch.rl.vision_prompts import MEDIA_PLACEHOLDERS, shows_media

if TYPE_CHECKING:
    from relax_launch.inference.manager import InferenceManager
    from relax_launch.rl.config import RewardConfig


def teacher_inputs(sample: Sample) -> dict[str, Any]:
    """The token part of the teacher's ``/generate`` body scoring ``sample``: its ids, or with
    images the template's ids, the response, the images and the ask for the ids scored."""
    images = sample.prompt_images
    agentic = sample.response_mask is not None  # its prompt_images: for a judge only
    if (sample.images is not None and images is None) or (agentic and images is not None):
        raise RuntimeError(
            "the teacher scores a sample's prompt images only; this sample's images came "
            "from its conversation (rollout.function), which a teacher cannot score yet"
        )
    if images is None:
        return {"input_ids": sample.prompt_ids + sample.response_ids}
    return {
        "input_ids": list(images.engine_ids) + sample.response_ids,
        "image_data": list(images.urls),
        "return_prompt_token_ids": True,  # checked against the trainer's (``check_teacher_ids``)
    }


def teachable(sample: Sample, tokenizer: Any) -> bool:
    """Whether the teacher can score ``sample``: it has a response, and with images the
    response shows no media placeholder where the teacher engine looks for one (it decodes the
    ids, special tokens kept, and reads each placeholder as one more image, video or audio)."""
    if not sample.response_ids:
        return False
    if sample.prompt_images is None:
        return True
    return not shows_media(sample.response_ids, tokenizer)


def check_teacher_ids(sample: Sample, reply: dict[str, Any]) -> None:
    """Raise when the teacher engine scored a sample with images on other ids than the
    trainer's (its processor expanded an image otherwise, or it re-tokenised the response)."""
    if sample.prompt_images is None:
        return
    seen = reply.get("prompt_token_ids")
    ids = sample.prompt_ids + sample.response_ids
    if seen != ids:
        got = "none returned" if seen is None else f"{len(seen)} tokens"
        raise RuntimeError(
            f"the teacher engine's token ids of a sample of prompt group {sample.group} ({got}) "
            f"are not the trainer's ({len(ids)} tokens, images expanded): the teacher must be a "
            "vision-language model with the policy's processor and tokenizer"
        )


def judge_message(sample: Sample, text: str, with_images: bool) -> dict[str, Any]:
    """The judge's user message: ``text``, after the prompt's images when ``with_images`` (each
    media placeholder the text spells out broken, ``shown_as_text``); a text judge of a prompt
    with images is told they were there."""
    images = sample.prompt_images
    if images is None:
        return {"role": "user", "content": text}
    if not with_images:
        count = len(images.urls)
        unseen = (
            f"(The question showed {count} image{'s' if count != 1 else ''}, not shown to "
            "you: grade against the reference answer.)\n\n"
        )
        return {"role": "user", "content": unseen + text}
    parts = [{"type": "image_url", "image_url": {"url": url}} for url in images.urls]
    return {"role": "user", "content": [*parts, {"type": "text", "text": shown_as_text(text)}]}


def shown_as_text(text: str) -> str:
    """``text`` with each media placeholder broken (``< |image_pad|>``): beside images, the
    engine's processor would read one in a question or a response as one more image or a
    video (400, or no answer)."""
    for placeholder in MEDIA_PLACEHOLDERS:
        text = text.replace(placeholder, "< " + placeholder[1:])
    return text


def image_parts_sent(prompts: list[list[dict[str, Any]]]) -> int:
    """The image parts of a judge's conversations (``judge_message``'s)."""
    return sum(
        1
        for conversation in prompts
        for message in conversation
        if isinstance(message["content"], list)
        for part in message["content"]
        if part.get("type") == "image_url"
    )


def vision_judges(genrm: InferenceManager | None, reward: RewardConfig) -> frozenset[str]:
    """The genrm reward sources whose judge model takes images (shown them), as the gateway
    decides: the model ``rollout.judge`` routes the source to (the one whose route_keys name
    it, else the role's default) has an image placeholder token (its config's
    ``image_token_id``)."""
    if genrm is None:
        return frozenset()
    routing = genrm.routing

    def takes_images(source: str) -> bool:
        model = routing.route_key_map.get(source, routing.default_model)
        return model is not None and genrm.image_token_of(model) is not None

    return frozenset(s.name for s in reward.sources if s.genrm and takes_images(s.name))
