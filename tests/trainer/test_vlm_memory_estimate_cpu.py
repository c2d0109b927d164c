"""The memory plan of a vision-language trainer held against measurement on the CPU, as
tests/trainer/test_memory_estimate_cpu.py does for text models: a random Qwen2.5-VL of ~50M
parameters (a 6-layer language model of 512 and an 8-block vision tower of 512), two trainer
ranks (DP 2), the RL job of tests/rl/vlm_tiny.yaml on that model: 4 sequences a rank of 128
tokens, each opening with one image of 16 x 16 patches (64 image tokens: the plan's bound, every
prompt token an image's), micro-batches of 2. Each rank's profiled tensor peak, its resident
state and what a step adds (the language model's activations and logits, the tower's
activations, the step's pixel values) must be within ±20 % of the plan's figures.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_memory_estimate_cpu import TOLERANCE, check_and_print, estimate, worker_case
from torchrun_worker import run_worker

from relax_launch.config import JobConfig, load_config
from relax_launch.placement import PlacementPlan, plan
from relax_launch.placement.memory_plan import memory_plan

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[2]
JOB = REPO / "tests" / "rl" / "vlm_tiny.yaml"
WORKER = Path(__file__).with_name("memory_estimate_worker.py")
GRID = [1, 16, 16]  # 256 patches, 64 image tokens
SHAPE = (
    "cluster.nproc_per_node=3",
    "trainer.ranks=2",
    "data.dataset=/data/rows_with_images.parquet",  # any dataset: no built-in image size
    "data.max_prompt_tokens=64",
    "data.max_response_tokens=64",
)
CASES = {
    "vlm fp32": (),
    "vlm bf16": ("trainer.dtype=bfloat16",),
    "vlm fp32 freeze_vision": ("trainer.freeze_vision=true",),
}


def build_vlm(out: Path) -> Path:
    """A random Qwen2.5-VL of ~50M parameters: the tiny model's builder, tokenizer and processor
    with larger sizes."""
    from relax_launch.models.build_vlm import build_tiny_qwen2_5_vl

    text = {
        "vocab_size": 8192,
        "hidden_size": 512,
        "intermediate_size": 1024,
        "num_hidden_layers": 6,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "max_position_embeddings": 1024,
        "rope_parameters": {"rope_type": "default", "mrope_section": [8, 12, 12]},
        "tie_word_embeddings": False,
    }
    vision = {
        "depth": 8,
        "hidden_size": 512,
        "intermediate_size": 1024,
        "num_heads": 8,
        "out_hidden_size": 512,
        "window_size": 112,
        "fullatt_block_indexes": [3, 7],
    }
    build_tiny_qwen2_5_vl(out, text=text, vision=vision)
    return out


def vlm_estimate(job: JobConfig, placement: PlacementPlan) -> dict[str, float]:
    """The text families' parts (``estimate``) with the vision terms in the step's."""
    parts = estimate(job, placement)
    device = next(d for d in memory_plan(job, placement).devices if d.rank == 0)
    terms = next(h for h in device.holders if h.role == "trainer").terms
    vision = sum(t.bytes for t in terms if t.name in ("pixel values", "vision activations"))
    return parts | {"step": parts["step"] + vision, "total": parts["total"] + vision}


def test_vlm_trainer_memory_is_within_20_percent_of_the_plan(venv_env, tmp_path):
    model = build_vlm(tmp_path / "qwen2.5-vl-50m")
    planned, described = {}, []
    for name, overrides in CASES.items():
        job = load_config(JOB, [*SHAPE, f"trainer.model={model}", *overrides])
        placement = plan(job)
        planned[name] = vlm_estimate(job, placement)
        described.append(worker_case(name, job, placement, image_grid=GRID))
    cases = tmp_path / "cases.json"
    cases.write_text(json.dumps(described))
    reports = sorted(run_worker(WORKER, 2, [cases], venv_env), key=lambda r: r["rank"])
    found = {n: (planned[n], [r["cases"][n] for r in reports]) for n in planned}
    off = check_and_print(found)
    assert TOLERANCE == 0.20 and not off, "\n".join(off)
