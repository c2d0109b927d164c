"""PPO with a learned value model in a real job (``tests/rl/critic_tiny.yaml``): the critic on
the trainer's ranks scores each batch, GAE advantages train the policy, the value loss falls,
explained variance is reported, checkpoints hold the critic and a resumed job continues with
it (the exact continuation of a resumed critic: tests/trainer/test_critic_cpu.py)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_rl_job import run_tiny

from relax_launch.commands.export import export_checkpoint

pytestmark = pytest.mark.slow  # two real jobs, about a minute each
CONFIG = Path(__file__).parent / "critic_tiny.yaml"


def test_ppo_with_a_critic_trains_and_resumes(tmp_path):
    ckpt = tmp_path / "ckpt"
    common = [f"logging.dir={tmp_path}", f"checkpoint.dir={ckpt}", "checkpoint.every_steps=1"]
    first = run_tiny(CONFIG, *common)
    assert first.returncode == 0, first.stdout[-4000:] + first.stderr[-2000:]
    steps = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(steps) == 5
    losses = [s["critic/value_loss"] for s in steps]
    assert all(math.isfinite(v) for v in losses), losses
    assert (losses[-1] + losses[-2]) / 2 < 0.6 * losses[0], losses  # a fresh head's at first
    for s in steps:
        assert math.isfinite(s["critic/explained_variance"]), s
        assert s["critic/grad_norm"] > 0 and s["grad_norm"] > 0 and s["train_skipped"] == 0
        assert s["critic/clip_fraction"] == 0.0  # one update per step: V = V_old
    # the critic learns the returns' level: from a fresh head's ~0 towards the mean reward
    assert abs(steps[-1]["critic/value_mean"] - steps[-1]["reward"]) < abs(
        steps[0]["critic/value_mean"] - steps[0]["reward"]
    )
    assert "V-loss " in first.stdout and "critic/value_loss" in first.stdout  # line, summary
    newest = ckpt / "step_000005"
    assert {"critic_tp0_pp0.pt", "trainer_tp0_pp0.pt"} <= {f.name for f in newest.iterdir()}

    second = run_tiny(CONFIG, *common, "algorithm.num_steps=6", "--resume")
    assert second.returncode == 0, second.stdout[-4000:] + second.stderr[-2000:]
    resumed = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[5])
    assert resumed["step"] == 6
    # the critic came back trained: its loss is the trained one's, not a fresh head's
    assert resumed["critic/value_loss"] < 0.5 * losses[0], (resumed, losses)
    # the export is the policy alone: `relax-launch export` of the newest checkpoint (beside
    # its critic shard) writes the tensors the run exported at its last step
    offline = export_checkpoint(tmp_path, tmp_path / "exported")
    ours = load_file(str(offline / "model.safetensors"))
    theirs = load_file(str(tmp_path / "hf" / "step_000006" / "model.safetensors"))
    assert sorted(ours) == sorted(theirs) and all(torch.equal(ours[k], theirs[k]) for k in ours)
