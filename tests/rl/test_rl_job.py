"""A short real RL job through ``relax-launch run``: tiny Llama policy, rollout, teacher and GenRM
engines; metrics written, weights synced every step, teacher and judge served by the gateway."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e
CONFIG = Path(__file__).parent / "three_roles_tiny.yaml"


def test_rl_job_runs_three_roles_and_syncs_every_step(tmp_path):
    cli = Path(sys.executable).with_name("relax-launch")
    result = subprocess.run(
        [str(cli), "run", str(CONFIG), f"logging.dir={tmp_path}"],
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
        assert s["reward/judge/failed"] == 4  # the random judge writes no score: counted
        assert "reverse_kl" in s and s["time/step"] > 0
    # Teacher = initial policy: at step 1 the engines' logprobs (raw, not temperature-scaled,
    # though sampling used 0.7) equal the teacher's, so the reverse KL starts at zero.
    assert abs(steps[0]["reverse_kl"]) < 1e-3
    assert (tmp_path / "curves.png").stat().st_size > 0
    assert "finished 3 steps" in result.stdout
    # every rank's lines carry its rank and roles
    assert "[rank 0 trainer[tp0 pp0 dp0]] relax-launch: [" in result.stdout
    gateway = (tmp_path / "gateway_metrics.txt").read_text()
    for role, requests in (("teacher", 12), ("genrm", 12), ("rollout", 12)):
        labels = f'role="{role}",endpoint="generate",model="tiny-llama",status="200"'
        assert f"relax_gateway_requests_total{{{labels}}} {requests}" in gateway, gateway


def test_off_policy_job_with_kl_to_the_initial_policy(tmp_path):
    cli = Path(sys.executable).with_name("relax-launch")
    config = Path(__file__).parent / "off_policy_kl_tiny.yaml"
    result = subprocess.run(
        [str(cli), "run", str(config), f"logging.dir={tmp_path}"],
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parent)},  # the reward's module
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    steps = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    # step k+1's samples were generated with step k's weights, while step k trained
    assert [s["weight_version"] for s in steps] == [0, 0, 1]
    assert [s["staleness"] for s in steps] == [0, 1, 1]
    assert [s["samples_stale"] for s in steps] == [0, 0, 0]
    assert "time/wait" in steps[0] and "time/wait" not in steps[-1]
    # the policy starts as the reference: no KL; after two updates at lr 1e-2 it has moved (the
    # even-token share of 4 samples x 8 tokens differs within a group, so there is a gradient)
    assert steps[0]["kl_ref"] == pytest.approx(0.0, abs=1e-6)
    assert steps[-1]["kl_ref"] > 1e-4
    assert "stale 1" in result.stdout and "KL-ref" in result.stdout
