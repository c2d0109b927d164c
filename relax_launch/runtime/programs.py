"""Controller programs rank 0 runs on a live job: the RL loop (``launch.py``'s default)."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from relax_launch.config.job import JobConfig
from relax_launch.models.build import ensure_model
from relax_launch.rl import rollout
from relax_launch.rl.data import PromptStream, load_prompts
from relax_launch.rl.loop import RLContext, run
from relax_launch.rl.report import MetricsLog
from relax_launch.rl.rewards import Rewards
from relax_launch.runtime.session import Session, bring_up

JUDGE_MAX_TOKENS = 16  # "Score: N" needs a few tokens


def rl_program(job: JobConfig) -> Any:
    """Bring the job up (engines, first weight sync), then run ``algorithm.num_steps`` steps."""

    def program(session: Session) -> list[dict[str, float]]:
        from transformers import AutoTokenizer  # rank 0 only: prompts get the chat template

        bring_up(session)
        log_dir = Path(job.logging.dir.format(name=job.name))
        judge = None
        if job.genrm is not None:
            judge = functools.partial(
                rollout.judge, session.gateway_url, max_tokens=JUDGE_MAX_TOKENS
            )
        context = RLContext(
            session=session,
            algorithm=job.algorithm,
            data=job.data,
            prompts=PromptStream(
                load_prompts(job.data.dataset, job.data.seed),
                shuffle=job.data.shuffle,
                seed=job.data.seed,
            ),
            tokenizer=AutoTokenizer.from_pretrained(str(ensure_model(job.rollout_model()))),
            rewards=Rewards(job.reward, judge=judge),
            log=MetricsLog(log_dir, tensorboard=job.logging.tensorboard),
            has_teacher=job.teacher is not None,
        )
        return run(context, job.algorithm.num_steps, log_dir)

    return program
