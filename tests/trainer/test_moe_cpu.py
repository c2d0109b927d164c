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


LAYOUTS = ((1, 1, 1), (2, 1, 1), (1, 1, 2), (1, 2, 1))  # tp x ep x pp on two ranks


def test_moe_logprobs_and_gradients_match_in_every_layout_and_replay_dispatches(venv_env):
    """Each layout gives the HF model's logprobs and the same gradient norm for the same
    batch: TP (experts split by rows and columns, sequence parallelism), PP (a stage's routers),
    EP (tokens exchanged all-to-all). The gradient catches what logprobs cannot, e.g. expert
    gradients counted once per TP rank."""
    models = [ensure_model(f"builtin:{n}") for n in ("tiny-qwen3-moe", "tiny-qwen2-moe")]
    layouts = ",".join("x".join(map(str, layout)) for layout in LAYOUTS)
    reports = run_worker(WORKER, 2, [layouts, *models], venv_env)
    for model in models:
        norms = {}
        for report, layout in itertools.product(reports, LAYOUTS):
            case = report[f"{'x'.join(map(str, layout))} {model}"]
            norms.setdefault(layout, set()).add(round(case["grad_norm"], 5))
            if "gap" in case:
                print(f"{model.name} tp x ep x pp = {layout}: differ by at most {case['gap']:.2e}")
                assert case["gap"] <= TOLERANCE, (model.name, layout)
        print(f"{model.name} grad norms by layout: {norms}")
        reference = norms[(1, 1, 1)]
        assert all(n == reference for n in norms.values()), norms
    for report in reports:  # Random experts replayed (EP=2): every trained token went to the
        replay = report["replay"]  # replayed experts, and the logprobs followed them.
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
