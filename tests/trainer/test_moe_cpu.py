"""Mixture-of-experts models through the trainer: Qwen3-MoE (normalised top-k) and Qwen2-MoE
(a gated shared expert) convert to Megatron-core and give the Hugging Face model's own
logprobs (fp32, CPU) with one rank, with experts split over two ranks (EP=2) and with the
experts' weights split over tensor parallelism (TP=2); a model whose experts were swapped
does not."""

from __future__ import annotations

import itertools
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file
from torchrun_worker import run_worker

from relax_launch.models.build import ensure_model

pytestmark = pytest.mark.e2e
WORKER = Path(__file__).with_name("moe_parity_worker.py")
TOLERANCE = 1e-4


def swapped_experts(model: Path, out: Path) -> Path:
    """``model`` with experts 0 and 1 of its MoE layer 1 exchanged (the router unchanged): what
    a conversion mapping one expert's weights to another would compute."""
    shutil.copytree(model, out)
    weights = load_file(str(out / "model.safetensors"))
    for part in ("gate_proj", "up_proj", "down_proj"):
        a, b = (f"model.layers.1.mlp.experts.{e}.{part}.weight" for e in (0, 1))
        weights[a], weights[b] = weights[b], weights[a]
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def test_moe_logprobs_equal_the_hf_models_and_replay_dispatches_the_given_experts(venv_env):
    models = [ensure_model(f"builtin:{n}") for n in ("tiny-qwen3-moe", "tiny-qwen2-moe")]
    reports = run_worker(WORKER, 2, ["1x1,2x1,1x2", *models], venv_env)
    for report in reports:  # one per rank
        for (tp, ep), model in itertools.product(((1, 1), (2, 1), (1, 2)), models):
            gap = report[f"{tp}x{ep} {model}"]
            print(f"{model.name} tp={tp} ep={ep}: differ by at most {gap:.2e}")
            assert gap <= TOLERANCE, (model.name, tp, ep)
        # Random experts replayed (EP=2): the trainer's router would mostly have chosen others,
        # yet every trained token went to the replayed experts, and the logprobs followed.
        replay = report["replay"]
        print(f"replaying random experts: {replay}")
        assert replay["moe/dispatch_mismatch"] == 0.0
        assert replay["moe/routing_mismatch"] > 0.5
        assert replay["logprobs_moved"] > 100 * TOLERANCE


def test_an_expert_mapped_to_another_would_fail_the_parity(tmp_path):
    """The parity above is sensitive to which expert holds which weights: exchanging two
    experts' weights moves the logprobs far beyond its tolerance."""
    from hf_parity_worker import transformers_logprobs

    model = ensure_model("builtin:tiny-qwen3-moe")
    swapped = swapped_experts(model, tmp_path / "swapped")
    original, mutant = transformers_logprobs(str(model)), transformers_logprobs(str(swapped))
    gap = max(
        abs(a - b)
        for row, other in zip(original, mutant, strict=True)
        for a, b in zip(row, other, strict=True)
    )
    print(f"experts 0 and 1 of layer 1 exchanged: logprobs move by up to {gap:.2e}")
    assert gap > 100 * TOLERANCE
