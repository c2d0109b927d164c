"""``relax-launch sbatch`` on a real one-node Slurm: the quickstart runs to its end with the
job's exit code, console and metrics; a cancelled job leaves no process and a checkpoint that
the next submission of the same command resumes from.

Marked ``slurm`` (a few minutes; it installs Debian's Slurm if missing): ``bash scripts/test.sh
-m slurm``. Timings are printed (``-s``) for the closing notes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from harness.processes import TEST_TAG, processes_tagged

from .cluster import LocalSlurm

pytestmark = pytest.mark.slurm
REPO = Path(__file__).resolve().parents[2]
LIFECYCLE = REPO / "tests/runtime/lifecycle_tiny.yaml"


def sbatch(slurm: LocalSlurm, *args: str) -> int:
    cli = Path(sys.executable).with_name("relax-launch")
    result = subprocess.run(
        [str(cli), "sbatch", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=slurm.env,
        cwd=REPO,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return int(result.stdout.split()[2].rstrip(":"))  # "submitted job 12: ..."


def wait_for_steps(run_dir: Path, steps: int, job: int, slurm: LocalSlurm, timeout_s: float):
    metrics, deadline = run_dir / "metrics.jsonl", time.monotonic() + timeout_s
    while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= steps):
        assert slurm.state(job) in ("PENDING", "RUNNING", "CONFIGURING"), slurm.show_job(job)
        assert time.monotonic() < deadline, f"job {job}: no {steps} steps in {timeout_s} s"
        time.sleep(0.5)


def test_quickstart_runs_to_the_end_under_sbatch(slurm, tmp_path):
    began = time.monotonic()
    job = sbatch(
        slurm, "configs/quickstart_cpu.yaml", "algorithm.num_steps=2", f"logging.dir={tmp_path}"
    )
    run_dir = tmp_path / f"job-{job}"
    wait_for_steps(run_dir, 1, job, slurm, 600)
    first_step = time.monotonic() - began
    assert slurm.wait(job, 600) == "COMPLETED", slurm.show_job(job)
    ended = time.monotonic() - began
    assert slurm.exit_code(job) == 0
    console = (tmp_path / f"slurm-{job}.out").read_text()
    assert "relax-launch: job is up" in console and "finished 2 steps" in console
    steps = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2] and all("reward" in s for s in steps)
    assert json.loads((run_dir / "end.json").read_text())["state"] == "completed"
    assert sorted(p.name for p in run_dir.glob("rank*.log")) == [f"rank{r}.log" for r in range(4)]
    print(f"\nsbatch quickstart 2 steps: first step at {first_step:.1f} s, exit at {ended:.1f} s")


def test_scancel_leaves_a_checkpoint_and_the_same_command_resumes(slurm, tmp_path):
    args = [str(LIFECYCLE), f"logging.dir={tmp_path}", f"checkpoint.dir={tmp_path / 'ck'}"]
    job = sbatch(slurm, *args)
    run_dir = tmp_path / f"job-{job}"
    wait_for_steps(run_dir, 3, job, slurm, 600)
    cancelled = time.monotonic()
    slurm.scancel(job)
    assert slurm.wait(job, 60) == "CANCELLED"
    tag = os.environ[TEST_TAG]
    while processes_tagged(tag) and time.monotonic() - cancelled < 60:
        time.sleep(0.2)
    gone = time.monotonic() - cancelled
    assert not processes_tagged(tag), [p.cmdline() for p in processes_tagged(tag)]
    end = json.loads((run_dir / "end.json").read_text())
    assert end["state"] == "stopped" and (Path(end["checkpoint"]) / "COMPLETE").is_file(), end
    done = end["step"]
    # the same submission (checkpoint.resume=true is in its script) continues at the next step
    again = sbatch(slurm, *args, f"algorithm.num_steps={done + 2}")
    assert slurm.wait(again, 600) == "COMPLETED", slurm.show_job(again)
    rows = (tmp_path / f"job-{again}" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(row)["step"] for row in rows] == [done + 1, done + 2]
    assert f"resuming from {end['checkpoint']}" in (tmp_path / f"slurm-{again}.out").read_text()
    print(f"\nscancel after step {done}: every process gone in {gone:.1f} s")


def test_a_killed_rank_restarts_the_job_within_its_allocation(slurm, tmp_path):
    """cluster.max_restarts under Slurm: rank 1 SIGKILLed after step 3's checkpoint; the
    script's loop asks commands/supervise.py, which restarts srun, and the job completes its 6
    steps from the checkpoint (exit 0), its restart in restarts.jsonl and slurm-<id>.out."""
    job = sbatch(
        slurm,
        str(LIFECYCLE),
        f"logging.dir={tmp_path}",
        f"checkpoint.dir={tmp_path / 'ck'}",
        "checkpoint.every_steps=1",
        "algorithm.num_steps=6",
        "cluster.max_restarts=1",
    )
    run_dir = tmp_path / f"job-{job}"
    wait_for_steps(run_dir, 3, job, slurm, 600)
    tag = os.environ[TEST_TAG]
    [rank1] = [
        p
        for p in processes_tagged(tag)
        if "relax_launch.launch" in " ".join(p.cmdline()) and p.environ().get("RANK") == "1"
    ]
    rank1.kill()
    assert slurm.wait(job, 600) == "COMPLETED", slurm.show_job(job)
    assert slurm.exit_code(job) == 0
    [record] = [json.loads(x) for x in (run_dir / "restarts.jsonl").read_text().splitlines()]
    assert record["cause"].startswith("rank 1 (rollout[e0 head], node 0) died"), record
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2, 3, 4, 5, 6]
    console = (tmp_path / f"slurm-{job}.out").read_text()
    assert f"restarting the job from the checkpoint of step {record['resumed_step']}" in console
    assert "finished 6 steps" in console
