"""The CPU harness runs the real SGLang engine: its output matches HF transformers, and the real
SmolLM2 model answers a factual question through it."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.e2e

PROMPTS = ["What is 12 plus 7?", "The capital of France is"]


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
        reply = tiny_server.post(
            "/generate",
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
    reply = smollm2_server.post(
        "/v1/chat/completions",
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
