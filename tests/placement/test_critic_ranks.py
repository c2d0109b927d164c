"""The value model on ranks of its own (``critic.ranks: own``, ``placement/critic_ranks.py``):
the planner gives it ``critic.tp_size x critic.dp_size`` ranks after the trainer's, the plan
shows them and round-trips them, the rank budget and the memory plan count them."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from relax_launch.cli import critic_line
from relax_launch.config import ConfigError, load_config
from relax_launch.placement import PlacementPlan, plan
from relax_launch.placement.memory_plan import check_memory, memory_plan
from relax_launch.placement.preflight import preflight
from relax_launch.placement.render import table

REPO = Path(__file__).resolve().parents[2]
CRITIC = REPO / "tests" / "rl" / "critic_tiny.yaml"  # trainer DP 2, a rollout engine
OWN = ["critic.ranks=own", "cluster.nproc_per_node=4"]


def planned(*overrides: str):
    job = load_config(CRITIC, [*OWN, *overrides])
    return job, plan(job)


def roles(p: PlacementPlan) -> list[str]:
    return [",".join(a.role for a in r.assignments) for r in p.ranks]


def test_the_critic_takes_the_ranks_after_the_trainers():
    job, p = planned()
    assert roles(p) == ["trainer", "trainer", "critic", "rollout"]
    assert p.critic.ranks == (2,) and (p.critic.tp_size, p.critic.dp_size) == (1, 1)
    assert p.trainer.ranks == (0, 1)  # the policy keeps its own
    shown = table(p)
    assert "critic[tp0 dp0]" in shown and "critic: ranks 2-2  tp=1 dp=1 (its own)" in shown
    assert "on ranks of its own 2-2 (tp=1 dp=1)" in critic_line(job, p, None)


def test_its_own_grid_is_tp_fastest_then_dp():
    _, p = planned("cluster.nproc_per_node=7", "critic.tp_size=2", "critic.dp_size=2")
    assert roles(p) == ["trainer"] * 2 + ["critic"] * 4 + ["rollout"]
    coordinates = [(a.tp_rank, a.dp_rank) for r in p.ranks[2:6] for a in r.assignments]
    assert coordinates == [(0, 0), (1, 0), (0, 1), (1, 1)]
    assert p.critic.rank_at(1, 1, 0) == 5  # the shard channel's first and result ranks
    assert PlacementPlan.from_json(p.to_json()) == p


def test_the_plan_hash_tells_own_ranks_from_shared_ones():
    _, own = planned()
    # the same plan but for the critic's own layout: the hash covers it
    without = dataclasses.replace(own, critic=None)
    assert own.critic is not None and own.stable_hash() != without.stable_hash()


def test_the_rank_budget_counts_the_critics_ranks():
    with pytest.raises(ConfigError, match=r"critic.tp_size x critic.dp_size=2 \+ .* = 5") as e:
        planned("critic.dp_size=2")
    assert {"critic.tp_size", "critic.dp_size"} <= set(e.value.fields)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (  # 9 attention heads, 3 key/value heads: TP 2 splits neither
            ["critic.model=builtin:smollm2-135m-instruct", "critic.tp_size=2"],
            "critic.tp_size=2 must divide the model's 9 attention heads",
        ),
        (["critic.model=builtin:tiny-qwen3-moe", "critic.tp_size=2"], "mixture-of-experts"),
    ],
)
def test_preflight_checks_the_critics_own_model_and_tensor_parallelism(overrides, message):
    job, p = planned("cluster.nproc_per_node=5", *overrides)
    with pytest.raises(ConfigError, match=message) as e:
        preflight(job, p, require_models=True)
    assert set(e.value.fields) & {"critic.tp_size", "critic.model"}


def test_preflight_passes_a_critic_whose_tp_divides_its_heads():
    job, p = planned("critic.tp_size=2", "cluster.nproc_per_node=5")
    preflight(job, p, require_models=True)


def test_a_critic_tensor_group_across_nodes_is_refused():
    with pytest.raises(ConfigError, match="cross a node boundary"):
        # 2 nodes of 4: the trainer on ranks 0-2, the critic's TP pair on ranks 3-4
        planned(
            "cluster.nnodes=2",
            "trainer.ranks=3",
            "critic.tp_size=2",
            "rollout.ranks=3",
            "trainer.micro_batch_size=1",
            "data.prompts_per_step=3",
            "critic.micro_batch_size=1",
        )


def test_the_memory_plan_puts_the_whole_critic_on_its_ranks_and_none_on_the_trainers():
    job, p = planned("critic.tp_size=2", "cluster.nproc_per_node=5")
    memory = memory_plan(job, p)
    check_memory(job, memory)
    by_rank = {d.rank: {h.role: h for h in d.holders} for d in memory.devices}
    assert "critic" not in by_rank[0] and "critic" not in by_rank[1]
    critic = by_rank[2]["critic"]
    terms = {t.name: t.bytes for t in critic.terms}
    assert critic.state == "active" and "runtime" in terms and "activations" in terms
    # sized by its own TP 2: half the parameters per rank of a shared critic at trainer TP 1
    shared_job = load_config(CRITIC, [])
    shared = memory_plan(shared_job, plan(shared_job))
    beside = next(h for d in shared.devices if d.rank == 0 for h in d.holders if h.role == "critic")
    shared_params = next(t.bytes for t in beside.terms if t.name == "parameters")
    assert terms["parameters"] < 0.6 * shared_params


def test_the_trainer_and_its_critic_share_the_cores_they_train_on_at_once():
    _, p = planned()
    # trainer ranks 0-1 and the critic's rank 2 compute at the same time on a node of 6 cores
    assert p.cpu_threads(0, "trainer", 6, overlapping=False) == 2
    assert p.cpu_threads(0, "critic", 6, overlapping=False) == 2
