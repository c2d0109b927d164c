"""The RL loop on rank 0: one function per step that lists its phases, and the run around it.

rollout (N samples per prompt through the gateway) -> teacher scoring (logprobs written back
onto the samples) -> rewards (functions and the GenRM judge) -> advantages (GRPO, plus the
distillation term per token) -> Megatron train step (PPO-clip) -> weight sync (version = step).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from relax_launch.rl import rollout
from relax_launch.rl.config import AlgorithmConfig, DataConfig
from relax_launch.rl.data import Prompt, PromptStream
from relax_launch.rl.losses import LossSpec, distill_advantages, group_advantages
from relax_launch.rl.report import MetricsLog
from relax_launch.rl.rewards import Rewards
from relax_launch.rl.samples import Sample
from relax_launch.runtime.session import Session
from relax_launch.trainer.batch import TokenBatch


@dataclass
class RLContext:
    """What every step needs, built once (see ``runtime.programs.rl_program``)."""

    session: Session
    algorithm: AlgorithmConfig
    data: DataConfig
    prompts: PromptStream
    tokenizer: Any
    rewards: Rewards
    log: MetricsLog
    has_teacher: bool
    skipped_prompts: int = 0
    seconds: dict[str, float] = field(default_factory=dict)

    @property
    def spec(self) -> LossSpec:
        a = self.algorithm
        return LossSpec(a.clip_eps, a.clip_eps_high or a.clip_eps, a.loss_aggregation)


@contextmanager
def phase(ctx: RLContext, name: str) -> Iterator[None]:
    started = time.perf_counter()
    try:
        yield
    finally:
        ctx.seconds[name] = time.perf_counter() - started


def rl_step(ctx: RLContext, step: int) -> dict[str, float]:
    """One RL step; returns its metrics."""
    ctx.seconds = {}
    started = time.perf_counter()
    a = ctx.algorithm
    with phase(ctx, "rollout"):
        samples = rollout.generate(
            ctx.session.gateway_url,
            next_prompts(ctx),
            n=a.n_samples_per_prompt,
            temperature=a.temperature,
            max_tokens=ctx.data.max_response_tokens,
        )
    if ctx.has_teacher:
        with phase(ctx, "teacher"):
            rollout.score_with_teacher(ctx.session.gateway_url, samples)
    with phase(ctx, "reward"):
        metrics = ctx.rewards.score(samples)
    assign_advantages(samples, a.n_samples_per_prompt)
    with phase(ctx, "train"):
        metrics |= ctx.session.train_step(to_batch(samples, a.distill_coef), ctx.spec)
    with phase(ctx, "sync"):
        ctx.session.sync_weights(step + 1)
    total = time.perf_counter() - started
    metrics |= sample_metrics(samples, ctx.seconds.get("rollout", 0.0))
    metrics |= {f"time/{k}": v for k, v in ctx.seconds.items()}
    metrics |= {"time/step": total, "time/other": total - sum(ctx.seconds.values())}
    return {"step": step + 1, "data/skipped_long_prompts": ctx.skipped_prompts, **metrics}


def next_prompts(ctx: RLContext) -> list[tuple[Prompt, list[int]]]:
    """The step's prompts with their token ids; a prompt over max_prompt_tokens is skipped
    (counted in ``data/skipped_long_prompts``) and the next one taken."""
    chosen: list[tuple[Prompt, list[int]]] = []
    for _ in range(100 * ctx.data.prompts_per_step):
        if len(chosen) == ctx.data.prompts_per_step:
            return chosen
        prompt = ctx.prompts.next_batch(1)[0]
        text = ctx.tokenizer.apply_chat_template(
            list(prompt.messages), add_generation_prompt=True, tokenize=False
        )
        ids = ctx.tokenizer.encode(text, add_special_tokens=False)
        if len(ids) > ctx.data.max_prompt_tokens:
            ctx.skipped_prompts += 1
            continue
        chosen.append((prompt, ids))
    raise RuntimeError(
        f"data.dataset: almost every prompt is longer than data.max_prompt_tokens="
        f"{ctx.data.max_prompt_tokens}; raise it or shorten the prompts"
    )


def assign_advantages(samples: list[Sample], group_size: int) -> None:
    """GRPO within each prompt's group, over the samples that have a reward."""
    for start in range(0, len(samples), group_size):
        group = [s for s in samples[start : start + group_size] if s.valid and s.response_ids]
        if len(group) < 2:
            continue
        for s, adv in zip(
            group, group_advantages([s.reward for s in group], len(group)), strict=True
        ):
            s.advantage = adv


def to_batch(samples: list[Sample], distill_coef: float) -> TokenBatch:
    """Prompt + response tokens; only valid responses are trained on, each token weighted by its
    advantage (plus the distillation term when a teacher scored it)."""
    tokens, masks, weights, old = [], [], [], []
    for s in samples:
        trained = s.valid and bool(s.response_ids)
        per_token = [s.advantage] * len(s.response_ids)
        if distill_coef and s.teacher_logprobs:
            extra = distill_advantages(s.logprobs, s.teacher_logprobs, distill_coef)
            per_token = [a + d for a, d in zip(per_token, extra, strict=True)]
        prompt_len = len(s.prompt_ids)
        tokens.append(tuple(s.prompt_ids + s.response_ids))
        masks.append(tuple([0.0] * prompt_len + [float(trained)] * len(s.response_ids)))
        weights.append(tuple([0.0] * prompt_len + per_token))
        old.append(tuple([0.0] * prompt_len + s.logprobs))
    return TokenBatch(tuple(tokens), tuple(masks), tuple(weights), tuple(old))


def sample_metrics(samples: list[Sample], rollout_s: float) -> dict[str, float]:
    valid = [s for s in samples if s.valid]
    generated = sum(len(s.response_ids) for s in samples)
    out = {
        "reward": sum(s.reward for s in valid) / len(valid) if valid else float("nan"),
        "response_tokens": generated / len(samples),
        "tokens_per_s": generated / rollout_s if rollout_s else 0.0,
        "samples_invalid": len(samples) - len(valid),
        "weight_version": min(int(s.weight_version) for s in samples),
    }
    scored = [s for s in samples if s.teacher_logprobs]
    if scored:
        diffs = [
            lp - t for s in scored for lp, t in zip(s.logprobs, s.teacher_logprobs, strict=True)
        ]
        out["reverse_kl"] = sum(diffs) / len(diffs)
    return out


def run(ctx: RLContext, num_steps: int, log_dir: Path) -> list[dict[str, float]]:
    """All steps, with a progress line each; metrics to JSONL, a plot and a summary at the end."""
    history = []
    for step in range(num_steps):
        metrics = rl_step(ctx, step)
        history.append(metrics)
        ctx.log.write(metrics)
        print(ctx.log.progress(metrics, num_steps), flush=True)
    ctx.log.finish(history, log_dir)
    return history
