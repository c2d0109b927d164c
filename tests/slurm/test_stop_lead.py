"""How early Slurm's time-limit warning comes (``--signal=B:USR1@N``): early enough for the
train step or sync in flight and a checkpoint write, measured in the job's earlier runs; stated
(cluster.stop_lead_s), or a default by device for a job that has not written a checkpoint yet.
Renders scripts only: no Slurm needed."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from relax_launch.commands.sbatch import SbatchOptions, newest_metrics, render, stop_lead
from relax_launch.config import ConfigError, load_config
from relax_launch.placement import plan as place

ROOT = Path(__file__).resolve().parents[2]
GPU_CONFIG = ROOT / "configs/qwen3_8b_decoupled_2x8.yaml"
CPU_CONFIG = ROOT / "configs/quickstart_cpu.yaml"


def job_in(tmp_path: Path, config: Path = GPU_CONFIG, *overrides: str):
    return load_config(config, (f"logging.dir={tmp_path}", *overrides))


def write_run(directory: Path, rows: list[dict], mtime: float | None = None) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 9, "time/tr')
    if mtime is not None:
        os.utime(path, (mtime, mtime))
    return path


def signal_of(job) -> int:
    script = render(job, place(job), "job.yaml", (), SbatchOptions(), "python")
    (line,) = [x for x in script.splitlines() if x.startswith("#SBATCH --signal=")]
    return int(line.rsplit("@", 1)[1])


def test_the_lead_covers_the_measured_step_in_flight_and_checkpoint(tmp_path):
    """A GPU job whose last run trained 200 s, synced 40 s and wrote a 300 s checkpoint is
    warned 1.5 x 540 + 30 = 840 s ahead, not 120 s (a cut line at the end is skipped)."""
    write_run(tmp_path / "job-7", [{"time/train": 150.0, "time/sync": 30.0}], mtime=1_000)
    write_run(
        tmp_path / "job-8",
        [
            {"time/train": 200.0, "time/sync": 40.0, "time/rollout": 900.0},  # abandoned
            {"time/train": 120.0, "time/sync": 40.0, "time/checkpoint": 300.0},
        ],
        mtime=2_000,
    )
    job = job_in(tmp_path)
    assert newest_metrics(tmp_path) == tmp_path / "job-8" / "metrics.jsonl"
    assert signal_of(job) == 840
    assert "checkpoint 300 s" in stop_lead(job, newest_metrics(tmp_path)).why


def test_colocated_memory_moves_count_as_in_flight(tmp_path):
    rows = [{"time/train": 60.0, "time/onload_trainer": 20.0, "time/checkpoint": 40.0}]
    write_run(tmp_path, rows)  # relax-launch run's run directory is logging.dir itself
    assert signal_of(job_in(tmp_path, CPU_CONFIG)) == 210  # 1.5 x 120 + 30


def test_a_short_measured_stop_keeps_the_minimum(tmp_path):
    write_run(tmp_path / "job-1", [{"time/train": 2.0, "time/sync": 1.0, "time/checkpoint": 3.0}])
    assert signal_of(job_in(tmp_path, CPU_CONFIG)) == 120


def test_a_job_with_no_checkpoint_measured_takes_its_devices_default(tmp_path):
    write_run(tmp_path / "job-1", [{"time/train": 500.0, "time/sync": 40.0}])  # no checkpoint
    assert signal_of(job_in(tmp_path, CPU_CONFIG)) == 120  # CPU jobs: as before
    gpu = job_in(tmp_path)
    assert signal_of(gpu) == 600
    assert "no checkpoint write measured yet (cuda job)" in stop_lead(gpu, None).why


def test_a_stated_lead_wins_and_a_too_short_one_is_refused(tmp_path):
    write_run(tmp_path, [{"time/train": 600.0, "time/checkpoint": 600.0}])
    assert signal_of(job_in(tmp_path, GPU_CONFIG, "cluster.stop_lead_s=900")) == 900
    with pytest.raises(ConfigError, match="cluster.stop_lead_s"):
        job_in(tmp_path, GPU_CONFIG, "cluster.stop_lead_s=30")
