"""The run around the RL steps on rank 0: a progress line per step, checkpoints when due,
evaluations, metrics to JSONL, a plot and a summary at the end; and a stop, which abandons the
step in flight at its next safe point and saves the last finished one.

The schedule (``rl/schedules.py``, ``rl/colocated.py``) is chosen once, by the program; the run
only calls its ``step``.
"""

from __future__ import annotations

import time
from pathlib import Path

from relax_launch.console import operator_log
from relax_launch.rl.checkpoints import checkpoint_due, save_checkpoint, stop_job
from relax_launch.rl.context import RLContext, StepResult
from relax_launch.rl.data import PromptCursor
from relax_launch.rl.evaluation import Evaluation
from relax_launch.rl.exports import export_policy
from relax_launch.rl.interfaces import StepAbandoned
from relax_launch.rl.phases import timed
from relax_launch.rl.report import StepProgress, is_eval_score
from relax_launch.rl.schedules import Schedule

STOP_NOTICE_S = 3.0  # a step that fails waits this long for a stop request that explains it
clock = time.perf_counter  # the step clock (a test steps it by hand)


def run(
    ctx: RLContext,
    schedule: Schedule,
    num_steps: int,
    log_dir: Path,
    start_step: int = 0,
    evaluation: Evaluation | None = None,
) -> list[dict[str, float]]:
    """Steps ``start_step`` to ``num_steps`` with a progress line each, checkpoints when due;
    metrics to JSONL, a plot and a summary (of the whole run, resumed or not) at the end;
    ``evaluation``, when given, runs between steps when due (a colocated schedule evaluates in
    turns of its own instead).

    Asked to stop (``ctx.job.stop``), it abandons the step in flight at its next safe point (its
    engine requests are cancelled at once), saves the last finished step and raises
    ``JobStopped``: what is abandoned and what finishes is ``runtime/stop.py``'s docstring.

    Step k's wall time runs from the end of step k-1's to its own end, so the steps tile the
    loop: logging and printing step k-1 is part of step k's ``time/other``.
    """
    history = list(ctx.log.history)
    stop = ctx.job.stop
    stop.listeners.append(announce_stop)
    stop.listeners.append(ctx.job.engines.cancel_all)  # a stop drops every generation in flight
    stop.stepping = True  # from now on a stop saves what the steps did
    try:
        if evaluation is not None and evaluation.config.before_training and start_step == 0:
            evaluate_start(ctx, evaluation, history)
        stopped, done, cursor = run_steps(ctx, schedule, num_steps, start_step, history, evaluation)
    finally:
        schedule.close()
    operator_log().info(ctx.log.finish(history, log_dir))
    if stopped is not None:
        stop_job(ctx, stopped, done, num_steps, cursor)
    return history


def announce_stop(reason: str) -> None:
    operator_log().warning(
        f"relax-launch: stopping ({reason}): the step in flight is abandoned unless it is "
        "training, then the last finished step is checkpointed"
    )


def stop_or_failure(ctx: RLContext, cause: BaseException | None = None) -> None:
    """A stop request that came with a failure (torchrun stops every rank when one dies) is the
    failure's consequence: raise the failure."""
    if failure := ctx.job.stop.failed():
        raise RuntimeError(f"the job failed: {failure}") from cause


def run_steps(
    ctx: RLContext,
    schedule: Schedule,
    num_steps: int,
    start_step: int,
    history: list[dict[str, float]],
    evaluation: Evaluation | None,
) -> tuple[str | None, int, PromptCursor]:
    """The steps; returns why they stopped early (None: they all ran), the steps done and the
    prompt position after the last trained batch."""
    progress = StepProgress(ctx.job.console, num_steps, start_step)
    cursor = ctx.feed.position()  # where a resumed run's first batch starts
    with progress:
        began = clock()
        for step in range(start_step, num_steps):
            if stopped := ctx.job.stop.requested():
                stop_or_failure(ctx)
                return stopped, step, cursor
            try:
                result = schedule.step(step)
            except StepAbandoned as abandoned:
                stop_or_failure(ctx, abandoned)
                operator_log().warning(f"relax-launch: step {step + 1} abandoned for the stop")
                return abandoned.reason, step, cursor
            except Exception as exc:
                if not (stopped := ctx.job.stop.requested(wait_s=STOP_NOTICE_S)):
                    raise
                stop_or_failure(ctx, exc)
                operator_log().warning(
                    f"relax-launch: step {step + 1} dropped ({type(exc).__name__}) by the stop"
                )
                return stopped, step, cursor
            cursor = result.cursor
            record(ctx, result, step, num_steps, evaluation)
            ended = clock()
            result.metrics |= step_times(result.seconds, ended - began)
            began = ended
            if ctx.control is not None:  # the next step's mask and routing replay
                result.metrics |= ctx.control.after_step(result.metrics)
            mismatch = ctx.guard.judge(result.metrics) if ctx.guard is not None else None
            history.append(result.metrics)
            ctx.log.write(result.metrics)
            progress.step(result.metrics)
            if mismatch is not None:  # the step is on record; the job ends on its cause
                raise mismatch
    return None, num_steps, cursor


def record(
    ctx: RLContext,
    result: StepResult,
    step: int,
    num_steps: int,
    evaluation: Evaluation | None,
) -> None:
    """What follows a step: its checkpoint and Hugging Face export when due, then its
    evaluation (between steps)."""
    if checkpoint_due(ctx, step + 1, num_steps):
        with timed(result.seconds, "checkpoint"):
            save_checkpoint(ctx, step + 1, result.cursor)
    if ctx.exports is not None and ctx.exports.due(step + 1, num_steps):
        with timed(result.seconds, "export"):
            export_policy(ctx, step + 1, result.metrics)
    if evaluation is not None and evaluation.due(step + 1, num_steps):
        try:
            with timed(result.seconds, "eval"), ctx.job.stop.abandonable():
                # the weights this step synced
                result.metrics |= evaluation.run(ctx.job.engines, ctx.rewards)
        except StepAbandoned:  # the step is done, its evaluation is not
            pass


def evaluate_start(ctx: RLContext, evaluation: Evaluation, history: list[dict[str, float]]) -> None:
    """``eval.before_training``: the starting weights' scores (the engines' first sync) as
    the step-0 row, so a run's eval curve starts where training did."""
    seconds: dict[str, float] = {}
    try:
        with timed(seconds, "eval"), ctx.job.stop.abandonable():
            scores = evaluation.run(ctx.job.engines, ctx.rewards)
    except StepAbandoned:  # stopped before the first step: nothing to record
        return
    row = {"step": 0, **scores, "time/eval": seconds["eval"]}
    history.append(row)
    ctx.log.write(row)
    operator_log().info(
        "relax-launch: eval before training | "
        + ", ".join(
            f"{k.removeprefix('eval/')} {v:.3f}" for k, v in scores.items() if is_eval_score(k)
        )
    )


def step_times(main_thread: dict[str, float], wall_s: float) -> dict[str, float]:
    """``time/step`` is the step's whole wall time; ``time/other`` what no main-thread phase
    covers (writing metrics and TensorBoard, the console, Python between phases)."""
    phases = {f"time/{k}": v for k, v in main_thread.items()}
    return phases | {"time/step": wall_s, "time/other": wall_s - sum(main_thread.values())}
