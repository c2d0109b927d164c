"""The run around the RL steps on rank 0: a progress line per step, checkpoints when due,
evaluations, metrics to JSONL, a plot and a summary at the end; and a stop, which abandons the
step in flight at its next safe point (``runtime/stop.py``) and saves the last finished one."""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from relax_launch.rl.checkpoints import checkpoint_due, save_checkpoint, stop_job
from relax_launch.rl.loop import RLContext, rl_step, timed
from relax_launch.rl.report import StepProgress
from relax_launch.runtime.console import operator_log
from relax_launch.runtime.stop import StepAbandoned

STOP_NOTICE_S = 3.0  # a step that fails waits this long for a stop request that explains it
clock = time.perf_counter  # the step clock (a test steps it by hand)


def run(
    ctx: RLContext,
    num_steps: int,
    log_dir: Path,
    start_step: int = 0,
    step_fn: Callable[[RLContext, int, int], dict[str, float]] = rl_step,
) -> list[dict[str, float]]:
    """Steps ``start_step`` to ``num_steps`` with a progress line each, checkpoints when due;
    metrics to JSONL, a plot and a summary (of the whole run, resumed or not) at the end.

    Asked to stop (``Session.stop``), it abandons the step in flight at its next safe point (its
    engine requests are cancelled at once), saves the last finished step and raises
    ``JobStopped`` (``runtime/stop.py`` says what is abandoned and what finishes).

    Step k's wall time runs from the end of step k-1's to its own end, so the steps tile the
    loop: logging and printing step k-1 is part of step k's ``time/other``.
    """
    history = list(ctx.log.history)
    stop = ctx.session.stop
    stop.listeners.append(announce_stop)
    stop.listeners.append(ctx.engines.cancel_all)  # a stop drops every generation in flight
    if ctx.algorithm.off_policy_steps:
        ctx.background = ThreadPoolExecutor(max_workers=1, thread_name_prefix="relax-rollout")
    if ctx.continuous is not None:
        stop.listeners.append(lambda why: ctx.continuous.close())
        ctx.continuous.start()
    stop.stepping = True  # from now on a stop saves what the steps did
    try:
        stopped, done = run_steps(ctx, num_steps, start_step, step_fn, history)
    finally:
        if ctx.background is not None:  # on an error, do not wait for a rollout nobody needs
            ctx.background.shutdown(wait=False, cancel_futures=True)
        if ctx.continuous is not None:
            ctx.continuous.close()
    operator_log().info(ctx.log.finish(history, log_dir))
    if stopped is not None:
        stop_job(ctx, stopped, done, num_steps, log_dir)
    return history


def announce_stop(reason: str) -> None:
    operator_log().warning(
        f"relax-launch: stopping ({reason}): the step in flight is abandoned unless it is "
        "training, then the last finished step is checkpointed"
    )


def stop_or_failure(ctx: RLContext, cause: BaseException | None = None) -> None:
    """A stop request that came with a failure (torchrun stops every rank when one dies) is the
    failure's consequence: raise the failure."""
    if failure := ctx.session.stop.failed():
        raise RuntimeError(f"the job failed: {failure}") from cause


def run_steps(
    ctx: RLContext,
    num_steps: int,
    start_step: int,
    step_fn: Callable[[RLContext, int, int], dict[str, float]],
    history: list[dict[str, float]],
) -> tuple[str | None, int]:
    """The steps; returns why they stopped early (None: they all ran) and the steps done."""
    progress = StepProgress(ctx.session.console, num_steps, start_step)
    stop = ctx.session.stop
    with progress:
        began = clock()
        for step in range(start_step, num_steps):
            if stopped := ctx.session.stop_requested():
                stop_or_failure(ctx)
                return stopped, step
            try:
                metrics = step_fn(ctx, step, num_steps)
            except StepAbandoned as abandoned:
                stop_or_failure(ctx, abandoned)
                operator_log().warning(f"relax-launch: step {step + 1} abandoned for the stop")
                return abandoned.reason, step
            except Exception as exc:
                if not (stopped := ctx.session.stop_requested(wait_s=STOP_NOTICE_S)):
                    raise
                stop_or_failure(ctx, exc)
                operator_log().warning(
                    f"relax-launch: step {step + 1} dropped ({type(exc).__name__}) by the stop"
                )
                return stopped, step
            if checkpoint_due(ctx, step + 1, num_steps):
                with timed(ctx.seconds, "checkpoint"):
                    save_checkpoint(ctx, step + 1)
            evaluating = ctx.evaluation is not None and ctx.coordinator is None  # split/defer:
            if evaluating and ctx.evaluation.due(step + 1, num_steps):  # in their own turns
                try:
                    with timed(ctx.seconds, "eval"), stop.abandonable():  # this step's weights
                        metrics |= ctx.evaluation.run(
                            ctx.engines, ctx.rewards, ctx.data.max_response_tokens
                        )
                except StepAbandoned:  # the step is done, its evaluation is not
                    pass
            ended = clock()
            metrics |= step_times(ctx.seconds, ended - began)
            began = ended
            history.append(metrics)
            ctx.log.write(metrics)
            progress.step(metrics)
    return None, num_steps


def step_times(main_thread: dict[str, float], wall_s: float) -> dict[str, float]:
    """``time/step`` is the step's whole wall time; ``time/other`` what no main-thread phase
    covers (writing metrics and TensorBoard, the console, Python between phases)."""
    phases = {f"time/{k}": v for k, v in main_thread.items()}
    return phases | {"time/step": wall_s, "time/other": wall_s - sum(main_thread.values())}
