"""Model families through the trainer: Llama (plain and with llama3 or linear RoPE scaling),
Qwen2 (q/k/v biases, tied embeddings) and Qwen3 (q/k norms, head_dim != hidden / heads) convert
to Megatron-core and give the Hugging Face model's own logprobs (fp32, CPU)."""

from __future__ import annotations

from pathlib import Path

import pytest
from torchrun_worker import run_worker

from relax_launch.models.build import build_tiny_llama, ensure_model

pytestmark = pytest.mark.e2e
WORKER = Path(__file__).with_name("hf_parity_worker.py")
TOLERANCE = 1e-4
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,  # below the tiny model's 1024 positions
    "rope_theta": 10000.0,
}


def test_trainer_logprobs_equal_the_hf_models_for_every_family(venv_env, tmp_path):
    models = {name: ensure_model(f"builtin:{name}") for name in ("tiny-qwen2", "tiny-qwen3")}
    models["tiny-llama"] = ensure_model("builtin:tiny-llama")
    for name, rope in (("llama3-rope", LLAMA3_ROPE), ("linear-rope", {"rope_type": "linear"})):
        models[name] = tmp_path / name
        models[name].mkdir()
        rope = {"factor": 4.0, "rope_theta": 10000.0, **rope}
        build_tiny_llama(models[name], rope_parameters=rope)
    (report,) = run_worker(WORKER, 1, list(models.values()), venv_env)
    for name, path in models.items():
        print(f"{name}: trainer vs transformers logprobs differ by at most {report[str(path)]:.2e}")
        assert report[str(path)] <= TOLERANCE, name
