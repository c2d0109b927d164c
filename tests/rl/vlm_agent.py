"""A rollout function for the vision-language agentic tests: the policy answers the prompt (an
image and a question), then a tool "zooms in" and returns an image drawn with PIL (another size
than the prompt's, so the two images' token counts differ), and the policy answers again."""

from __future__ import annotations

import base64
import io

from PIL import Image, ImageDraw

ZOOM = (56, 84)  # width, height: 2 x 3 merged patches of the tiny model (6 image tokens)


def zoomed(size: tuple[int, int] = ZOOM) -> str:
    """The tool's image: a red circle on white, as a PNG ``data:`` URL."""
    image = Image.new("RGB", size, "white")
    ImageDraw.Draw(image).ellipse((8, 8, size[0] - 8, size[1] - 8), fill="red")
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


async def zoom_tool(prompt, client):
    messages = list(prompt.messages)
    first = await client.chat.completions.create(messages=messages, max_tokens=4)
    messages.append(first.choices[0].message.model_dump(exclude_none=True))
    shown = [
        {"type": "text", "text": "zoomed in:"},
        {"type": "image_url", "image_url": {"url": zoomed()}},
    ]
    messages.append({"role": "tool", "content": shown, "tool_call_id": "call_0"})
    second = await client.chat.completions.create(messages=messages, max_tokens=4)
    return [*messages, second.choices[0].message.model_dump(exclude_none=True)]
