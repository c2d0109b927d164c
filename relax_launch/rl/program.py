"""The RL program rank 0 runs on a live job (what ``relax_launch/launch.py`` starts): bring up,
resume from a checkpoint, then the RL loop."""

from __future__ import annotations

import contextlib
import functools
from typing import Any

from relax_launch.config.job import JobConfig
from relax_launch.models.build import ensure_model
from relax_launch.rl import rollout
from relax_launch.rl.agent import load_rollout_function
from relax_launch.rl.async_rollout import ContinuousRollout
from relax_launch.rl.colocated import colocated_step
from relax_launch.rl.data import Prompt, PromptCursor, PromptStream
from relax_launch.rl.evaluation import Evaluation
from relax_launch.rl.loop import RLContext, next_prompts, rl_step
from relax_launch.rl.report import MetricsLog, metric_sinks
from relax_launch.rl.rewards import Rewards
from relax_launch.rl.runner import run
from relax_launch.runtime.checkpoint import Checkpoints
from relax_launch.runtime.colocation import build_coordinator
from relax_launch.runtime.console import operator_log
from relax_launch.runtime.session import Session, bring_up
from relax_launch.runtime.startup import write_report

JUDGE_MAX_TOKENS = 16  # "Score: N" needs a few tokens


def rl_program(job: JobConfig, data: list[Prompt]) -> Any:
    """Bring the job up (engines, first weight sync; the newest checkpoint first when resuming),
    then run the RL steps up to ``algorithm.num_steps`` on the prompts ``data`` (read and
    checked by ``rl.inputs.check_inputs``)."""

    def program(session: Session) -> list[dict[str, float]]:
        log_dir = job.log_dir
        prompts = PromptStream(data, shuffle=job.data.shuffle, seed=job.data.seed)
        checkpoints = Checkpoints(job.checkpoint_dir, job.checkpoint.keep_last)
        start, skipped = resume(session, checkpoints, prompts) if job.checkpoint.resume else (0, 0)
        # metric sinks before the engines' first sync: a W&B login problem fails fast
        sinks = metric_sinks(job.logging, log_dir, start, job.name, job.model_dump(mode="json"))
        log = MetricsLog(log_dir, resume_step=start, sinks=sinks)
        with contextlib.closing(log):  # on success run() has closed it already
            up = bring_up(session, weight_version=start)
            write_report(up["startup"], log_dir)
            context = rl_context(job, session, prompts, log, checkpoints, skipped)
            if job.algorithm.max_staleness:
                context.continuous = continuous_rollout(job, session, context, start)
            step_fn = rl_step
            if session.plan.mode != "decoupled":  # roles take turns on shared ranks
                context.coordinator = build_coordinator(
                    session, job.placement.operation_timeout_s, log_dir / "coordinator.jsonl"
                )
                step_fn = colocated_step
            try:
                return run(context, job.algorithm.num_steps, log_dir, start, step_fn)
            finally:
                if context.coordinator is not None:
                    context.coordinator.close()

    return program


def rl_context(
    job: JobConfig,
    session: Session,
    prompts: PromptStream,
    log: MetricsLog,
    checkpoints: Checkpoints,
    skipped: int,
) -> RLContext:
    """What every RL step needs, from the job's sections and the live session."""
    from transformers import AutoTokenizer  # rank 0 only: prompts get the chat template

    engines = session.control_plane.engines  # the controller's in-process engine clients
    judge = None
    if job.genrm is not None:
        judge = functools.partial(rollout.judge, engines, max_tokens=JUDGE_MAX_TOKENS)
    tokenizer = AutoTokenizer.from_pretrained(str(ensure_model(job.rollout_model())))
    evaluation = None
    if job.eval is not None:
        evaluation = Evaluation(job.eval, tokenizer, job.data.max_prompt_tokens)
    return RLContext(
        session=session,
        algorithm=job.algorithm,
        data=job.data,
        prompts=prompts,
        tokenizer=tokenizer,
        rewards=Rewards(job.reward, judge=judge),
        log=log,
        has_teacher=job.teacher is not None,
        engines=engines,
        skipped_prompts=skipped,
        checkpoints=checkpoints,
        checkpoint_every=job.checkpoint.every_steps if job.checkpoint.dir is not None else None,
        correction=job.rollout_correction(),
        evaluation=evaluation,
        agent=load_rollout_function(job.rollout.function) if job.rollout.function else None,
    )


def continuous_rollout(
    job: JobConfig, session: Session, context: RLContext, version: int
) -> ContinuousRollout:
    """The fully asynchronous producer: draws the loop's prompts, aborts on the rollout
    engines what is in flight when weights are to be synced."""
    engines = session.control_plane.managers["rollout"].engines

    def abort() -> None:
        for engine in engines:
            engine.call("abort_request", {"abort_all": True})

    a = job.algorithm
    return ContinuousRollout(
        context.engines,
        functools.partial(next_prompts, context),
        abort,
        context.tokenizer,
        agent=context.agent,
        n=a.n_samples_per_prompt,
        max_staleness=a.max_staleness,
        sampling={"temperature": a.temperature},
        max_tokens=job.data.max_response_tokens,
        version=version,
    )


def resume(session: Session, checkpoints: Checkpoints, prompts: PromptStream) -> tuple[int, int]:
    """Load the newest complete checkpoint into the trainer and the prompt stream; returns the
    step to continue from and the skipped-prompt count (0, 0 when there is none yet)."""
    found = checkpoints.newest()
    if found is None:
        operator_log().info(
            f"relax-launch: no checkpoint in {checkpoints.directory} yet: starting at step 0"
        )
        return 0, 0
    step, directory = found
    state = Checkpoints.controller_state(directory)
    optimizer_steps = session.load_trainer(str(directory))
    prompts.restore(PromptCursor(**state["prompts"]))
    operator_log().info(
        f"relax-launch: resuming from {directory}: step {step}, trainer at optimizer step "
        f"{optimizer_steps}, prompt {state['prompts']['seen']}"
    )
    return step, state["skipped_prompts"]
