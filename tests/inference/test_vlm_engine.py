"""SGLang's CPU engine serves the tiny Qwen2.5-VL, started as the project starts engines: an
image chat through its OpenAI route, and a prompt with an image whose token ids are the ones
the trainer builds (image placeholders included) and whose prompt logprobs are transformers'
(fp32)."""

from __future__ import annotations

from pathlib import Path

import pytest
import requests
import torch

from relax_launch.inference.server import SGLangServer
from relax_launch.models.build import ensure_model
from relax_launch.models.vlm_processor import VisionProcessor
from relax_launch.rl.visual_tasks import data_url, draw_shapes

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
TOLERANCE = 1e-4


def transformers_logprobs(model_dir, prompt) -> torch.Tensor:
    from transformers import Qwen2_5_VLForConditionalGeneration

    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32)
    ids = torch.tensor([prompt.ids])
    with torch.no_grad():
        logits = model.eval()(
            input_ids=ids,
            pixel_values=prompt.pixel_values,
            image_grid_thw=prompt.image_grid_thw,
            mm_token_type_ids=(ids == model.config.image_token_id).int(),
        ).logits[0, :-1]
    return logits.log_softmax(-1).gather(-1, ids[0, 1:, None])[:, 0]


def tiny_vlm_server(model: Path, log_path: Path) -> SGLangServer:
    """The tiny Qwen2.5-VL on SGLang's CPU engine: fp32, seeded, the PIL image processor (the
    trainer's)."""
    return SGLangServer(
        model_path=model,
        device="cpu",
        log_path=log_path,
        engine={
            "max_total_tokens": 2048,
            "dtype": "float32",
            "random_seed": 0,
            "image_processor_backend": "pil",
        },
    )


def test_the_cpu_engine_serves_qwen2_5_vl_with_the_trainers_tokens(tmp_path):
    model = ensure_model("builtin:tiny-qwen2.5-vl")
    image = draw_shapes({0: ("red", "circle"), 4: ("blue", "square"), 8: ("red", "circle")})
    image = image.resize((84, 56))  # a grid of 4 x 6 patches: height and width positions differ
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": data_url(image)}},
                {"type": "text", "text": "How many red circles?"},
            ],
        }
    ]
    processor = VisionProcessor(model)
    prompt = processor.encode_chat(messages, [image])
    text = processor.tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    server = tiny_vlm_server(model, tmp_path / "engine.log")
    server.start(timeout_s=300)
    try:
        chat = requests.post(
            server.url + "/v1/chat/completions",
            json={"model": "m", "messages": messages, "max_tokens": 4, "temperature": 0},
            timeout=120,
        )
        body = {
            "text": text,
            "image_data": [data_url(image)],
            "sampling_params": {"max_new_tokens": 1, "temperature": 0},
            "return_logprob": True,
            "logprob_start_len": 0,
        }
        scored = requests.post(server.url + "/generate", json=body, timeout=120)
    finally:
        server.stop()
    assert chat.status_code == 200, chat.text
    assert chat.json()["usage"]["prompt_tokens"] == len(prompt.ids)
    assert scored.status_code == 200, scored.text
    entries = scored.json()["meta_info"]["input_token_logprobs"]
    engine_ids = [token for _, token, _ in entries]
    # SGLang reports an image's placeholders by the value it pads them with (for its prefix
    # cache); every other token id is the trainer's, and the placeholders are where ours are
    image = [token == processor.image_token_id for token in prompt.ids]
    print(f"engine ids {engine_ids}\ntrainer ids {prompt.ids}")
    assert len(engine_ids) == len(prompt.ids)
    assert [e for e, i in zip(engine_ids, image, strict=True) if not i] == [
        t for t, i in zip(prompt.ids, image, strict=True) if not i
    ]
    assert len({e for e, i in zip(engine_ids, image, strict=True) if i}) == 1
    assert all(engine_ids[k] != processor.image_token_id for k in range(len(image)) if image[k])
    text = torch.tensor([not i for i in image[1:]])  # logprobs of text tokens
    engine = torch.tensor([logprob for logprob, _, _ in entries[1:]])[text]
    difference = float((engine - transformers_logprobs(model, prompt)[text]).abs().max())
    print(f"engine vs transformers logprobs of {int(text.sum())} text tokens: {difference:.2e}")
    assert difference <= TOLERANCE
