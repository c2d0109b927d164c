"""The CPU harness runs the real SGLang engine: its output matches HF transformers, and the real
SmolLM2 model answers a factual question through it."""

from __future__ import annotations

import httpx
import pytest
import torch

pytestmark = pytest.mark.e2e

PROMPTS = ["What is 12 plus 7?", "The capital of France is"]


def post(url: str, body: dict, timeout_s: float) -> dict:
    reply = httpx.post(url, json=body, timeout=timeout_s)
    reply.raise_for_status()
    return reply.json()


def test_tiny_llama_greedy_matches_hf_transformers(tiny_server, tiny_model):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    hf = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    for prompt in PROMPTS:
        ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            expected = hf.generate(
                torch.tensor([ids]),
                max_new_tokens=12,
                do_sample=False,
                min_new_tokens=12,
                pad_token_id=tokenizer.pad_token_id,
            )[0, len(ids) :].tolist()
        reply = post(
            tiny_server.url + "/generate",
            {
                "input_ids": ids,
                "sampling_params": {
                    "max_new_tokens": 12,
                    "min_new_tokens": 12,
                    "temperature": 0,
                },
                "return_logprob": True,
            },
            timeout_s=60,
        )
        assert reply["output_ids"] == expected, prompt
        assert len(reply["meta_info"]["output_token_logprobs"]) == 12


def test_smollm2_answers_capital_of_france(smollm2_server):
    reply = post(
        smollm2_server.url + "/v1/chat/completions",
        {
            "model": "default",
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 24,
            "temperature": 0,
        },
        timeout_s=120,
    )
    answer = reply["choices"][0]["message"]["content"]
    assert "Paris" in answer, answer
