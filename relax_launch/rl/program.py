"""The RL program rank 0 runs on a live job (what ``relax_launch/launch.py`` starts): resume from
a checkpoint, bring the job up, choose the schedule once, then the RL steps."""

from __future__ import annotations

import contextlib
import functools
import json
from typing import Any

from relax_launch.config.job import JobConfig
from relax_launch.console import operator_log
from relax_launch.models.build import ensure_model
from relax_launch.models.registry import is_vision_language
from relax_launch.notify import Notifier
from relax_launch.rl import agent, rollout
from relax_launch.rl.agent import load_rollout_function
from relax_launch.rl.agent_turns import client_factory
from relax_launch.rl.agent_vision import AgentVision
from relax_launch.rl.async_rollout import ContinuousRollout
from relax_launch.rl.checkpoints import Checkpoints
from relax_launch.rl.colocated import Colocated
from relax_launch.rl.context import PromptFeed, RLContext
from relax_launch.rl.control import StalenessControl, StepControl
from relax_launch.rl.data import Prompt, PromptCursor, PromptStream
from relax_launch.rl.environments import EnvironmentRollout
from relax_launch.rl.evaluation import Evaluation
from relax_launch.rl.exports import PolicyExports
from relax_launch.rl.interfaces import Job
from relax_launch.rl.mismatch_guard import MismatchGuard
from relax_launch.rl.phases import (
    collect_once,
    collect_until_signal,
    score_rewards,
    teacher_then_rewards,
)
from relax_launch.rl.report import MetricsLog, metric_sinks
from relax_launch.rl.rewards import Rewards
from relax_launch.rl.runner import run
from relax_launch.rl.schedules import FullyAsync, OffPolicy, Schedule, Synchronous
from relax_launch.rl.vision_prompts import VisionEncoder
from relax_launch.rl.vision_scoring import vision_judges
from relax_launch.run_dir import JOB_RECORD
from relax_launch.trainer.model import read_shape

JUDGE_MAX_TOKENS = 16  # "Score: N" needs a few tokens


def rl_program(job: JobConfig, data: list[Prompt], eval_data: list[Prompt] | None = None) -> Any:
    """Bring the job up (engines, first weight sync; the newest checkpoint first when resuming),
    then run the RL steps up to ``algorithm.num_steps`` on the prompts ``data``, evaluating on
    ``eval_data`` (both read and checked by ``rl.inputs.read_inputs``; ``eval_data`` None: read
    from ``eval.data``)."""

    def program(session: Job) -> list[dict[str, float]]:
        log_dir = job.log_dir
        log_dir.mkdir(parents=True, exist_ok=True)
        (log_dir / JOB_RECORD).write_text(json.dumps(job.model_dump(mode="json"), indent=1))
        stream = PromptStream(data, shuffle=job.data.shuffle, seed=job.data.seed)
        checkpoints = Checkpoints(job.checkpoint_dir, job.checkpoint.keep_last)
        start, skipped = resume(session, checkpoints, stream) if job.checkpoint.resume else (0, 0)
        # metric sinks before the engines' first sync: a W&B login problem fails fast
        sinks = metric_sinks(job.logging, log_dir, start, job.name, job.model_dump(mode="json"))
        log = MetricsLog(log_dir, resume_step=start, sinks=sinks)
        with contextlib.closing(log):  # on success run() has closed it already
            session.bring_up(start, log_dir)
            ctx = rl_context(job, session, stream, log, checkpoints, skipped, eval_data)
            for part in (ctx.control, ctx.guard):  # where the resumed run's steps left them
                if part is not None:
                    part.resume(log.history)
            resumed = f", resumed from the checkpoint of step {start}" if start else ""
            ctx.notifier.send(
                "up", f"training steps {start + 1}-{job.algorithm.num_steps}{resumed} ({log_dir})"
            )
            schedule, between_steps = choose_schedule(job, ctx, start)
            with contextlib.closing(ctx.rewards):  # its scoring workers end with the run
                return run(ctx, schedule, job.algorithm.num_steps, log_dir, start, between_steps)

    return program


def rl_context(
    job: JobConfig,
    session: Job,
    stream: PromptStream,
    log: MetricsLog,
    checkpoints: Checkpoints,
    skipped: int,
    eval_data: list[Prompt] | None = None,
) -> RLContext:
    """What every RL step needs, from the job's sections and the live job; which variant of
    each phase runs is chosen here."""
    from transformers import AutoTokenizer  # rank 0 only: prompts get the chat template

    tokenizer = AutoTokenizer.from_pretrained(str(ensure_model(job.rollout_model())))
    judge, genrm = None, None
    if job.genrm is not None:
        judge = functools.partial(rollout.judge, session.engines, max_tokens=JUDGE_MAX_TOKENS)
        genrm = session.engines.client("genrm").manager  # which judges take images
    generator = rollout.generate
    if job.algorithm.records_routing:  # the engine's routing of every sample, for the trainer
        routing = read_shape(ensure_model(job.trainer.model))
        generator = functools.partial(rollout.generate, routing=routing)
    vision = vision_encoder(job)
    if job.rollout.function:  # conversations of several turns (rl/agent.py)
        function = load_rollout_function(job.rollout.function)
        client = client_factory(job.rollout.multi_turn)  # how it is trained: rl/agent_turns.py
        images = AgentVision(vision.processor) if vision is not None else None
        generator = functools.partial(
            agent.generate, function=function, tokenizer=tokenizer, client=client, vision=images
        )
    if job.rollout.environment:  # an environment holds the conversations (rl/environments.py)
        function = EnvironmentRollout(job.rollout.environment, job.log_dir / "environment.log")
        generator = functools.partial(agent.generate, function=function, tokenizer=tokenizer)
    evaluation = None
    if job.eval is not None:
        evaluation = Evaluation(job.eval, tokenizer, job.data, stream.prompts, vision, eval_data)
    return RLContext(
        job=session,
        algorithm=job.algorithm,
        data=job.data,
        feed=PromptFeed(stream, tokenizer, job.data, skipped, vision),
        tokenizer=tokenizer,
        rewards=Rewards(job.reward, judge, vision_judges(genrm, job.reward)),
        log=log,
        checkpoints=checkpoints,
        checkpoint_every=job.checkpoint.every_steps if job.checkpoint.dir is not None else None,
        generator=generator,
        score=teacher_then_rewards if job.teacher is not None else score_rewards,
        collect=collect_until_signal if job.algorithm.dynamic_sampling else collect_once,
        correction=job.rollout_correction(),
        rollout_wait_s=job.rollout_wait_s(),
        evaluation=evaluation,
        exports=policy_exports(job),
        control=StepControl.of(job.algorithm.control),
        guard=MismatchGuard.of(
            job.algorithm.mismatch_guard, job.trainer.dtype, job.engine_dtype("rollout")
        ),
        notifier=Notifier(job.logging.notify, job.name),
        critic=job.critic,
    )


def vision_encoder(job: JobConfig) -> VisionEncoder | None:
    """A vision-language policy's prompt encoder (its processor: token ids with the images'
    placeholders, patches), else None."""
    if not is_vision_language(job.trainer.model):
        return None
    return VisionEncoder(ensure_model(job.trainer.model))


def policy_exports(job: JobConfig) -> PolicyExports:
    """Where and when the run exports its policy (``checkpoint.export_hf``)."""
    section = job.checkpoint.export_hf
    return PolicyExports(
        directory=job.export_dir,
        every_steps=section.every_steps,
        at_end=section.at_end,
        dtype=section.dtype or job.trainer.dtype,
        model_dir=ensure_model(job.trainer.model),
        config=job.model_dump(mode="json"),
    )


def choose_schedule(
    job: JobConfig, ctx: RLContext, start: int
) -> tuple[Schedule, Evaluation | None]:
    """The job's one schedule (``rl/schedules.py``, ``rl/colocated.py``), and the evaluation
    the run makes between steps (a colocated step evaluates in turns of its own)."""
    a = job.algorithm
    if job.placement.mode != "decoupled":  # roles take turns on shared ranks
        log_path = job.log_dir / "coordinator.jsonl"
        coordinator = ctx.job.coordinator(job.placement.operation_timeout_s, log_path)
        return Colocated(ctx, coordinator, a.num_steps), None
    if a.max_staleness:
        staleness = a.control.staleness if a.control else None
        control = StalenessControl(staleness, a.max_staleness) if staleness else None
        rollout = continuous_rollout(job, ctx, start)
        if control is not None:  # the bound where the resumed run's steps left it
            control.resume(ctx.log.history)
            rollout.k = control.bound
        return FullyAsync(ctx, rollout, control), ctx.evaluation
    if a.off_policy_steps:
        return OffPolicy(ctx, a.num_steps), ctx.evaluation
    return Synchronous(ctx), ctx.evaluation


def continuous_rollout(job: JobConfig, ctx: RLContext, version: int) -> ContinuousRollout:
    """The fully asynchronous producer: draws the loop's prompts, aborts on the rollout
    engines what is in flight when weights are to be synced."""
    a = job.algorithm
    function = load_rollout_function(job.rollout.function) if job.rollout.function else None
    vision = ctx.feed.vision  # a vision-language policy's conversations get their images
    images = AgentVision(vision.processor) if function and vision is not None else None
    return ContinuousRollout(
        ctx.job.engines,
        ctx.feed.draw,
        ctx.job.abort_rollout,
        ctx.tokenizer,
        agent=function,
        n=a.n_samples_per_prompt,
        max_staleness=a.max_staleness,
        sampling={"temperature": a.temperature},
        max_tokens=job.data.max_response_tokens,
        version=version,
        client=client_factory(job.rollout.multi_turn),
        vision=images,
    )


def resume(session: Job, checkpoints: Checkpoints, stream: PromptStream) -> tuple[int, int]:
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
    stream.restore(PromptCursor(**state["prompts"]))
    operator_log().info(
        f"relax-launch: resuming from {directory}: step {step}, trainer at optimizer step "
        f"{optimizer_steps}, prompt {state['prompts']['seen']}"
    )
    return step, state["skipped_prompts"]
