"""What an engine computed from its old weights and keeps past a weight update, dropped by the
receiver (``receiver.py``) after every update (SGLang's own update routes flush the KV cache
only)."""

from __future__ import annotations

from collections.abc import Iterable


def touches_vision(names: Iterable[str]) -> bool:
    """Whether an update's weight ``names`` include the vision tower's (Qwen2.5-VL's
    ``visual.``, ``model.visual.``): a text model's, or a policy trained with
    ``trainer.freeze_vision``, never do."""
    return any(f".{name}".find(".visual.") >= 0 for name in names)


def forget_image_features(names: Iterable[str]) -> None:
    """Drop SGLang's cache of image features when the update's weight ``names`` change the
    vision tower: it keeps each image's vision-tower output by the image's hash
    (``mm_schedule.embedding_cache``) and no update route clears it, so after new weights an
    image seen before would get the old tower's features (measured: the parity probe's image
    off by 0.06 nats after one step of the tiny Qwen2.5-VL)."""
    if not touches_vision(names):
        return  # a text model's update, or a frozen tower: nothing imported, nothing cleared
    from sglang.srt.managers import mm_schedule  # the engine's process: SGLang is loaded there

    if mm_schedule.embedding_cache is not None:
        mm_schedule.embedding_cache.clear()
