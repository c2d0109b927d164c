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


PACKING_WORKER = Path(__file__).with_name("vlm_packing_worker.py")


@pytest.mark.parametrize("tp_size", [1, 2])
def test_packed_vlm_micro_batches_score_and_step_as_padded_ones(venv_env, tp_size):
    """Four sequences (three with images) end to end in one row, each with its own multimodal
    positions from 0 and attention confined to it: logprobs = padded micro-batches' =
    transformers', and a step's gradients = the padded step's, the tower's included."""
    model = ensure_model("builtin:tiny-qwen2.5-vl")
    (report,) = run_worker(PACKING_WORKER, tp_size, [model], venv_env)
    print(f"TP {tp_size}: {report}")
    assert report["sequences_per_row"] == 4 and report["tokens"] > 150
    assert report["packed_vs_padded"] <= TOLERANCE
    assert report["packed_vs_transformers"] <= TOLERANCE
    assert report["grad_tensors"] == report["tensors"] and report["grad_diff"] <= TOLERANCE
    assert report["loss_diff"] <= TOLERANCE
    assert report["packed_tokens"] < report["padded_tokens"]


LORA_WORKER = Path(__file__).with_name("vlm_lora_worker.py")


@pytest.mark.parametrize("tp_size", [1, 2])
def test_lora_on_a_vlm_trains_only_its_adapters_and_exports_merged(venv_env, tmp_path, tp_size):
    """LoRA on the language model of the trainer's Qwen2.5-VL: at init (B = 0) its logprobs on
    image+text rows are the base's (transformers'); two PPO steps change the adapters alone
    (not the base, not the tower); the merged export is base + scale·B@A for the targeted
    weights and the base elsewhere, a sync sends exactly the targeted weights (no tower), the
    export written as a directory scores in transformers as the trainer does, and a fresh
    trainer loading the adapters-only checkpoint scores as the trained one."""
    model = ensure_model("builtin:tiny-qwen2.5-vl")
    (report,) = run_worker(LORA_WORKER, tp_size, [model, tmp_path], venv_env)
    print(f"TP {tp_size}: {report}")
    assert report["init_diff"] <= TOLERANCE and report["tokens"] > 100
    # 2 layers x 4 targeted linears x (A, B); every one moved, nothing else did
    assert report["adapters"] == 16 and report["adapters_changed"] == 16
    assert report["others_changed"] == []
    assert report["trained_vs_base"] > 1e-3  # the steps moved the policy
    # 2 layers x q, k, v, o, gate, up, down
    assert report["merged"] == 14 and report["merge_diff"] <= 1e-6
    assert report["untouched_mismatches"] == 0 and report["exported"] == 56
    assert report["synced"] and report["synced_vision"] == 0
    assert report["export_diff"] <= TOLERANCE
    assert report["resume_diff"] == 0.0
    assert report["checkpoint_keys"] == ["lora_a", "lora_b"]
