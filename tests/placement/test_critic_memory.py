"""The value model in the memory plan (``placement/critic_memory.py``): resident beside the policy
in decoupled placement; in a colocated one offloaded outside the trainer's turn, and within it
kept or swapped with the policy's optimizer state, ``auto`` choosing by what the devices hold."""

from __future__ import annotations

from pathlib import Path

import pytest

from relax_launch.config import ConfigError, load_config
from relax_launch.placement import plan
from relax_launch.placement.critic_memory import TRAIN_CRITIC
from relax_launch.placement.memory_plan import GB, check_memory, memory_plan
from relax_launch.placement.render import memory_table
from relax_launch.runtime.critic_turns import CriticTurns
from relax_launch.trainer.offload import CHANGED

REPO = Path(__file__).resolve().parents[2]
# the benchmark's PPO job (SmolLM2, fp32), in defer placement on 2 ranks, started as on GPUs
# (one role at a time: no side-by-side start-up phase)
PPO_DEFER = [
    "placement.staggered_start=true",
    "teacher=null",
    "algorithm.distill_coef=0",
    "algorithm.advantage_estimator=gae",
    "critic.lr=1e-4",
    "placement.mode=defer",
    "trainer.ranks=null",
    "cluster.nproc_per_node=2",
    "cluster.device_memory_gb=20",
]


def memory_of(*overrides: str):
    job = load_config(REPO / "configs" / "quickstart_cpu.yaml", [*PPO_DEFER, *overrides])
    return job, memory_plan(job, plan(job))


def holders(memory, phase: str, rank: int = 1) -> dict[str, tuple[str, dict[str, float]]]:
    """{role: (state, {term: bytes})} on ``rank`` in ``phase``."""
    device = next(d for d in memory.devices if d.rank == rank and d.phase == phase)
    return {h.role: (h.state, {t.name: t.bytes for t in h.terms}) for h in device.holders}


def test_a_kept_critic_is_offloaded_outside_the_trainers_turn_and_trains_beside_its_state():
    _, memory = memory_of("critic.offload=keep")
    phases = [d.phase for d in memory.devices if d.rank == 1]
    assert phases == ["sync", "rollout", "train", "train critic"]
    for phase in ("sync", "rollout"):
        assert holders(memory, phase)["critic"] == ("offloaded", {})
    state, terms = holders(memory, "train")["critic"]
    # SmolLM2's 134.5 M parameters in fp32: 4 bytes each, fp32 gradients, Adam's two moments
    assert state == "resident" and terms["parameters"] == pytest.approx(134.5e6 * 4, rel=0.01)
    assert terms["gradients"] == terms["parameters"] and "activations" not in terms
    assert terms["optimizer state"] == 2 * terms["parameters"]
    policy, critic = (
        holders(memory, "train critic")["trainer"],
        holders(memory, "train critic")["critic"],
    )
    assert policy[0] == "state only" and "activations" not in policy[1]
    assert critic[0] == "active" and critic[1]["activations"] > 0 and "logits" not in critic[1]
    assert memory.critic_mode == "keep"


def test_a_swapped_critic_leaves_the_policy_training_alone_and_trains_beside_its_parameters():
    _, kept = memory_of("critic.offload=keep")
    _, swapped = memory_of("critic.offload=swap")
    phases = [d.phase for d in swapped.devices if d.rank == 1]
    assert phases == ["sync", "rollout", "critic values", "train", "train critic"]
    assert holders(swapped, "train")["critic"] == ("offloaded", {})
    assert set(holders(swapped, "critic values")["critic"][1]) == {"parameters"}
    assert holders(swapped, "train critic")["trainer"][0] == "parameters only"
    assert set(holders(swapped, "train critic")["trainer"][1]) == {"runtime", "parameters"}

    def turn_peak(memory) -> float:
        return max(d.total for d in memory.devices if d.phase in ("train", "train critic"))

    # kept, the policy trains beside the critic's 2.15 GB of state (16 bytes a parameter);
    # swapped, the peak is the critic training beside the policy's parameters (0.54 GB)
    assert turn_peak(swapped) < turn_peak(kept) - 1.5 * GB
    # auto keeps both while the devices hold them, and swaps below that
    _, roomy = memory_of()
    assert roomy.critic_mode == "keep"
    between = (turn_peak(swapped) + turn_peak(kept)) / 2 / GB
    job, tight = memory_of(f"cluster.device_memory_gb={between}")
    assert tight.critic_mode == "swap"
    check_memory(job, tight)
    assert "critic [offloaded]" in memory_table(tight)


def test_a_critic_the_turn_cannot_hold_is_refused_naming_the_swap():
    kept_job, kept = memory_of("critic.offload=keep")
    peak = max(d.total for d in kept.devices if d.phase == "train")
    job, memory = memory_of("critic.offload=keep", f"cluster.device_memory_gb={peak / GB - 0.1}")
    with pytest.raises(ConfigError, match=r"in phase 'train'.*critic.offload=swap") as refused:
        check_memory(job, memory)
    assert "critic optimizer state" in str(refused.value)


def test_a_decoupled_critic_is_resident_beside_the_policy():
    job = load_config(REPO / "tests" / "rl" / "critic_tiny.yaml", [])
    memory = memory_plan(job, plan(job))
    assert memory.critic_mode == "resident"
    assert [d.phase for d in memory.devices if d.rank == 0] == ["resident"]
    state, terms = holders(memory, "resident", rank=0)["critic"]
    assert state == "resident" and "optimizer state" in terms and "activations" not in terms


class Residency:
    """A trainer's or critic's client that knows which of its parts are on the device."""

    def __init__(self, resident: set[str]) -> None:
        self.resident = resident

    def offload(self, parts):  # each part it moved named as a rank's reply names it
        moved = {f"{CHANGED}{p}": 1.0 for p in parts if p in self.resident}
        self.resident -= set(parts)
        return {"bytes": 0.0} | moved

    def onload(self, parts):
        moved = {f"{CHANGED}{p}": 1.0 for p in parts if p not in self.resident}
        self.resident |= set(parts)
        return {"bytes": 0.0} | moved


# a state part's terms in the memory plan (trainer/offload.py's parts)
PART_TERMS = {
    "params": ("parameters",),
    "grads": ("gradients",),
    "optimizer": ("master weights", "optimizer state"),
}


@pytest.mark.parametrize("mode", ["keep", "swap"])
def test_a_checkpoint_of_the_critic_holds_no_more_than_the_trainers_turn_the_plan_checks(mode):
    """Save and load happen where a step leaves the ranks (the policy whole, the critic in host
    memory, the engines released); the critic's worker brings its parameters and optimizer
    state for the duration (runtime/critic_worker.py). What the device holds then is within
    the peak of the trainer's turn, which the plan checks: swapped, the policy's optimizer
    state leaves first (both models' state at once, 4.12 GB here, is more than the swap plan's
    peak of 3.99 GB)."""
    _, memory = memory_of(f"critic.offload={mode}")
    policy, critic = Residency({"params", "grads", "optimizer"}), Residency(set())
    turns = CriticTurns(policy, critic, mode)
    seen: list[dict[str, set[str]]] = []

    def worker_at_work() -> str:  # the worker's _resident: params and optimizer on the device
        seen.append({"trainer": set(policy.resident), "critic": {"params", "optimizer"}})
        return "done"

    assert turns.checkpoint(worker_at_work) == "done"
    assert policy.resident == {"params", "grads", "optimizer"}  # as the step left it
    turn = [d for d in memory.devices if d.rank == 1 and d.phase in ("train", TRAIN_CRITIC)]
    whole = {  # every term of each model on rank 1, by role
        role: holders(memory, phase)[role][1]
        for role, phase in (("trainer", "train"), ("critic", TRAIN_CRITIC))
    }
    others = sum(h.device_bytes for h in turn[0].holders if h.role not in whole)  # engines
    (moment,) = seen
    held = others + whole["trainer"]["runtime"]  # the critic shares the trainer's process
    for role, parts in moment.items():
        held += sum(whole[role].get(n, 0.0) for p in parts for n in PART_TERMS[p])
    assert held <= max(d.total for d in turn)
