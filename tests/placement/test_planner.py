"""plan() places every role as docs/design.md ("Placement") says, deterministically."""

from __future__ import annotations

from pathlib import Path

import pytest

from relax_launch.config import build_config, load_config
from relax_launch.placement import PlacementPlan, plan

REPO = Path(__file__).resolve().parents[2]


def job(mode: str, world: tuple[int, int], roles: dict, prompts: int = 8, **extra) -> object:
    raw = {
        "cluster": {"nnodes": world[0], "nproc_per_node": world[1]},
        "placement": {"mode": mode},
        "trainer": {"model": "/m/policy", **extra.get("trainer", {})},
        "algorithm": {"n_samples_per_prompt": 8, "distill_coef": 0.1 if "teacher" in roles else 0},
        "data": {"prompts_per_step": prompts},
    }
    for name, role in roles.items():
        raw[name] = dict(role)
        if name != "rollout":
            raw[name]["model"] = "/m/" + name
    if "genrm" in roles:
        raw["reward"] = {"sources": [{"name": "judge", "genrm": True}]}
    return build_config(raw)


def roles_by_rank(p: PlacementPlan) -> list[list[str]]:
    return [[f"{a.role}:{a.phase}" for a in r.assignments] for r in p.ranks]


def test_decoupled_roles_take_contiguous_ranges_in_order():
    j = job(
        "decoupled",
        (2, 8),
        {
            "rollout": {"ranks": 4, "tp_size": 2},
            "genrm": {"ranks": 2, "tp_size": 2},
            "teacher": {"ranks": 2, "tp_size": 2},
        },
        trainer={"ranks": 8, "tp_size": 4},
    )
    p = plan(j)
    assert [e.ranks for e in p.engines] == [(8, 9), (10, 11), (12, 13), (14, 15)]
    assert [(e.role, e.index) for e in p.engines] == [
        ("rollout", 0),
        ("rollout", 1),
        ("genrm", 0),
        ("teacher", 0),
    ]
    assert p.trainer.ranks == tuple(range(8)) and p.trainer.dp_size == 2
    assert p.phase_order == ("resident",)
    assert all(len(r.assignments) == 1 for r in p.ranks)
    assert p.ranks[9].assignments[0].is_head is False and p.ranks[8].assignments[0].is_head


def test_split_slices_are_consecutive_and_share_one_inference_phase():
    # The layout of Relax's split test: actor 8, rollout 4, genrm 2, teacher 2.
    j = job(
        "split",
        (1, 8),
        {"rollout": {"ranks": 4}, "genrm": {"ranks": 2}, "teacher": {"ranks": 2}},
    )
    p = plan(j)
    starts = {e.role: e.ranks[0] for e in reversed(p.engines)}
    assert starts == {"rollout": 0, "genrm": 4, "teacher": 6}
    assert p.phase_order == ("inference", "train")
    assert roles_by_rank(p)[5] == ["trainer:train", "genrm:inference"]
    assert p.trainer.ranks == tuple(range(8))


def test_defer_roles_each_start_at_zero_in_their_own_phase():
    j = job(
        "defer",
        (1, 8),
        {
            "rollout": {"ranks": 8, "tp_size": 2},
            "teacher": {"ranks": 8, "tp_size": 4},
            "genrm": {"ranks": 4, "tp_size": 4},
        },
    )
    p = plan(j)
    assert p.phase_order == ("rollout", "teacher", "genrm", "train")
    assert {e.role: e.ranks[0] for e in p.engines if e.index == 0} == {
        "rollout": 0,
        "teacher": 0,
        "genrm": 0,
    }
    assert roles_by_rank(p)[0] == [
        "trainer:train",
        "rollout:rollout",
        "genrm:genrm",
        "teacher:teacher",
    ]
    assert roles_by_rank(p)[7] == ["trainer:train", "rollout:rollout", "teacher:teacher"]
    # No rank holds two roles in one phase.
    for r in p.ranks:
        phases = [a.phase for a in r.assignments]
        assert len(phases) == len(set(phases))


def test_defer_phase_order_lists_only_configured_roles():
    p = plan(job("defer", (1, 4), {"rollout": {"ranks": 4}}))
    assert p.phase_order == ("rollout", "train")


def test_multinode_engine_uses_whole_nodes_and_one_head():
    j = job(
        "decoupled",
        (4, 8),
        {
            "rollout": {"ranks": 8, "tp_size": 2},
            "teacher": {"ranks": 16, "tp_size": 8, "pp_size": 2},
        },
        trainer={"ranks": 8, "tp_size": 4},
    )
    p = plan(j)
    (teacher,) = p.engines_of("teacher")
    assert teacher.nodes == (2, 3) and teacher.head_rank == 16 and teacher.tp_size == 8
    heads = [r.rank for r in p.ranks for a in r.assignments if a.role == "teacher" and a.is_head]
    assert heads == [16]
    assert p.ranks[31].assignments[0].engine_rank == 15 and p.ranks[31].node == 3


def test_trainer_coordinates_are_tp_fastest_then_dp_then_pp():
    j = build_config(
        {
            "cluster": {"nnodes": 3, "nproc_per_node": 4},
            "trainer": {"model": "/m", "ranks": 8, "tp_size": 2, "pp_size": 2},
            "rollout": {"ranks": 4, "tp_size": 2},
            "algorithm": {"n_samples_per_prompt": 2},
            "data": {"prompts_per_step": 1},
        }
    )
    p = plan(j)
    coords = [(a.tp_rank, a.dp_rank, a.pp_rank) for r in p.ranks[:8] for a in r.assignments]
    assert coords == [
        (0, 0, 0),
        (1, 0, 0),
        (0, 1, 0),
        (1, 1, 0),
        (0, 0, 1),
        (1, 0, 1),
        (0, 1, 1),
        (1, 1, 1),
    ]
    # One weight-sync group per pipeline stage, sourced from that stage's tp0/dp0 rank, with
    # SGLang rank offsets per rollout engine after the source (rank 0 of the group). Engines of
    # one TP size (2) take one group per TP index: one worker of each engine in each.
    groups = p.weight_sync_groups
    assert [(g.pp_rank, g.source_rank) for g in groups] == [(0, 0), (1, 4)]
    assert groups[0].engine_rank_offsets == ((0, 1), (1, 2)) and groups[0].world_size == 3


def test_plan_round_trips_through_json_and_hashes_stably():
    j = job(
        "split", (1, 8), {"rollout": {"ranks": 4}, "genrm": {"ranks": 2}, "teacher": {"ranks": 2}}
    )
    p = plan(j)
    again = PlacementPlan.from_json(p.to_json())
    assert again == p and again.stable_hash() == p.stable_hash() == plan(j).stable_hash()
    assert len(p.stable_hash()) == 16


def test_hash_changes_with_layout_and_with_config():
    base = job("decoupled", (1, 8), {"rollout": {"ranks": 4}}, trainer={"ranks": 4})
    other_layout = job("decoupled", (1, 8), {"rollout": {"ranks": 6}}, trainer={"ranks": 2})
    other_lr = job("decoupled", (1, 8), {"rollout": {"ranks": 4}}, trainer={"ranks": 4, "lr": 1e-5})
    hashes = {plan(j).stable_hash() for j in (base, other_layout, other_lr)}
    assert len(hashes) == 3


def test_cli_world_overrides_the_config_cluster():
    j = job("split", (1, 8), {"rollout": {"ranks": 4}})
    p = plan(j, nnodes=2, nproc_per_node=4)
    assert (p.nnodes, p.nproc_per_node, p.world_size) == (2, 4, 8)
    assert p.ranks[5].node == 1 and p.ranks[5].local_rank == 1


@pytest.mark.parametrize("mode", ["decoupled", "split", "defer"])
def test_plans_512_nodes_of_8_with_four_roles(mode):
    roles = {
        "rollout": {"ranks": 1024, "tp_size": 8},
        "genrm": {"ranks": 512, "tp_size": 8},
        "teacher": {"ranks": 1024, "tp_size": 16},
    }
    trainer = (
        {"ranks": 4096 - 2560, "tp_size": 8, "pp_size": 3}
        if mode == "decoupled"
        else {"tp_size": 8}
    )
    p = plan(job(mode, (512, 8), roles, prompts=512, trainer=trainer))
    assert p.world_size == 4096 and len(p.ranks) == 4096
    assert len(p.engines) == 128 + 64 + 64
    assert sum(len(e.ranks) for e in p.engines) == 2560


def test_cpu_threads_share_a_nodes_cores_among_what_computes_at_once():
    quickstart = plan(load_config(str(REPO / "configs" / "quickstart_cpu.yaml")))
    # synchronous: the roles take turns, so each role's processes share the node's cores
    by_role = {r: quickstart.cpu_threads(0, r, 8, False) for r in ("trainer", "rollout", "teacher")}
    assert by_role == {"trainer": 4, "rollout": 8, "teacher": 8}
    # rollout overlapping training: the node's four processes all compute at once
    assert {quickstart.cpu_threads(0, r, 8, True) for r in by_role} == {2}
    assert quickstart.cpu_threads(0, "trainer", 2, True) == 1  # never below one
    # defer: every role on every rank, one phase at a time
    defer = plan(load_config(str(REPO / "configs" / "defer_cpu.yaml")))
    ranks = len(defer.ranks)
    assert defer.cpu_threads(0, "trainer", 8, False) == 8 // ranks


QWEN3_30B_A3B = {  # the config.json fields planning and preflight read
    "architectures": ["Qwen3MoeForCausalLM"],
    "num_hidden_layers": 48,
    "hidden_size": 2048,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "vocab_size": 151936,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "norm_topk_prob": True,
}


def test_the_moe_example_plans_each_ep_rank_with_its_experts_and_sync_group(tmp_path):
    import json

    from relax_launch.placement import preflight
    from relax_launch.placement.render import summary

    (tmp_path / "config.json").write_text(json.dumps(QWEN3_30B_A3B))
    config = load_config(
        REPO / "configs" / "qwen3_30b_a3b_moe_2x8.yaml", [f"trainer.model={tmp_path}"]
    )
    p = plan(config)
    assert (p.trainer.ep_size, p.trainer.dp_size, p.trainer.num_experts) == (4, 4, 128)
    warnings = preflight(config, p, require_models=False)
    assert not [w for w in warnings if "trainer.model" in w or "rollout.model" in w]
    text = summary(p)
    assert "tp=2 pp=1 dp=4 ep=4" in text
    assert "  ep0: experts 0-31 on ranks 0,1" in text
    assert "  ep3: experts 96-127 on ranks 6,7" in text
    sources = [(g.ep_rank, g.source_rank) for g in p.weight_sync_groups]
    assert sources == [(e, 2 * e) for e in range(4)]  # each EP rank sends its own experts
    assert [a.ep_rank for r in p.ranks[:8] for a in r.assignments] == [0, 0, 1, 1, 2, 2, 3, 3]


def test_the_prefill_decode_example_plans_pairs_and_pipeline_engines(tmp_path):
    """configs/qwen3_8b_pd_pp_2x8.yaml through ``relax-launch plan``: two decode engines of
    TP 2 paired with one prefill engine of TP 2, and a teacher of two pipeline stages."""
    import json
    import subprocess
    import sys

    qwen3_8b = {
        "architectures": ["Qwen3ForCausalLM"],
        "num_hidden_layers": 36,
        "hidden_size": 4096,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 151936,
    }
    for name in ("Qwen3-8B", "Qwen3-32B"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(qwen3_8b))
    cli = Path(sys.executable).with_name("relax-launch")
    overrides = [
        f"trainer.model={tmp_path}/Qwen3-8B",
        f"teacher.model={tmp_path}/Qwen3-32B",
    ]
    config = REPO / "configs" / "qwen3_8b_pd_pp_2x8.yaml"
    shown = subprocess.run(
        [str(cli), "plan", str(config), *overrides], capture_output=True, text=True, check=True
    ).stdout
    assert "8     1     0      rollout[e0 head decode]" in shown
    assert "12    1     4      rollout[e2 head prefill]" in shown
    assert "13    1     5      rollout[e2 follower1 prefill]" in shown
    assert (
        "rollout engine 0 (decode): ranks 8-9 (head 8) tp=2 pp=1 node(s) 1 <- prefill engine 2"
        in shown
    )
    assert "rollout engine 2 (prefill): ranks 12-13 (head 12) tp=2 pp=1 node(s) 1" in shown
    assert "teacher engine 0: ranks 14-15 (head 14) tp=1 pp=2 node(s) 1" in shown
    # every rollout engine of both halves takes the weights, TP rank k its slice in group k
    assert (
        "weight sync pp0: source rank 0 -> 3 rollout worker(s) in each of 2 groups by engine TP "
        "rank in 3 engine(s)" in shown
    )


def test_max_engines_reserves_ranks_after_the_planned_engines_outside_weight_sync():
    from relax_launch.placement.render import roles_label, summary

    j = job(
        "decoupled",
        (1, 8),
        {"rollout": {"ranks": 2, "max_engines": 4}, "genrm": {"ranks": 1, "max_engines": 2}},
        trainer={"ranks": 2},
    )
    p = plan(j)
    shape = [(e.role, e.index, e.ranks, e.reserved) for e in p.engines]
    assert shape == [
        ("rollout", 0, (2,), False),
        ("rollout", 1, (3,), False),
        ("rollout", 2, (4,), True),
        ("rollout", 3, (5,), True),
        ("genrm", 0, (6,), False),
        ("genrm", 1, (7,), True),
    ]
    # the first sync goes to the planned rollout engines only; a scaled-out one joins later
    assert p.weight_sync_groups[0].engine_rank_offsets == ((0, 1), (1, 2))
    assert roles_label(p, p.ranks[4]) == "rollout[e2 head reserved]"
    assert "genrm engine 1 (reserved): ranks 7-7" in summary(p)
    assert PlacementPlan.from_json(p.to_json()) == p
