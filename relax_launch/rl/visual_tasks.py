"""A visual task generated on the spot: count coloured shapes drawn with PIL.

Each prompt is one user message with an image part (a PNG as a ``data:`` URL, the OpenAI chat
form) and a question: "How many red circles are in the image?"; its label is the count, so
``builtin:exact_numeric`` checks a reply. Images are 84 x 84 pixels: a 3 x 3 grid of 28-pixel
cells, each empty or holding one shape of a pure colour (so ``count_shapes`` reads the answer
back from the pixels), small enough for the tiny Qwen2.5-VL (36 patches, 9 tokens).

``data.dataset: builtin:shape_counting`` (for a vision-language policy, docs/vlm.md).
"""

from __future__ import annotations

import base64
import io
import random
from typing import Any

from relax_launch.rl.prompt import Prompt

COLOURS = {"red": (255, 0, 0), "green": (0, 160, 0), "blue": (0, 0, 255), "yellow": (255, 200, 0)}
KINDS = ("circle", "square", "triangle")
CELL, GRID, MARGIN = 28, 3, 5
SIZE = CELL * GRID


def draw_shapes(shapes: dict[int, tuple[str, str]]) -> Any:
    """An image with shape ``shapes[cell] = (colour, kind)`` in each listed cell (0-8, row by
    row) on white."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (SIZE, SIZE), "white")
    draw = ImageDraw.Draw(image)
    for cell, (colour, kind) in shapes.items():
        x, y = (cell % GRID) * CELL + MARGIN, (cell // GRID) * CELL + MARGIN
        box = (x, y, x + CELL - 2 * MARGIN, y + CELL - 2 * MARGIN)
        fill = COLOURS[colour]
        if kind == "circle":
            draw.ellipse(box, fill=fill)
        elif kind == "square":
            draw.rectangle(box, fill=fill)
        else:
            draw.polygon(
                [(box[0], box[3]), (box[2], box[3]), ((box[0] + box[2]) // 2, box[1])], fill
            )
    return image


def read_shapes(image: Any) -> dict[int, tuple[str, str]]:
    """The (colour, kind) of the shape in each occupied cell of ``image``, read from its pixels:
    the colour of the cell's non-white pixels, the kind from how much of the shape's box they
    fill (a square all of it, a circle about pi / 4, a triangle about half)."""
    pixels, box = image.load(), (CELL - 2 * MARGIN + 1) ** 2
    found = {}
    for cell in range(GRID * GRID):
        x0, y0 = (cell % GRID) * CELL, (cell // GRID) * CELL
        for colour, rgb in COLOURS.items():
            filled = sum(
                pixels[x0 + dx, y0 + dy] == rgb for dx in range(CELL) for dy in range(CELL)
            )
            if filled:
                share = filled / box
                found[cell] = (
                    colour,
                    "square" if share > 0.9 else "circle" if share > 0.65 else "triangle",
                )
    return found


def count_shapes(image: Any, colour: str, kind: str) -> int:
    """How many ``colour`` ``kind`` shapes ``image`` shows (``read_shapes``)."""
    return sum(shape == (colour, kind) for shape in read_shapes(image).values())


def data_url(image: Any) -> str:
    """``image`` as a PNG ``data:`` URL."""
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def shape_counting(count: int, seed: int) -> list[Prompt]:
    """``count`` prompts asking for the number of shapes of one colour and kind."""
    rng = random.Random(seed)
    prompts = []
    for i in range(count):
        colour, kind = rng.choice(sorted(COLOURS)), rng.choice(KINDS)
        cells = rng.sample(range(GRID * GRID), rng.randint(1, 6))
        asked = rng.randint(0, len(cells))
        shapes = {cell: (colour, kind) for cell in cells[:asked]}
        for cell in cells[asked:]:  # distractors: another colour or another kind
            other = (rng.choice([c for c in COLOURS if c != colour]), rng.choice(KINDS))
            shapes[cell] = other if rng.random() < 0.5 else (colour, _other_kind(kind, rng))
        question = f"How many {colour} {kind}s are in the image? Reply with just the number."
        content = [
            {"type": "image_url", "image_url": {"url": data_url(draw_shapes(shapes))}},
            {"type": "text", "text": question},
        ]
        message = {"role": "user", "content": content}
        prompts.append(Prompt(i, (message,), str(asked), "shape_counting"))
    return prompts


def _other_kind(kind: str, rng: random.Random) -> str:
    return rng.choice([k for k in KINDS if k != kind])
