"""The memory plan: every device's phases totalled, refusals that name the device, the phase,
the largest consumers and the fix, and the settings that shrink a term acting on it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from relax_launch.config import ConfigError, load_config
from relax_launch.placement import plan, preflight
from relax_launch.placement.device_memory import check_device
from relax_launch.placement.memory_plan import (
    GB,
    check_memory,
    memory_plan,
    planned_fraction,
)
from relax_launch.placement.render import memory_table

REPO = Path(__file__).resolve().parents[2]
GPU_CONFIGS = sorted(
    p.name for p in (REPO / "configs").glob("*.yaml") if "device: cuda" in p.read_text()
)


def job_and_memory(config: str, *overrides: str):
    job = load_config(REPO / "configs" / config, list(overrides))
    placement = plan(job)
    return job, placement, memory_plan(job, placement)


def trainer_term(memory, name: str, rank: int = 0, phase: str | None = None) -> float:
    device = next(
        d for d in memory.devices if d.rank == rank and (phase is None or d.phase == phase)
    )
    trainer = next(h for h in device.holders if h.role == "trainer")
    return sum(t.bytes for t in trainer.terms if t.name == name and not t.host)


@pytest.mark.parametrize("config", GPU_CONFIGS)
def test_every_shipped_gpu_config_fits_an_80_gb_gpu_with_the_margin_shown(config):
    job, placement, memory = job_and_memory(config)
    assert memory is not None, f"{config}: a model's size is unknown"
    assert memory.capacity == pytest.approx(81559 * 1024**2)  # no device here: an H100's
    check_memory(job, memory)
    assert max(d.total for d in memory.devices) <= memory.capacity * 1.001
    shown = memory_table(memory)
    print(f"\n{config}\n{shown}")
    assert "free" in shown and all(f"{p}" in shown for p in {d.phase for d in memory.devices})


def test_a_plan_that_does_not_fit_is_refused_naming_device_phase_consumers_and_fix():
    job, placement, memory = job_and_memory(
        "split_8gpu.yaml", "trainer.distributed_optimizer=false"
    )
    with pytest.raises(ConfigError) as refused:
        check_memory(job, memory)
    message = str(refused.value)
    assert "rank 0 (node 0)" in message and "phase 'train'" in message
    assert "trainer optimizer state 32.8 GB" in message
    assert "Try " in message and "trainer.distributed_optimizer=true" in message
    with pytest.raises(ConfigError, match="phase 'train'"):  # what plan, run and sbatch call
        preflight(job, placement, require_models=False)


def test_the_distributed_optimizer_divides_optimizer_state_and_master_weights_by_dp():
    _, placement, plain = job_and_memory("split_8gpu.yaml", "trainer.distributed_optimizer=false")
    _, _, sharded = job_and_memory("split_8gpu.yaml")
    dp = placement.trainer.dp_size
    assert dp == 4
    for term in ("optimizer state", "master weights"):
        assert trainer_term(sharded, term, phase="train") == pytest.approx(
            trainer_term(plain, term, phase="train") / dp
        )
    assert trainer_term(sharded, "gradients", phase="train") == trainer_term(
        plain, "gradients", phase="train"
    )  # Megatron keeps the whole grad buffer on every rank


def test_optimizer_offload_moves_the_optimizer_to_host_memory():
    _, _, on_device = job_and_memory("qwen3_30b_a3b_moe_2x8.yaml")
    _, _, offloaded = job_and_memory("qwen3_30b_a3b_moe_2x8.yaml", "trainer.optimizer_offload=true")
    assert trainer_term(offloaded, "optimizer state") == 0  # on the host now
    saved = on_device.peak(0).total - offloaded.peak(0).total
    moved = trainer_term(on_device, "optimizer state") + trainer_term(on_device, "master weights")
    assert saved == pytest.approx(moved)


def test_recomputation_keeps_less_activation_memory():
    kept = {
        mode: trainer_term(
            job_and_memory("defer_8gpu.yaml", f"trainer.recompute={mode}")[2],
            "activations",
            phase="train",
        )
        for mode in ("none", "selective", "full")
    }
    assert kept["full"] < kept["selective"] < kept["none"]
    assert kept["full"] < kept["none"] / 5


def test_colocated_gpu_engines_take_their_share_from_the_plan_and_fit_beside_the_trainer():
    job, placement, memory = job_and_memory("defer_8gpu.yaml")
    for engine in placement.engines:
        fraction = planned_fraction(job, placement, engine)
        assert fraction is not None and 0.5 < fraction < 0.9
        assert fraction == memory.fraction_of(engine.label)
    for device in memory.devices:  # each phase's engines leave the margin free
        assert device.total <= memory.capacity
    # a config's own value stands; decoupled engines keep SGLang's default
    given = job_and_memory("defer_8gpu.yaml", "rollout.engine.mem_fraction_static=0.6")
    assert planned_fraction(given[0], given[1], given[1].engines_of("rollout")[0]) is None
    decoupled = job_and_memory("qwen3_8b_decoupled_2x8.yaml")
    assert planned_fraction(decoupled[0], decoupled[1], decoupled[1].engines[0]) is None


def test_an_engine_whose_kv_cache_cannot_hold_one_sequence_is_refused():
    job, _, memory = job_and_memory(
        "quickstart_cpu.yaml", "rollout.engine.max_total_tokens=64", "data.max_prompt_tokens=64"
    )
    with pytest.raises(ConfigError, match=r"rollout engine 0: its KV cache holds 64 tokens"):
        check_memory(job, memory)


def test_a_gpu_smaller_than_planned_is_refused_before_starting():
    job, placement, memory = job_and_memory("split_8gpu.yaml")
    check_device(job, placement, memory.capacity, rank=3)
    check_device(job, placement, None, rank=3)  # the CPU: its share is planned, not detected
    refused = r"rank 3: its GPU has 42.9 GB .*cluster.device_memory_gb=42.9"
    with pytest.raises(ConfigError, match=refused):
        check_device(job, placement, 42.9 * GB, rank=3)


def test_plan_json_carries_the_memory_plan():
    cli = Path(sys.executable).with_name("relax-launch")
    shown = subprocess.run(
        [str(cli), "plan", str(REPO / "configs" / "split_8gpu.yaml"), "--json"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    memory = json.loads(shown)["memory"]
    assert memory["capacity"] == pytest.approx(81559 * 1024**2)
    phases = {(d["rank"], d["phase"]) for d in memory["devices"]}
    assert phases == {(r, p) for r in range(8) for p in ("sync", "inference", "train")}


def test_a_colocated_gpu_engine_is_started_with_the_planned_fraction():
    """The server arguments a rank builds (not started: no GPU here) carry the plan's share."""
    from relax_launch.runtime.engines import engine_worker

    overrides = ["cluster.device=cuda", "cluster.device_memory_gb=80", "rollout.engine={}"]
    job = load_config(
        REPO / "configs" / "split_cpu.yaml", overrides + ["genrm.engine={}", "teacher.engine={}"]
    )
    placement = plan(job)
    memory = memory_plan(job, placement)
    engine = placement.engines_of("rollout")[0]
    worker = engine_worker(job, placement, engine.head_rank, engine, 0, None)
    worker.close()  # never launched: removes its memory-saver scratch directory
    assert worker.server.engine["mem_fraction_static"] == memory.fraction_of(engine.label)
    given = load_config(
        REPO / "configs" / "split_cpu.yaml",
        [
            *overrides,
            "rollout.engine.mem_fraction_static=0.5",
            "genrm.engine={}",
            "teacher.engine={}",
        ],
    )
    worker = engine_worker(given, plan(given), engine.head_rank, engine, 0, None)
    worker.close()
    assert worker.server.engine["mem_fraction_static"] == 0.5
