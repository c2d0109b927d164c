"""The one-node Slurm cluster of cluster.py does what later Slurm tests will rely on: a job's
failure and exit code come back, and scancel ends a running job with all its processes."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

from .cluster import LocalSlurm

pytestmark = pytest.mark.slurm

JOB_TIMEOUT_S = 30.0
CANCEL_TIMEOUT_S = 35.0  # KillWait=30 between SIGTERM and SIGKILL, plus a margin
PROCESS_TIMEOUT_S = 10.0


def processes_with(tag: str) -> list[psutil.Process]:
    """Live processes whose command line contains ``tag``."""
    found = []
    for process in psutil.process_iter():
        try:
            if process.status() != psutil.STATUS_ZOMBIE and tag in " ".join(process.cmdline()):
                found.append(process)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def wait_for(condition: Callable[[], object], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"{what} not within {timeout_s:.0f} s")
        time.sleep(0.2)


def test_a_failed_job_reports_its_exit_code(slurm: LocalSlurm, tmp_path: Path):
    failing = tmp_path / "fail.sh"
    failing.write_text("#!/bin/bash\nhostname\nexit 3\n")
    job = slurm.sbatch([f"--output={tmp_path / 'fail.out'}"], failing)
    assert slurm.wait(job, JOB_TIMEOUT_S) == "FAILED"
    assert slurm.exit_code(job) == 3
    assert (tmp_path / "fail.out").read_text().strip() == slurm.host


def test_scancel_ends_a_running_job_and_its_processes(slurm: LocalSlurm, tmp_path: Path):
    tag = f"relax-slurm-sleep-{uuid.uuid4().hex}"
    sleeper = tmp_path / "sleep.sh"
    sleeper.write_text(f'#!/bin/bash\n(exec -a "{tag}" sleep 60)\n')
    job = slurm.sbatch([f"--output={tmp_path / 'sleep.out'}"], sleeper)
    wait_for(lambda: slurm.state(job) == "RUNNING", JOB_TIMEOUT_S, f"job {job} RUNNING")
    wait_for(lambda: processes_with(tag), PROCESS_TIMEOUT_S, f"the sleep of job {job}")
    slurm.scancel(job)
    assert slurm.wait(job, CANCEL_TIMEOUT_S) == "CANCELLED"
    wait_for(lambda: not processes_with(tag), PROCESS_TIMEOUT_S, f"the end of job {job}'s sleep")
