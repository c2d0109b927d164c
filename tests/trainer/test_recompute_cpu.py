"""Activation recomputation (trainer.recompute) with real Megatron-core on the CPU (fp32):
'selective' and 'full' give the gradients of 'none', and keep less for the backward pass.

One torchrun job of two ranks (``recompute_worker.py``) trains one PPO step per mode on one
ragged batch: one rank with fixed micro-batches, packed rows, LoRA (and with dropout, whose
masks the recomputation must draw again) and a MoE model replaying random experts; two ranks
with pipeline parallelism (micro-batches of different packing: the schedule runs the next
one's forward before this one's backward), context parallelism, and MoE under TP (sequence
parallel) and PP, replaying. A backward run in another thread (a fresh context, as on GPUs)
must recompute with its forward's positions too.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torchrun_worker import run_worker

from relax_launch.models.build import ensure_model

pytestmark = pytest.mark.e2e
WORKER = Path(__file__).with_name("recompute_worker.py")
TOLERANCE = 1e-6
MiB = 2**20


@pytest.fixture(scope="module")
def memory_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random Llama of 4 layers of hidden 512 (8 heads, 2 KV heads), vocabulary 320: its
    layers' activations, not its logits, make the bulk of what a forward keeps."""
    from transformers import LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("memory") / "llama-4x512"
    config = LlamaConfig(
        vocab_size=320,
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def report(memory_model: Path, venv_env: dict[str, str]) -> dict:
    models = [ensure_model(f"builtin:{name}") for name in ("tiny-llama", "tiny-qwen3-moe")]
    (found,) = run_worker(WORKER, 2, [*models, memory_model], venv_env)
    return found


def steps(report: dict) -> dict[str, dict]:
    """The train-step cases (per rank for the two-rank ones)."""
    return {k: v for k, v in report.items() if k.split()[0] not in SPECIAL}


SPECIAL = ("memory", "memory_cp2", "backward_in_a_thread")


def test_every_case_ran(report):
    names = {name.split()[0] for name in steps(report)}
    assert names == {
        "dense_fixed2",
        "dense_packed",
        "dense_lora",
        "dense_lora_dropout",
        "moe_replay",
        "dense_pp2_packed",
        "dense_cp2_packed",
        "moe_tp2_sp_replay",
        "moe_pp2_replay",
    }
    assert len(steps(report)) == 5 + 2 * 4


def test_recomputation_gives_the_gradients_and_metrics_of_none(report):
    for name, modes in steps(report).items():
        none = modes["none"]
        assert none["largest"] > 1e-3, f"{name}: the step made no gradient"
        for mode in ("selective", "full"):
            got = modes[mode]
            print(f"{name} {mode}: gradient differs from none's by {got['off']:.1e}")
            assert got["off"] <= TOLERANCE, (name, mode, got["off"])
            # the routing statistics too: a recomputed router is not counted twice
            assert got["metrics"] == pytest.approx(none["metrics"], abs=1e-9), (name, mode)
        if name.startswith("moe"):
            assert any(key.startswith("moe/expert") for key in none["metrics"]), name
            assert none["metrics"]["moe/dispatch_mismatch"] == 0.0, name  # replayed


def test_the_adapters_dropout_acts(report):
    with_dropout, without = report["dense_lora_dropout"]["none"], report["dense_lora"]["none"]
    assert with_dropout["largest"] != without["largest"]


def test_the_backward_recomputed_what_the_mode_says(report):
    for name, modes in steps(report).items():
        none, selective, full = (modes[m] for m in ("none", "selective", "full"))
        assert none["attention"] == none["layer"] == 0, name
        # core attention alone, once per layer and micro-batch; full: the whole layer
        assert selective["attention"] > 0 and selective["layer"] == 0, (name, selective)
        assert full["layer"] == full["attention"] == selective["attention"], (name, full)


def test_a_backward_in_another_thread_recomputes_with_its_forwards_positions(report):
    for mode, got in report["backward_in_a_thread"].items():
        assert got["errors"] == [], (mode, got["errors"])
        assert got["off"] <= TOLERANCE, (mode, got["off"])


def test_recomputation_keeps_less_activation_memory(report):
    """4 sequences of 256 tokens through 4 layers of hidden 512 (fp32). On the fused attention
    path selective recomputation drops only the keys and values repeated for grouped queries;
    under context parallelism it drops the scores over the gathered keys too."""
    for name in ("memory", "memory_cp2 rank0", "memory_cp2 rank1"):
        held = report[name]
        print(f"{name}: " + ", ".join(f"{m} {b / MiB:.1f} MiB" for m, b in held.items()))
        assert held["full"] < held["selective"] <= held["none"], (name, held)
        assert held["full"] < 0.15 * held["none"], (name, held)
    cp = report["memory_cp2 rank0"]
    assert cp["selective"] < 0.9 * cp["none"], cp
