"""When the RL loop saves a checkpoint, and how it stops on request (after saving one)."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import TYPE_CHECKING

from relax_launch.runtime.console import operator_log
from relax_launch.runtime.stop import JobStopped, resume_command, write_end_record

if TYPE_CHECKING:
    from relax_launch.rl.loop import RLContext

log = logging.getLogger(__name__)


def checkpoint_due(ctx: RLContext, step: int, num_steps: int) -> bool:
    """Whether ``step`` is saved as it ends: every ``checkpoint.every_steps`` and the last step,
    once ``checkpoint.dir`` is set (unset, only a stop saves)."""
    every = ctx.checkpoint_every
    if every is None:
        return False
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
    newest = ctx.checkpoints.newest()
    lost = ""
    if done > 0 and (newest is None or newest[0] != done):
        try:
            save_checkpoint(ctx, done)
        except Exception as exc:  # noqa: BLE001 - say what is lost, resume from what is there
            log.exception("relax-launch: the stop's checkpoint failed")
            lost = f"the checkpoint of step {done} failed ({type(exc).__name__}: {exc}); "
        newest = ctx.checkpoints.newest()
    checkpoint = str(newest[1]) if newest is not None else None
    resume = resume_command() if checkpoint else None
    write_end_record(log_dir, "stopped", reason, step=done, checkpoint=checkpoint, resume=resume)
    if checkpoint:
        where = f"{lost}checkpoint {checkpoint}; resume with: {resume}"
    else:
        where = f"{lost}no step finished, nothing to resume: run it again"
    operator_log().warning(
        f"relax-launch: stopped by {reason} after step {done} of {num_steps}; {where}"
    )
    raise JobStopped(reason, done)
