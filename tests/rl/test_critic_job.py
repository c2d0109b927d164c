"""PPO with a learned value model in real jobs (``tests/rl/critic_tiny.yaml``): the critic on
the trainer's ranks scores each batch, GAE advantages train the policy, the value loss falls,
explained variance is reported, checkpoints hold the critic and a resumed job continues with
it. In ``defer`` placement the critic is swapped in and out within the trainer's turn, and a job
resumed from a checkpoint replays the next step exactly (the critic alone, resumed exactly:
tests/trainer/test_critic_cpu.py)."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_rl_job import run_tiny

from relax_launch.commands.export import export_checkpoint

pytestmark = pytest.mark.slow  # real jobs, about a minute each
CONFIG = Path(__file__).parent / "critic_tiny.yaml"
# Greedy decoding for the exact replays: below SGLang's 1e-6 the engine takes the argmax, no
# random draw (tests/inference/test_greedy_sampling.py), so a step replayed after a resume draws
# the same tokens in the same rows. Near-greedy 0.001 did not: the tiny model's next-token
# logits are nearly flat (its logprobs about -5.2 over 320 tokens), the top two at times within
# 0.001, and the engine's draws are unseeded: one run's prompt drew token 119 in one of its four
# samples and 277 in three, so a replay may draw them in other rows or other numbers (the
# critic's metrics then differ in their last bits, the loss, a sum cancelling to 1e-8, more).
GREEDY = "algorithm.temperature=1e-7"


def run_job(tmp_path: Path, *overrides: str) -> tuple[subprocess.CompletedProcess, list[dict]]:
    """The critic's job with ``overrides``, logging into ``tmp_path`` and checkpointing every
    step into its ``ckpt``, which must succeed: its output and every step's metrics in the run
    directory (a resumed run rewrites the file from the step it resumes at)."""
    ckpt = tmp_path / "ckpt"
    common = [f"logging.dir={tmp_path}", f"checkpoint.dir={ckpt}", "checkpoint.every_steps=1"]
    done = run_tiny(CONFIG, *common, *overrides)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    return done, [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]


def test_ppo_with_a_critic_trains_and_resumes(tmp_path):
    ckpt = tmp_path / "ckpt"
    first, steps = run_job(tmp_path)
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

    resumed = run_job(tmp_path, "algorithm.num_steps=6", "--resume")[1][5]
    assert resumed["step"] == 6
    # the critic came back trained: its loss is the trained one's, not a fresh head's
    assert resumed["critic/value_loss"] < 0.5 * losses[0], (resumed, losses)
    # the export is the policy alone: `relax-launch export` of the newest checkpoint (beside
    # its critic shard) writes the tensors the run exported at its last step
    offline = export_checkpoint(tmp_path, tmp_path / "exported")
    ours = load_file(str(offline / "model.safetensors"))
    theirs = load_file(str(tmp_path / "hf" / "step_000006" / "model.safetensors"))
    assert sorted(ours) == sorted(theirs) and all(torch.equal(ours[k], theirs[k]) for k in ours)


# defer on 2 ranks: the trainer (DP 2) and the critic on both, the rollout engine on rank 0 in
# its own phase; the critic swapped with the policy's optimizer state within the trainer's turn.
DEFER = [
    "placement.mode=defer",
    "trainer.ranks=null",
    "cluster.nproc_per_node=2",
    "critic.offload=swap",
    GREEDY,
]


def test_a_colocated_critic_swaps_within_the_trainers_turn_and_resumes_exactly(tmp_path):
    steps = run_job(tmp_path, *DEFER)[1]
    assert len(steps) == 5
    # the critic's Adam state is born in its first step: it leaves with the rest
    assert steps[0]["memory/critic_offloaded_gb"] > steps[0]["memory/critic_onloaded_gb"] > 0
    for s in steps:
        # the critic came in (parameters to score, everything to train) and went out again;
        # the policy's gradients and optimizer state went out for the critic's step and back
        assert s["memory/policy_swapped_out_gb"] == s["memory/policy_swapped_in_gb"] > 0, s
    for s in steps[1:]:
        assert s["memory/critic_onloaded_gb"] == s["memory/critic_offloaded_gb"] > 0, s
        assert math.isfinite(s["critic/explained_variance"]) and s["critic/grad_norm"] > 0
    losses = [s["critic/value_loss"] for s in steps]
    assert (losses[-1] + losses[-2]) / 2 < 0.6 * losses[0], losses
    assert abs(steps[-1]["critic/value_mean"] - steps[-1]["reward"]) < abs(
        steps[0]["critic/value_mean"] - steps[0]["reward"]
    )

    # resume from step 4 (the newest checkpoint removed): step 5 again, the same to the bit
    shutil.rmtree(tmp_path / "ckpt" / "step_000005")
    again = run_job(tmp_path, *DEFER, "--resume")[1]
    assert [s["step"] for s in again] == [1, 2, 3, 4, 5]
    critic = [k for k in steps[4] if k.startswith("critic/") and k != "critic/step_s"]  # a time
    same = ["reward", "loss", "grad_norm", *critic]
    assert {k: again[4][k] for k in same} == {k: steps[4][k] for k in same}


# decoupled with the critic on a rank of its own (critic.ranks=own): the trainer (DP 2) on ranks
# 0-1, the value model on rank 2, the rollout engine on rank 3; the critic's step is posted
# before the policy's and both train at once, two mini-batches each step.
OWN = [
    "critic.ranks=own",
    "critic.mini_batches=2",  # both steps' shards in one transfer (CriticTrainSteps)
    "cluster.nproc_per_node=4",
    "algorithm.num_steps=3",
    GREEDY,
]


def test_a_critic_on_ranks_of_its_own_trains_beside_the_policy_and_resumes_exactly(tmp_path):
    ckpt = tmp_path / "ckpt"
    steps = run_job(tmp_path, *OWN)[1]
    assert len(steps) == 3
    for s in steps:
        assert math.isfinite(s["critic/value_loss"]) and s["critic/grad_norm"] > 0, s
        assert math.isfinite(s["critic/explained_variance"]) and s["grad_norm"] > 0, s
        # a critic step ran while the policy's did, by the order of the job's event tickets
        # (no clock: the count's logic is tests/rl/test_gae.py's)
        assert s["critic/overlapped_steps"] >= 1, s
    # the value model lives on rank 2 alone: its log shows its steps, the trainer's do not
    critic_log = (tmp_path / "rank2.log").read_text()
    assert "critic[tp0 dp0]" in critic_log and "critic step 6: value loss" in critic_log  # 3 x 2
    assert "critic step" not in (tmp_path / "rank1.log").read_text()
    newest = {f.name for f in (ckpt / "step_000003").iterdir()}
    assert {"critic_tp0_pp0.pt", "trainer_tp0_pp0.pt"} <= newest

    # resume from step 2 (the newest checkpoint removed): step 3 again, the same to the bit
    shutil.rmtree(ckpt / "step_000003")
    again = run_job(tmp_path, *OWN, "--resume")[1]
    assert [s["step"] for s in again] == [1, 2, 3]
    # times, and how the two steps' runs fell together: the machine's, not the model's
    timing = (
        "critic/step_s",
        "critic/overlap_s",
        "critic/overlap_fraction",
        "critic/overlapped_steps",
    )
    same = ["reward", "loss", "grad_norm"]
    same += [k for k in steps[2] if k.startswith("critic/") and k not in timing]
    assert {k: again[2][k] for k in same} == {k: steps[2][k] for k in same}
