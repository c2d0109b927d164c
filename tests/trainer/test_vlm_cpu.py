"""The trainer's Qwen2.5-VL (Megatron-core language model with multimodal RoPE, transformers'
vision tower) against transformers' model on image+text and text-only sequences (fp32, CPU), on
one rank and over two tensor-parallel ranks; its vision tower's gradients; and its weights
gathered back bit-exact."""

from __future__ import annotations

from pathlib import Path

import pytest
from torchrun_worker import run_worker

from relax_launch.models.build import ensure_model

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
WORKER = Path(__file__).with_name("vlm_parity_worker.py")
TOLERANCE = 1e-5


@pytest.mark.parametrize("tp_size", [1, 2])
def test_trainer_vlm_logprobs_equal_transformers_and_its_weights_round_trip(venv_env, tp_size):
    model = ensure_model("builtin:tiny-qwen2.5-vl")
    (report,) = run_worker(WORKER, tp_size, [model], venv_env)
    print(f"TP {tp_size}: {report}")
    assert report["image_tokens"] == 18 and report["tokens"] > 100
    assert report["logprob_diff"] <= TOLERANCE
    assert report["round_trip_mismatches"] == 0 and report["tensors"] == 56
    # the tower's gradients: transformers' own, and the same on every TP rank (so data
    # parallelism alone reduces them)
    assert report["vision_grad_diff"] <= TOLERANCE
    assert report["vision_grad_tp_spread"] == 0.0


TRAINER_WORKER = Path(__file__).with_name("vlm_trainer_worker.py")


@pytest.mark.parametrize(("tp_size", "freeze_vision"), [(1, False), (2, True)])
def test_the_trainer_steps_a_vlm_policy_on_a_batch_with_images(venv_env, tp_size, freeze_vision):
    """The RL step's path: a batch with images through the shard channel's packing, padded
    micro-batches of two rows (two with images), logprobs = transformers', the HF export = the
    checkpoint, a PPO step changing the tower unless it is frozen (and then not synced)."""
    model = ensure_model("builtin:tiny-qwen2.5-vl")
    (report,) = run_worker(TRAINER_WORKER, tp_size, [model, int(freeze_vision)], venv_env)
    print(f"TP {tp_size}, freeze_vision {freeze_vision}: {report}")
    assert report["logprob_diff"] <= TOLERANCE and report["tokens"] > 150
    assert report["export_mismatches"] == 0 and report["exported"] == 56
    assert report["language_changed"] == 26
    assert report["vision_changed"] == (0 if freeze_vision else 30)
    assert report["synced_vision"] == (0 if freeze_vision else 30)
