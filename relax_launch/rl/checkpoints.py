"""Checkpoints of a run: where they go and how they are laid out, when the loop saves one, and
how a stop saves the last finished step.

Layout under ``checkpoint.dir`` (unset: the run directory's ``checkpoints/``, written only on a
stop)::

    step_000012/trainer_tp0_pp0.pt   model + optimizer of one shard (written by its DP-0 rank;
                                     LoRA: the adapters and their optimizer state; with
                                     expert parallelism, _epE for EP ranks past 0)
    step_000012/controller.json      RL step, prompt cursor, counters (written by rank 0)
    step_000012/model.json, model/   base model, trainer section; its config and tokenizer
    step_000012/COMPLETE             written last: a directory without it is ignored

A crash while saving leaves an incomplete directory that resume skips and ``keep_last`` does not
count. Every file is written durably (``write_durably``: written under a temporary name, fsynced,
renamed, the directory fsynced), and the marker only after them all, so a checkpoint marked
complete survives a power loss or a node that dies right after. The trainer ranks write their
shards themselves (``Trainer.save``, through the job), rank 0 writes the rest.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from relax_launch.console import operator_log
from relax_launch.rl.data import PromptCursor
from relax_launch.rl.interfaces import JobStopped

if TYPE_CHECKING:
    from relax_launch.rl.context import RLContext

log = logging.getLogger(__name__)

COMPLETE = "COMPLETE"
CONTROLLER = "controller.json"


class Checkpoints:
    """The checkpoint directory of one run: where a step goes, what is newest, what to prune."""

    def __init__(self, directory: Path, keep_last: int) -> None:
        self.directory, self.keep_last = directory, keep_last

    def step_dir(self, step: int) -> Path:
        return self.directory / f"step_{step:06d}"

    def complete_steps(self) -> list[tuple[int, Path]]:
        """Every complete checkpoint (step, directory), oldest first."""
        return sorted(
            (int(d.name[5:]), d)
            for d in self.directory.glob("step_*")
            if d.name[5:].isdigit() and (d / COMPLETE).is_file()
        )

    def newest(self) -> tuple[int, Path] | None:
        """The newest complete checkpoint (step, directory), or None."""
        complete = self.complete_steps()
        return complete[-1] if complete else None

    def prepare(self, step: int) -> Path:
        """An empty directory for ``step`` (a leftover incomplete one is cleared)."""
        target = self.step_dir(step)
        if target.exists():
            shutil.rmtree(target)
        target.mkdir(parents=True)
        return target

    def complete(self, step: int, controller: dict[str, Any]) -> Path:
        """Write the controller's state and the marker, then drop the complete checkpoints
        beyond ``keep_last`` (0 keeps all) and the incomplete ones older than this one."""
        target = self.step_dir(step)
        write_durably(target / CONTROLLER, json.dumps(controller, indent=1).encode())
        write_durably(target / COMPLETE, str(step).encode())  # its directory fsync covers the
        # trainer shards' renames too (each shard's data was fsynced by the rank that wrote it)
        complete = self.complete_steps()
        dropped = complete[: -self.keep_last] if self.keep_last else []
        for _, directory in dropped:
            shutil.rmtree(directory, ignore_errors=True)
        for d in self.directory.glob("step_*"):  # left by a crash while saving
            if d.name[5:].isdigit() and int(d.name[5:]) < step and not (d / COMPLETE).exists():
                shutil.rmtree(d, ignore_errors=True)
        return target

    @staticmethod
    def controller_state(directory: Path) -> dict[str, Any]:
        return json.loads((directory / CONTROLLER).read_text())


def write_durably(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path``: all of it or nothing, and on disk before this returns (fsync
    of the file, then of its directory after the rename)."""
    partial = path.with_name(path.name + ".partial")
    with open(partial, "wb") as file:
        file.write(data)
        file.flush()
        os.fsync(file.fileno())
    os.replace(partial, path)
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


def checkpoint_due(ctx: RLContext, step: int, num_steps: int) -> bool:
    """Whether ``step`` is saved as it ends: every ``checkpoint.every_steps`` and the last step,
    once ``checkpoint.dir`` is set (unset, only a stop saves)."""
    every = ctx.checkpoint_every
    if every is None:
        return False
    return step == num_steps or (every > 0 and step % every == 0)


def save_checkpoint(ctx: RLContext, step: int, cursor: PromptCursor) -> None:
    """The trainer shards, then the controller's position (``cursor``: right after the prompts
    of the last trained batch), then the completion marker. A failure is told to
    ``logging.notify`` before it is raised."""
    directory = ctx.checkpoints.prepare(step)
    try:
        ctx.job.save_trainer(str(directory))
        if ctx.exports is not None:  # what `relax-launch export` needs to convert it
            ctx.exports.describe(directory)
        state = {
            "step": step,
            "prompts": dataclasses.asdict(cursor),
            "skipped_prompts": ctx.feed.skipped,
        }
        ctx.checkpoints.complete(step, state)
    except Exception as exc:
        if ctx.notifier is not None:
            ctx.notifier.send("checkpoint failed", f"step {step} in {directory}: {exc}")
        raise
    operator_log().info(f"relax-launch: checkpoint of step {step} in {directory}")


def stop_job(ctx: RLContext, reason: str, done: int, num_steps: int, cursor: PromptCursor) -> None:
    """After a stop request: the checkpoint of the last finished step (unless saved already);
    raises ``JobStopped`` naming the newest checkpoint (the job reports the end)."""
    newest = ctx.checkpoints.newest()
    if done > 0 and (newest is None or newest[0] != done):
        try:
            save_checkpoint(ctx, done, cursor)
        except Exception:  # noqa: BLE001 - the newest one left is what a resume takes
            log.exception("relax-launch: the stop's checkpoint failed")
            operator_log().error(
                f"relax-launch: the checkpoint of step {done} failed (its rank's log says why);"
                " the steps since the newest checkpoint are lost"
            )
        newest = ctx.checkpoints.newest()
    checkpoint = str(newest[1]) if newest is not None else None
    raise JobStopped(reason, done, num_steps, checkpoint)
