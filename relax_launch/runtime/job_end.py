"""How a job ends, on rank 0: the run directory's end record (``run_dir.write_end_record``:
completed, failed or stopped, with the command that resumes) and the operator's last line."""

from __future__ import annotations

import os

from relax_launch.config.job import JobConfig
from relax_launch.console import operator_log
from relax_launch.rl.checkpoints import Checkpoints
from relax_launch.rl.interfaces import JobStopped
from relax_launch.run_dir import LAUNCHER_ENV, resume_command, write_end_record


def end_completed(job: JobConfig) -> None:
    """Rank 0, every step ran."""
    write_end_record(job.log_dir, "completed", "every step ran")


def end_in_failure(job: JobConfig, reason: str) -> None:
    """Rank 0: write why the job ends into the run's end record, and tell the operator, unless
    ``relax-launch run`` does (last, below the log that says why)."""
    write_end_record(job.log_dir, "failed", reason)
    if not os.environ.get(LAUNCHER_ENV):  # the rank's log has the reason already
        operator_log().error(f"relax-launch: job failed: {reason}")


def end_stopped(job: JobConfig, reason: str) -> None:
    """Rank 0, stopped before its first step: nothing new to save; a resumed run's checkpoint
    still resumes."""
    found = Checkpoints(job.checkpoint_dir, job.checkpoint.keep_last).newest()
    step, checkpoint = found if found is not None and job.checkpoint.resume else (0, None)
    resume = resume_command() if checkpoint else None
    write_end_record(
        job.log_dir,
        "stopped",
        reason,
        step=step,
        checkpoint=str(checkpoint or "") or None,
        resume=resume,
    )
    then = f"resume with: {resume}" if resume else "nothing to resume: run it again"
    operator_log().warning(f"relax-launch: {reason}; {then}")


def end_stopped_after_steps(job: JobConfig, stopped: JobStopped) -> None:
    """Rank 0, the program stopped on request: the end record and the operator's last line,
    with the command that resumes from the checkpoint it left."""
    resume = resume_command() if stopped.checkpoint else None
    write_end_record(
        job.log_dir,
        "stopped",
        stopped.reason,
        step=stopped.step,
        checkpoint=stopped.checkpoint,
        resume=resume,
    )
    if stopped.checkpoint:
        where = f"checkpoint {stopped.checkpoint}; resume with: {resume}"
    else:
        where = "no step finished, nothing to resume: run it again"
    operator_log().warning(
        f"relax-launch: stopped by {stopped.reason} after step {stopped.step} of "
        f"{stopped.total}; {where}"
    )
