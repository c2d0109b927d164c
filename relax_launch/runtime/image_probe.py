"""The parity probe's image sequence, for a vision-language policy (``runtime/parity_probe.py``):
a fixed picture of coloured shapes, a question and an answer, which the trainer scores with
the image's patches and every synced engine with the image itself, so a vision tower that did
not reach the engine (or a tower sent in the wrong layout) moves the answer's logprobs.

Compared are the tokens after the first, image placeholders excepted (the engine reports an
image's placeholders by its pad value, not the placeholder id): every text token after the
image attends to its features.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from relax_launch.rl.prompt import Prompt
from relax_launch.rl.vision_prompts import VisionEncoder, png_url
from relax_launch.rl.visual_tasks import draw_shapes
from relax_launch.trainer.batch import RowImages
from relax_launch.weights.parity import EngineGap, largest_gap
from relax_launch.weights.update_session import WeightSyncError

SHAPES = {
    0: ("red", "circle"),
    2: ("blue", "square"),
    4: ("red", "circle"),
    7: ("green", "triangle"),
}
QUESTION = "How many red circles are in the image? Count them and answer."
ANSWER = "There are two red circles, one blue square and one green triangle."


@dataclass(frozen=True)
class ImageProbe:
    """The image sequence as the trainer scores it (``ids``, ``images``) and as the engines do
    (``engine_ids``: one placeholder per image, ``url``)."""

    ids: list[int]
    images: RowImages
    engine_ids: list[int]
    url: str
    image_token_id: int

    def request(self, extra: dict[str, Any]) -> dict[str, Any]:
        """One ``/generate`` body scoring the sequence, image included."""
        return {
            "input_ids": self.engine_ids,
            "image_data": [self.url],
            "return_logprob": True,
            "logprob_start_len": 0,
            "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
            **extra,
        }

    def gap(self, label: str, trainer_row: list[float], reply: Any) -> EngineGap:
        """The engine's largest gap over the text tokens of the sequence."""
        reply = reply[0] if isinstance(reply, list) else reply
        engine_row = [float(lp) for lp, *_ in reply["meta_info"]["input_token_logprobs"][1:]]
        if len(engine_row) != len(self.ids) - 1:
            raise WeightSyncError(
                f"the engine scored {len(engine_row)} of the image probe's {len(self.ids) - 1} "
                "tokens: its image processor expands the image otherwise than the trainer's"
            )
        text = [k for k, token in enumerate(self.ids[1:]) if token != self.image_token_id]
        gap = largest_gap(
            f"{label}, image probe",
            [[trainer_row[k] for k in text]],
            [[engine_row[k] for k in text]],
        )
        return (
            gap if gap.gap == 0.0 else EngineGap(gap.label, gap.gap, 0, text[gap.position - 1] + 1)
        )


def image_probe(model_dir: Path) -> ImageProbe:
    """The probe's image sequence for the vision-language model in ``model_dir``."""
    encoder = VisionEncoder(model_dir)
    image = draw_shapes(SHAPES)
    content = [
        {"type": "image_url", "image_url": {"url": png_url(image)}},
        {"type": "text", "text": QUESTION},
    ]
    prompt, ids = encoder.encode(Prompt(0, ({"role": "user", "content": content},)))
    answer = encoder.processor.tokenizer.encode(ANSWER, add_special_tokens=False)
    return ImageProbe(
        ids=ids + answer,
        images=prompt.images.rows,
        engine_ids=list(prompt.images.engine_ids) + answer,
        url=prompt.images.urls[0],
        image_token_id=encoder.processor.image_token_id,
    )
