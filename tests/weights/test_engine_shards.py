"""Each engine TP rank's slice of a weight (``engine_shards.EngineShards``) is exactly what
SGLang's own ``weight_loader`` puts into that rank's parameter from the whole checkpoint tensor:
SGLang's layers, built as TP rank k of 2 (``shard_oracle.py``, in a process of its own), are the
oracle. Covers q/k/v with kv heads split and replicated, with biases, gate/up and down with the
CPU engine's padded intermediate sizes, the padded vocabulary, and a MoE layer's experts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from relax_launch import platform
from relax_launch.weights.engine_shards import EngineShards

ORACLE = Path(__file__).with_name("shard_oracle.py")


def rand(*shape: int) -> torch.Tensor:
    return torch.randn(*shape)


def cases() -> dict:
    """name: (oracle layer, its arguments, whole checkpoint tensors, tp_size)."""
    torch.manual_seed(0)
    head_dim = 16
    split = {"q": rand(4 * head_dim, 64), "k": rand(2 * head_dim, 64), "v": rand(32, 64)}
    biased = split | {"qb": rand(4 * head_dim), "kb": rand(2 * head_dim), "vb": rand(32)}
    one_kv = {"q": rand(4 * head_dim, 64), "k": rand(head_dim, 64), "v": rand(head_dim, 64)}
    return {
        "qkv": ("qkv", (4, 2, head_dim, False), split, 2),
        "qkv-bias": ("qkv", (4, 2, head_dim, True), biased, 2),
        "qkv-kv-replicated": ("qkv", (4, 1, head_dim, False), one_kv, 2),
        "gate-up": ("gate_up", (128,), {"gate": rand(128, 64), "up": rand(128, 64)}, 2),
        # the CPU engine pads 48 to 64 (a multiple of 2 * 32): rank 1 holds 16 rows and zeros
        "gate-up-padded": ("gate_up", (64,), {"gate": rand(48, 64), "up": rand(48, 64)}, 2),
        "down-padded": ("down", (64,), {"down": rand(64, 48)}, 2),
        "vocab": ("vocab", (300,), {"embed": rand(300, 64)}, 2),
        "experts": (
            "experts",
            (64,),  # 32 padded to 64: rank 1 holds zeros only
            {"gate": rand(2, 32, 64), "up": rand(2, 32, 64), "down": rand(2, 64, 32)},
            2,
        ),
        "vocab-one-rank": ("vocab", (300,), {"embed": rand(300, 64)}, 1),
    }


@pytest.fixture(scope="module")
def oracle(tmp_path_factory, tiny_model) -> tuple[dict, dict]:
    directory = tmp_path_factory.mktemp("oracle")
    torch.save(cases(), directory / "cases.pt")
    env = platform.sglang_env("cpu")
    env["PYTHONPATH"] = str(Path(__file__).parents[2]) + ":" + env["PYTHONPATH"]
    subprocess.run(
        [
            sys.executable,
            str(ORACLE),
            str(directory / "cases.pt"),
            str(directory / "out.pt"),
            str(tiny_model),
        ],
        env=env,
        check=True,
        timeout=300,
    )
    return torch.load(directory / "cases.pt"), torch.load(directory / "out.pt")


def slices(shards: EngineShards, name: str, whole: torch.Tensor) -> list[torch.Tensor]:
    pieces = shards.slices(name, whole)
    assert all(tuple(p.shape) == shards.shape(name, tuple(whole.shape)) for p in pieces)
    assert all(p.is_contiguous() for p in pieces)
    return pieces


def test_attention_slices_are_what_sglang_loads(oracle):
    cases, loaded = oracle
    for case, kv_heads in (("qkv", 2), ("qkv-kv-replicated", 1)):
        whole = torch.cat([cases[case][2][p] for p in "qkv"])
        shards = EngineShards(2, num_heads=4, num_kv_heads=kv_heads)
        for rank, piece in enumerate(
            slices(shards, "model.layers.0.self_attn.qkv_proj.weight", whole)
        ):
            assert torch.equal(piece, loaded[case, rank]["weight"]), (case, rank)
    whole = torch.cat([cases["qkv-bias"][2][p + "b"] for p in "qkv"])
    shards = EngineShards(2, num_heads=4, num_kv_heads=2, pads_for_tp=True)
    for rank, piece in enumerate(slices(shards, "model.layers.0.self_attn.qkv_proj.bias", whole)):
        assert torch.equal(piece, loaded["qkv-bias", rank]["bias"]), rank


def test_mlp_slices_with_the_cpu_engines_padding_are_what_sglang_loads(oracle):
    cases, loaded = oracle
    shards = EngineShards(2, num_heads=4, num_kv_heads=2, pads_for_tp=True)
    for case in ("gate-up", "gate-up-padded"):
        whole = torch.cat([cases[case][2]["gate"], cases[case][2]["up"]])
        for rank, piece in enumerate(
            slices(shards, "model.layers.0.mlp.gate_up_proj.weight", whole)
        ):
            assert torch.equal(piece, loaded[case, rank]["weight"]), (case, rank)
    whole = cases["down-padded"][2]["down"]
    for rank, piece in enumerate(slices(shards, "model.layers.0.mlp.down_proj.weight", whole)):
        assert torch.equal(piece, loaded["down-padded", rank]["weight"]), rank


def test_a_routed_experts_slices_are_what_sglang_loads(oracle):
    cases, loaded = oracle
    whole = cases["experts"][2]
    shards = EngineShards(2, num_heads=4, num_kv_heads=2, pads_for_tp=True)
    for e in range(2):
        w13 = torch.cat([whole["gate"][e], whole["up"][e]])
        name = f"model.layers.0.mlp.experts.w13_weight[{e}]"
        for rank, piece in enumerate(slices(shards, name, w13)):
            assert torch.equal(piece, loaded["experts", rank]["w13"][e]), (e, rank)
        name = f"model.layers.0.mlp.experts.w2_weight[{e}]"
        for rank, piece in enumerate(slices(shards, name, whole["down"][e])):
            assert torch.equal(piece, loaded["experts", rank]["w2"][e]), (e, rank)


def test_the_padded_vocabulary_slices_are_what_sglang_loads(oracle):
    cases, loaded = oracle
    for tp_size, case in ((2, "vocab"), (1, "vocab-one-rank")):
        whole = cases[case][2]["embed"]
        shards = EngineShards(tp_size, num_heads=4, num_kv_heads=2, pads_for_tp=True)
        for name, kind in (("model.embed_tokens.weight", "embed"), ("lm_head.weight", "head")):
            for rank, piece in enumerate(slices(shards, name, whole)):
                assert torch.equal(piece, loaded[case, rank][kind]), (name, rank)


def test_replicated_tensors_go_whole_and_unpadded_heads_are_left_to_load_weights():
    shards = EngineShards(2, num_heads=4, num_kv_heads=1, pads_for_tp=True)
    norm = torch.ones(64)
    assert all(p is norm for p in shards.slices("model.layers.0.input_layernorm.weight", norm))
    # the CPU engine pads one kv head over two ranks to two (and the q heads with them): sent
    # whole, its load_weights pads it
    qkv = torch.zeros(6 * 16, 64)
    assert shards.shape("model.layers.0.self_attn.qkv_proj.weight", (96, 64)) == (96, 64)
    assert all(p is qkv for p in shards.slices("model.layers.0.self_attn.qkv_proj.weight", qkv))
