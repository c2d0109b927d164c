"""A short real RL job through ``relax-launch run``: tiny Llama policy, rollout, teacher and GenRM
engines; metrics written, weights synced every step, every role's engines reached in process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from prometheus_text import total

pytestmark = pytest.mark.e2e
CONFIG = Path(__file__).parent / "three_roles_tiny.yaml"


def test_rl_job_runs_three_roles_and_syncs_every_step(tmp_path):
    cli = Path(sys.executable).with_name("relax-launch")
    result = subprocess.run(
        [str(cli), "run", str(CONFIG), f"logging.dir={tmp_path}", "logging.level=warning"],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    steps = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2, 3]
    # samples of step k come from the weights synced after step k-1 (version 0 = initial sync)
    assert [s["weight_version"] for s in steps] == [0, 1, 2]
    for s in steps:
        assert {"reward", "reward/answer", "reward/judge", "loss", "grad_norm"} <= set(s)
        # every reply of the random judge, decoded under the score regex, parsed into a reward
        assert s["reward/judge/failed"] == 0 and 0.0 <= s["reward/judge"] <= 1.0
        assert "reverse_kl" in s and s["time/step"] > 0
    # Teacher = initial policy: at step 1 the engines' logprobs (raw, not temperature-scaled,
    # though sampling used 0.7) equal the teacher's, so the reverse KL starts at zero.
    assert abs(steps[0]["reverse_kl"]) < 1e-3
    assert (tmp_path / "curves.png").stat().st_size > 0
    assert "finished 3 steps" in result.stdout
    assert_calm_console(result, tmp_path, ranks=4, steps=3)
    # where start-up went: every rank's phases, and the job waited on the last one to finish
    startup = json.loads((tmp_path / "startup.json").read_text())
    assert sorted(startup["ranks"]) == ["0", "1", "2", "3"]
    ends = [p["end_s"] for r in startup["ranks"].values() for p in r["phases"]]
    assert startup["up_s"] == max(ends) and startup["critical"]["end_s"] <= startup["up_s"]
    assert any(p["phase"] == "trainer built" for p in startup["ranks"]["0"]["phases"])
    assert "up in " in result.stdout and "waited on rank" in result.stdout
    # logging.level=warning holds on every rank: only the operator's lines are below it
    for rank in range(4):
        text = (tmp_path / f"rank{rank}.log").read_text()
        assert not [
            x for x in text.splitlines() if " INFO " in x and "relax_launch.console" not in x
        ]
    # every role's engines took the loop's requests from the controller, in process: each one
    # counted by the control plane, none by the gateway (the door for external clients)
    counted = (tmp_path / "gateway_metrics.txt").read_text()
    for role, requests in (("teacher", 12), ("genrm", 12), ("rollout", 12)):
        ok = {"role": role, "endpoint": "generate", "model": "tiny-llama", "status": "200"}
        assert total(counted, "relax_controller_requests_total", **ok) == requests, counted
        assert total(counted, "relax_controller_requests_total", role=role) == requests, counted
        assert total(counted, "relax_gateway_requests_total", role=role) == 0, counted


def test_off_policy_job_with_kl_to_the_initial_policy(tmp_path):
    """Also: a trainer with PP=2 syncs each step into two rollout engines (its stages' broadcast
    groups each span both engines, so they must not send at once)."""
    config = Path(__file__).parent / "off_policy_kl_tiny.yaml"
    two_engines = ["cluster.nproc_per_node=4", "rollout.ranks=2"]
    result = run_tiny(config, f"logging.dir={tmp_path}", *two_engines)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    steps = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    # step k+1's samples were generated with step k's weights, while step k trained
    assert [s["weight_version"] for s in steps] == [0, 0, 1]
    assert [s["staleness"] for s in steps] == [0, 1, 1]
    assert [s["samples_stale"] for s in steps] == [0, 0, 0]
    assert "time/wait" in steps[0] and "time/wait" not in steps[-1]
    # the policy starts as the reference: no KL; after two updates at lr 1e-2 it has moved (the
    # alternating reward gives every group signal, so every step has a gradient)
    assert steps[0]["kl_ref"] == pytest.approx(0.0, abs=1e-6)
    assert steps[-1]["kl_ref"] > 1e-4
    # off-policy turns the token-level correction on: step 1's samples come from the trainer's
    # own weights (no mismatch), later ones from the weights one step older
    assert "rollout_correction=auto" in result.stdout
    assert steps[0]["mismatch_kl"] < 1e-4 and steps[0]["is_ratio_max"] == pytest.approx(1, abs=0.02)
    assert steps[-1]["mismatch_kl"] > 10 * steps[0]["mismatch_kl"]
    assert "stale 1" in result.stdout and "KL-ref" in result.stdout
    assert "rollout x2" in result.stdout
    assert_calm_console(result, tmp_path, ranks=4, steps=3)
    # the default logging.level=info: the ranks log at INFO
    assert "INFO [rank 0 " in (tmp_path / "rank0.log").read_text()


def assert_calm_console(result, log_dir: Path, ranks: int, steps: int) -> None:
    """The console has the plan, one line per step and the summary; what libraries print is in
    the ranks' own logs."""
    lines = result.stdout.splitlines()
    progress = [x for x in lines if x.startswith("relax-launch: step ")]
    assert len(progress) == steps and progress[-1].endswith("ETA 0:00"), progress
    assert len(lines) <= 20 + steps, result.stdout
    assert not [x for x in lines if "warn" in x.lower() or x.startswith("[rank")], result.stdout
    assert result.stderr == ""
    assert sorted(p.name for p in log_dir.glob("rank*.log")) == [
        f"rank{r}.log" for r in range(ranks)
    ]
    # the ranks' library noise (Megatron's UserWarnings on the trainer rank) is in its log
    assert "py.warnings" in (log_dir / "rank0.log").read_text()


def run_tiny(config: Path, *overrides: str) -> subprocess.CompletedProcess:
    cli = Path(sys.executable).with_name("relax-launch")
    return subprocess.run(
        [str(cli), "run", str(config), *overrides],
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parent)},  # the reward's module
    )


@pytest.mark.slow
def test_checkpoints_and_resume_continue_the_run(tmp_path):
    config = Path(__file__).parent / "off_policy_kl_tiny.yaml"
    ckpt = tmp_path / "ckpt"
    common = [f"logging.dir={tmp_path}", f"checkpoint.dir={ckpt}", "checkpoint.every_steps=1"]
    first = run_tiny(config, *common, "algorithm.num_steps=3")
    assert first.returncode == 0, first.stdout[-4000:] + first.stderr[-2000:]
    before = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert sorted(d.name for d in ckpt.iterdir()) == ["step_000002", "step_000003"]  # keep_last
    step2 = ckpt / "step_000002"
    assert sorted(f.name for f in step2.iterdir()) == [
        "COMPLETE", "controller.json", "trainer_tp0_pp0.pt", "trainer_tp0_pp1.pt",
    ]  # fmt: skip
    # Off-policy: step 3's prompts were drawn while step 2 trained, yet the checkpoint of step
    # 2 points right after step 2's prompts, so a resume from it draws step 3's prompts again.
    assert json.loads((step2 / "controller.json").read_text())["prompts"]["seen"] == 4

    second = run_tiny(config, *common, "algorithm.num_steps=4", "--resume")
    assert second.returncode == 0, second.stdout[-4000:] + second.stderr[-2000:]
    assert "step 3, trainer at optimizer step 3, prompt 6" in second.stdout
    rows = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert rows[:3] == before  # the first run's steps are kept
    last = json.loads(rows[3])
    assert last["step"] == 4
    assert last["weight_version"] == 3 and last["staleness"] == 0  # synced from the checkpoint
    # the reference is the initial model, the policy the checkpoint: they differ from the start
    assert last["kl_ref"] > 1e-4
    assert sorted(d.name for d in ckpt.iterdir()) == ["step_000003", "step_000004"]
    assert "finished 4 steps" in second.stdout
