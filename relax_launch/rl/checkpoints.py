"""When the RL loop saves a checkpoint, and how it stops on request (after saving one)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING

from relax_launch.runtime.console import operator_log
from relax_launch.runtime.stop import JobStopped, resume_command, write_end_record

if TYPE_CHECKING:
    from relax_launch.rl.loop import RLContext


def checkpoint_due(ctx: RLContext, step: int, num_steps: int) -> bool:
    every = ctx.checkpoint_every
    return step == num_steps or (every > 0 and step % every == 0)


def save_checkpoint(ctx: RLContext, step: int) -> None:
    """The trainer shards, then the controller's position, then the completion marker."""
    directory = ctx.checkpoints.prepare(step)
    ctx.session.save_trainer(str(directory))
    state = {
        "step": step,
        "prompts": dataclasses.asdict(ctx.trained_cursor),
        "skipped_prompts": ctx.skipped_prompts,
    }
    ctx.checkpoints.complete(step, state)
    operator_log().info(f"relax-launch: checkpoint of step {step} in {directory}")


def stop_job(ctx: RLContext, reason: str, done: int, num_steps: int, log_dir: Path) -> None:
    """After a stop request: the checkpoint of the last finished step (unless saved already),
    the end record, and the command that resumes; raises ``JobStopped``."""
    checkpoint = None
    if ctx.checkpoints is not None:
        newest = ctx.checkpoints.newest()
        if newest is None or newest[0] != done:
            if done > 0:
                save_checkpoint(ctx, done)
        newest = ctx.checkpoints.newest()
        checkpoint = str(newest[1]) if newest is not None else None
    resume = resume_command() if checkpoint else None
    write_end_record(log_dir, "stopped", reason, step=done, checkpoint=checkpoint, resume=resume)
    where = (
        f"checkpoint {checkpoint}; resume with: {resume}"
        if checkpoint
        else (
            "no checkpoint (checkpoint.dir is unset)"
            if ctx.checkpoints is None
            else "no checkpoint"
        )
    )
    operator_log().warning(
        f"relax-launch: stopped by {reason} after step {done} of {num_steps}; {where}"
    )
    raise JobStopped(reason, done)
