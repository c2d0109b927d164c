"""An agentic conversation's images for the trainer of a vision-language policy.

The recorded trajectory (``rl/agent.py``, ``rl/agent_images.py``) holds the token ids the
engine saw, each image's placeholder run expanded by the engine, and the conversation's images
in the order their runs appear (``Trajectory.images``: what the last turn sent). The trainer
reads those ids as they are and gives its images' features to the placeholders: image k to the
k-th run of placeholders, as many tokens as its patches / merge² (``trainer/vlm_batches.py``,
``mrope_positions``). The sample carries the images' patches and grids (``RowImages``) from the
trainer's processor; where the engine's runs are not the trainer's expansion (another length, a
run the policy sampled, a placeholder before the images' runs) the trainer would not read the
sequence as the engine did, and the sample is rejected (``agent/rejected``) naming its prompt.
"""

from __future__ import annotations

import functools
from itertools import groupby
from typing import TYPE_CHECKING, Any

from relax_launch.console import operator_log
from relax_launch.rl.vision_prompts import image_bytes, open_image

if TYPE_CHECKING:  # torch and transformers: rank 0 of a vision-language job only
    from relax_launch.models.vlm_processor import VisionProcessor
    from relax_launch.rl.agent import Trajectory
    from relax_launch.rl.samples import Sample
    from relax_launch.trainer.batch import RowImages

VISION_START = "<|vision_start|>"  # what the Qwen2-VL family's template puts before an image


def placeholder_runs(ids: list[int], pad: int) -> list[tuple[int, int]]:
    """(start, length) of every run of placeholder tokens ``pad`` in ``ids``, in order."""
    runs, at = [], 0
    for token, run in groupby(ids):
        length = len(list(run))
        if token == pad:
            runs.append((at, length))
        at += length
    return runs


def image_runs_problem(
    ids: list[int], mask: list[float], counts: list[int], pad: int, start: int
) -> str | None:
    """Why the trainer would not read ``ids`` (``mask`` 1 where the engine sampled a token)
    with images of ``counts`` tokens as the engine did; None when each image's run is the next
    placeholder run, right after ``start`` (<|vision_start|>), in the context, as long as the
    trainer's processor expands the image (later placeholders are sampled text to both)."""
    runs = placeholder_runs(ids, pad)
    if len(runs) < len(counts):
        return f"{len(runs)} image placeholder runs for {len(counts)} images"
    for k, ((at, length), count) in enumerate(zip(runs, counts, strict=False)):
        if length != count:
            return f"image {k}: {length} placeholder tokens from the engine, {count} from ours"
        if at == 0 or ids[at - 1] != start:
            return f"image {k}: its placeholders do not follow {VISION_START} (sampled ones do)"
        if any(mask[at : at + length]):
            return f"image {k}: its placeholder tokens were sampled"
    return None


class AgentVision:
    """A trajectory's images as the trainer's processor makes them (the policy's
    ``VisionProcessor``), checked against the engine's ids."""

    def __init__(self, processor: VisionProcessor) -> None:
        self.processor = processor
        self.start = processor.tokenizer.convert_tokens_to_ids(VISION_START)
        # a prompt's n samples mostly show the same images: processed once, their rows shared
        self._rows = functools.lru_cache(maxsize=8)(self._processed)

    def rows(self, urls: list[str]) -> RowImages:
        """The patches and grids of the images at ``urls`` (the engine's ``image_data``)."""
        return self._rows(tuple(urls))

    def _processed(self, urls: tuple[str, ...]) -> RowImages:
        from relax_launch.trainer.batch import RowImages  # torch

        images = [
            open_image(image_bytes({"type": "image_url", "image_url": {"url": u}})) for u in urls
        ]
        patches = self.processor.images(images=images, return_tensors="pt")
        return RowImages(patches["pixel_values"].float(), patches["image_grid_thw"].long())

    def problem(self, trajectory: Trajectory, rows: RowImages) -> str | None:
        """Why ``trajectory``'s ids are not what the trainer reads with ``rows``, or None."""
        t = trajectory
        counts = [int(g.prod()) // self.processor.merge**2 for g in rows.grids]
        mask = [0.0] * len(t.prompt_ids) + list(t.mask)
        pad = self.processor.image_token_id
        return image_runs_problem(t.prompt_ids + t.ids, mask, counts, pad, self.start)

    def attach(self, sample: Sample, trajectory: Trajectory, prompt: int) -> None:
        """Give ``sample`` (trained from ``trajectory``) its images, or reject it naming
        ``prompt`` (its index) when the trainer would read its ids otherwise."""
        if not trajectory.images or not sample.valid:
            return
        rows = self.rows(trajectory.images)
        why = self.problem(trajectory, rows)
        if why is None:
            sample.images = rows
            return
        operator_log().warning(
            f"relax-launch: an agentic sample of prompt {prompt} is rejected (agent/rejected): "
            f"the engine's image tokens are not the trainer's ({why})"
        )
        sample.outcome, sample.valid = "rejected", False


def attach_images(
    vision: AgentVision | None,
    samples: list[Sample],
    clients: list[Any],
    prompts: list[Any],
    n: int,
) -> None:
    """Each sample's images (``AgentVision.attach``); nothing for a text policy."""
    if vision is None:
        return
    for i, (sample, client) in enumerate(zip(samples, clients, strict=True)):
        vision.attach(sample, client.trajectory, prompts[i // n][0].index)
