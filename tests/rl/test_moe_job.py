"""A mixture-of-experts RL job through ``relax-launch run``: the repository's tiny Qwen3-MoE
config (experts split over two trainer ranks, routing replay) trains 3 steps, each sync lands
in the engine's stacked expert weights in place, with engine and trainer computing the same
logprobs and the same experts for every trained token."""

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


@pytest.mark.parametrize(
    "model", ["tiny-qwen3-moe", pytest.param("tiny-qwen2-moe", marks=pytest.mark.slow)]
)
def test_moe_job_with_expert_parallelism_and_routing_replay(tmp_path, model):
    checkpoints = [f"checkpoint.dir={tmp_path}/checkpoints", "checkpoint.every_steps=3"]
    result = run_tiny(
        CONFIG, f"logging.dir={tmp_path}", f"trainer.model=builtin:{model}", *checkpoints
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert_calm_console(result, tmp_path, ranks=3, steps=3)
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
    # in place: the routed experts' slices of the stacked weights (a shared expert, whose size
    # the CPU engine pads, goes through load_weights)
    if model == "tiny-qwen3-moe":
        assert all(s["sync/staged_tensors"] == 0 for s in steps)
    # each EP rank exported its own experts (the sync's export): no rank held all four
    export = tmp_path / "hf" / "step_000003"
    index = json.loads((export / "model.safetensors.index.json").read_text())["weight_map"]
    files: dict[str, set] = {}
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
