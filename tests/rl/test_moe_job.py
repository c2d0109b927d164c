"""A mixture-of-experts RL job through ``relax-launch run``: the repository's tiny Qwen3-MoE
config (experts split over two trainer ranks, routing replay) trains 3 steps, each sync lands
in the engine's stacked expert weights in place, with engine and trainer computing the same
logprobs and the same experts for every trained token; its checkpoint exports to the same
model. The trainer packs each micro-batch's sequences into one row under a token budget.
Slow variants: context parallelism, Qwen2-MoE, experts over TP, an engine of two TP ranks,
colocated."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from test_rl_job import assert_calm_console, run_tiny

from relax_launch.commands.export import export_checkpoint
from relax_launch.trainer.hf_dir import read_weights

pytestmark = pytest.mark.e2e
CONFIG = Path(__file__).parents[2] / "configs" / "qwen3_moe_tiny_cpu.yaml"
TOLERANCE = 1e-4  # fp32 trainer vs fp32 engine


def expert_index(name: str) -> int | None:
    found = re.search(r"\.experts\.(\d+)\.", name)
    return int(found.group(1)) if found else None


TP2_WORLD = ["cluster.nproc_per_node=4", "rollout.ranks=2"]
SPLIT = ["placement.mode=split", "trainer.ranks=null", "cluster.nproc_per_node=2"]
# token-budget micro-batches of packed rows (the engine's routing packed with its tokens)
PACKED = ["trainer.micro_batch_size=null", "trainer.max_tokens_per_micro_batch=400"]
PACKED += ["trainer.pack_sequences=true"]
CASES = {  # case: (policy, overrides of the config)
    "qwen3-moe-ep2-packed": ("tiny-qwen3-moe", PACKED),
    # the sequences split over two context-parallel ranks (experts replicated on both)
    "qwen3-moe-cp2-packed": ("tiny-qwen3-moe", [*PACKED, "trainer.cp_size=2", "trainer.ep_size=1"]),
    "qwen2-moe-ep2": ("tiny-qwen2-moe", []),
    # experts split over TP instead (sequence parallel), synced into two engines
    "qwen3-moe-tp2": ("tiny-qwen3-moe", ["trainer.tp_size=2", "trainer.ep_size=1", *TP2_WORLD]),
    # an engine of two TP ranks: each rank receives its slice of every expert, in place
    "qwen3-moe-ep2-engine-tp2": ("tiny-qwen3-moe", [*TP2_WORLD, "rollout.tp_size=2"]),
    # colocated: trainer and engine share both ranks, the sync goes by buckets
    "qwen3-moe-ep2-split": ("tiny-qwen3-moe", SPLIT),
}
DEFAULT = "qwen3-moe-ep2-packed"
SLOW = [pytest.param(case, marks=pytest.mark.slow) for case in CASES if case != DEFAULT]


@pytest.mark.parametrize("case", [DEFAULT, *SLOW])
def test_moe_job_with_expert_parallelism_and_routing_replay(tmp_path, case):
    model, overrides = CASES[case]
    checkpoints = [f"checkpoint.dir={tmp_path}/checkpoints", "checkpoint.every_steps=3"]
    result = run_tiny(
        CONFIG,
        f"logging.dir={tmp_path}",
        f"trainer.model=builtin:{model}",
        *checkpoints,
        *overrides,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    ranks = 4 if "tp2" in case else 2 if "split" in case else 3
    in_place = model == "tiny-qwen3-moe"
    assert_calm_console(result, tmp_path, ranks=ranks, steps=3)
    steps = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [s["weight_version"] for s in steps] == [0, 1, 2]
    for s in steps:
        print(
            f"step {s['step']}: logprob_diff_max {s['logprob_diff_max']:.2e}, "
            f"mismatch_kl {s['mismatch_kl']:.2e}, routing_mismatch {s['moe/routing_mismatch']}, "
            f"load_balance_loss {s['moe/load_balance_loss']:.3f}, "
            f"staged {s['sync/staged_tensors']}, sync {s['sync/bytes']} B"
        )
        # the sync of the version that generated this step's samples: trainer = engine
        assert s["logprob_diff_max"] <= TOLERANCE
        # routing replay: every trained token went to the experts the engine routed it to
        assert s["moe/dispatch_mismatch"] == 0.0
        tokens = [s[f"moe/expert{e}_tokens"] for e in range(4)]
        assert all(t > 0 for t in tokens) and 1.0 <= s["moe/load_balance_loss"] < 4.0
    # in place: the routed experts' slices of the stacked weights, on every engine TP rank (a
    # shared expert, whose size the CPU engine pads, may go through load_weights)
    if in_place:
        assert all(s["sync/staged_tensors"] == 0 for s in steps)
    export = tmp_path / "hf" / "step_000003"
    if "ep2" in case:  # each EP rank exported its own experts (the sync's export): none held
        index = json.loads((export / "model.safetensors.index.json").read_text())["weight_map"]
        files: dict[str, set] = {}  # all four
        for name, file in index.items():
            files.setdefault(file, set()).add(expert_index(name))
        first, second = (files[f] for f in sorted(files))
        assert second == {2, 3} and {0, 1} <= first and not first & {2, 3}
        with safe_open(str(export / sorted(files)[1]), "pt") as shard:
            assert all(expert_index(name) in (2, 3) for name in shard.keys())
    # the checkpoint (one file per EP rank) converts to the same model, bit for bit
    offline = export_checkpoint(tmp_path, tmp_path / "offline")
    live = read_weights(export)
    assert read_weights(offline).keys() == live.keys()
    assert all(torch.equal(t, live[n]) for n, t in read_weights(offline).items())
