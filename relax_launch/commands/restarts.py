"""A failed job starts again by itself from its newest checkpoint (``cluster.max_restarts``).

Whoever started the job (``relax-launch run``'s loop; an sbatch script's, through
``commands/supervise.py``) asks ``decide`` once the job has ended in failure and every
one of its processes is gone: what died, the newest checkpoint this run can resume from, and the
restarts so far (``restarts.jsonl`` in the run directory) give a restart, or the reason there is
none, which the last line carries. Never restarted: a job that failed before its first
checkpoint, one that failed the same way with no newer checkpoint since its last restart (it
would only fail again), and one out of restarts for the window. A stop (the ``STOP`` file, a
signal) ends a job as stopped, not failed: it is never restarted either.

Each restart is one row of ``restarts.jsonl``: what died, the step it had finished, the step it
resumes from, and what it cost: the steps run since that checkpoint (``redo_s``) and, once the
restarted job is up, its start-up (``startup_s``; ``lost_s`` is their sum).
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from relax_launch.config.job import JobConfig
from relax_launch.rl.checkpoints import COMPLETE, Checkpoints
from relax_launch.run_dir import RESUME_KEY, STOP_FILE, read_json

RESTARTS_FILE = "restarts.jsonl"
_RUN_SPECIFIC = re.compile(r" \((?:process|pid) \d+\)|\b\d+(?:\.\d+)? s\b")


@dataclass(frozen=True)
class Death:
    """How a job failed: ``cause`` as its last line names it, when, after which step."""

    cause: str
    exit_code: int
    at: float  # time.time()
    last_step: int  # the last step it finished (0: none)


@dataclass(frozen=True)
class Decision:
    """A restart from the checkpoint of ``step``, or none, and why (``reason``)."""

    restart: bool
    reason: str
    step: int | None = None


def decide(
    death: Death,
    checkpoint: int | None,
    history: list[dict[str, Any]],
    max_restarts: int,
    window_s: float,
) -> Decision:
    """Whether a job that died as ``death`` starts again from ``checkpoint`` (the step of the
    newest checkpoint it can resume from, None for none) after the restarts of ``history``
    (``restarts.jsonl``'s rows, oldest first), at most ``max_restarts`` within ``window_s``."""
    if max_restarts == 0:
        return Decision(False, "cluster.max_restarts is 0")
    if checkpoint is None:
        return Decision(False, "it failed before its first checkpoint")
    last = history[-1] if history else None
    same = last is not None and failure_kind(last["cause"]) == failure_kind(death.cause)
    if last is not None and same and last["resumed_step"] == checkpoint:
        return Decision(
            False,
            f"the same failure again with no newer checkpoint than step {checkpoint} since "
            f"restart {last['restart']}: it would only fail again",
        )
    recent = [row for row in history if row["time"] >= death.at - window_s]
    if len(recent) >= max_restarts:
        return Decision(
            False,
            f"{len(recent)} restarts within cluster.restart_window_s={window_s:g} s already "
            f"(cluster.max_restarts={max_restarts})",
        )
    return Decision(True, f"restart {len(recent) + 1} of {max_restarts}", checkpoint)


def failure_kind(cause: str) -> str:
    """A cause without what differs from run to run of the same failure (process ids, seconds:
    ``rank 1 (...) died (process 19474)``)."""
    return _RUN_SPECIFIC.sub("", cause)


class Restarts:
    """The restarts of one run: its history, its newest usable checkpoint, its records."""

    def __init__(self, job: JobConfig, began: float) -> None:
        self.job, self.began = job, began
        self.path = job.log_dir / RESTARTS_FILE
        self.resumed = job.checkpoint.resume  # then the checkpoint it resumed from counts too

    def history(self) -> list[dict[str, Any]]:
        text = self.path.read_text() if self.path.is_file() else ""
        return [json.loads(line) for line in text.splitlines() if line.strip()]

    def checkpoint(self) -> tuple[int, Path] | None:
        """The newest complete checkpoint, if a resume of this run may take it: written since
        this run began, or this run was itself a resume (a fresh run ignores older ones)."""
        newest = Checkpoints(self.job.checkpoint_dir, self.job.checkpoint.keep_last).newest()
        if newest is None:
            return None
        written = (newest[1] / COMPLETE).stat().st_mtime
        return newest if self.resumed or written >= self.began else None

    def decide(self, cause: str, exit_code: int) -> Decision:
        """Restart or not after a failure (``decide``); a stop asked meanwhile is never
        restarted. A restart is recorded in ``restarts.jsonl`` before this returns."""
        stop = self.job.log_dir / STOP_FILE
        if stop.is_file():
            asked = stop.read_text().strip() or "the STOP file"
            return Decision(False, f"a stop was asked ({asked})")
        checkpoint = self.checkpoint()
        death = Death(cause, exit_code, time.time(), last_step(self.job.log_dir))
        history = self.history()
        cluster = self.job.cluster
        step = checkpoint[0] if checkpoint else None
        decision = decide(death, step, history, cluster.max_restarts, cluster.restart_window_s)
        if decision.restart and checkpoint is not None:
            self._record(death, checkpoint, len(history) + 1)
        return decision

    def _record(self, death: Death, checkpoint: tuple[int, Path], number: int) -> None:
        step, directory = checkpoint
        row = {
            "restart": number,
            "time": death.at,
            "cause": death.cause,
            "exit_code": death.exit_code,
            "died_after_step": death.last_step,
            "resumed_step": step,
            "checkpoint": str(directory),
            "steps_redone": max(0, death.last_step - step),
            "redo_s": round(max(0.0, death.at - (directory / COMPLETE).stat().st_mtime), 1),
        }
        with self.path.open("a") as out:
            out.write(json.dumps(row) + "\n")
        self.resumed = True  # the restarted run resumes from it

    def started_up(self) -> dict[str, Any] | None:
        """After a restarted job ended: its start-up (``startup.json``) added to the newest
        row; that row, or None when the job never came up or was no restart."""
        rows, path = self.history(), self.job.log_dir / "startup.json"
        if not rows or "startup_s" in rows[-1] or rows[-1]["time"] < self.began:
            return None
        report = read_json(path)
        if report is None or path.stat().st_mtime < rows[-1]["time"]:  # up before it died
            return None
        rows[-1]["startup_s"] = round(report["up_s"], 1)
        rows[-1]["lost_s"] = round(rows[-1]["redo_s"] + report["up_s"], 1)
        self.path.write_text("".join(json.dumps(row) + "\n" for row in rows))
        return rows[-1]


def last_step(log_dir: Path) -> int:
    """The last step in the run's ``metrics.jsonl`` (0: none yet)."""
    path = log_dir / "metrics.jsonl"
    step = 0
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            step = int(json.loads(line)["step"])
        except (ValueError, KeyError, TypeError):
            continue  # a line cut short by the death
    return step


def restart_line(cause: str, decision: Decision, job: JobConfig) -> str:
    """The console's one line announcing a restart."""
    return (
        f"relax-launch: {cause}; restarting the job from the checkpoint of step {decision.step} "
        f"({decision.reason} within {job.cluster.restart_window_s:g} s; "
        f"{job.log_dir / RESTARTS_FILE})"
    )


def restart_cost(row: dict[str, Any]) -> str:
    """The console's line on what a restart (a row of ``restarts.jsonl``) cost."""
    return (
        f"relax-launch: restart {row['restart']} cost {row['lost_s']:.1f} s: "
        f"{row['steps_redone']} steps run again since the checkpoint of step "
        f"{row['resumed_step']} ({row['redo_s']:.1f} s) + start-up {row['startup_s']:.1f} s"
    )


def resume_args(args: list[str]) -> list[str]:
    """The job's ``CONFIG [key=value ...]`` continuing from its newest checkpoint."""
    return [a for a in args if not a.startswith(RESUME_KEY)] + [f"{RESUME_KEY}true"]
