"""From scored samples to the batch a train step consumes: over-long reward shaping and
filtering, the advantage estimator over each prompt's group, dynamic sampling's group filter,
and the token batch itself (pure functions of samples, unit-tested)."""

from __future__ import annotations

from relax_launch.rl.advantages import ESTIMATORS, distill_advantages, overlong_penalty
from relax_launch.rl.config import AlgorithmConfig
from relax_launch.rl.samples import Sample
from relax_launch.trainer.batch import TokenBatch

OUTCOMES = ("out_of_budget", "failed", "rejected")  # how an agentic conversation ended early


def shape_overlong(samples: list[Sample], algorithm: AlgorithmConfig, max_tokens: int) -> int:
    """DAPO's over-long shaping (a penalty added to the reward of responses near the limit) and
    filtering (responses cut at the limit are not trained on); returns the responses cut."""
    a, cut = algorithm, 0
    for s in samples:
        if s.finish_reason == "length":
            cut += 1
            s.masked = s.masked or a.mask_truncated
        if s.valid and a.overlong_buffer_tokens:
            penalty = overlong_penalty(
                len(s.response_ids), max_tokens, a.overlong_buffer_tokens, a.overlong_penalty
            )
            s.rewards["overlong"] = penalty
            s.reward += penalty
    return cut


def groups(samples: list[Sample], group_size: int) -> list[list[Sample]]:
    """The samples of each prompt: consecutive runs of ``group_size``."""
    return [samples[i : i + group_size] for i in range(0, len(samples), group_size)]


def assign_advantages(samples: list[Sample], group_size: int, estimator: str = "grpo") -> None:
    """The estimator over each prompt's group, counting the samples that have a reward and a
    response; a group with fewer than two of them gets no advantage. ``gae`` assigns none here:
    its advantages are per token, from the critic's values at the train step
    (``rl/critic_step.py``)."""
    if estimator == "gae":
        return
    scored = [
        g
        for g in (
            [s for s in group if s.valid and s.response_ids]
            for group in groups(samples, group_size)
        )
        if len(g) >= 2
    ]
    values = ESTIMATORS[estimator]([[s.reward for s in g] for g in scored])
    for group, advantages in zip(scored, values, strict=True):
        for s, advantage in zip(group, advantages, strict=True):
            s.advantage = advantage


def has_signal(group: list[Sample]) -> bool:
    """Whether a group's rewards differ (DAPO keeps only those: equal rewards teach nothing)."""
    rewards = {s.reward for s in group if s.valid and s.response_ids}
    return len(rewards) > 1


def to_batch(samples: list[Sample], distill_coef: float) -> TokenBatch:
    """Prompt + response tokens; only valid, unmasked responses are trained on, each token
    weighted by its advantage (plus the distillation term when a teacher scored it)."""
    tokens, masks, weights, old = [], [], [], []
    for s in samples:
        trained = s.valid and not s.masked and bool(s.response_ids)
        for turn in s.earlier_turns or ():  # per_turn: a row per earlier turn, same advantage
            prompt_len = len(turn.prompt_ids)
            tokens.append(tuple(turn.prompt_ids + turn.response_ids))
            masks.append(tuple([0.0] * prompt_len + [float(trained)] * len(turn.response_ids)))
            weights.append(tuple([0.0] * prompt_len + [s.advantage] * len(turn.response_ids)))
            old.append(tuple([0.0] * prompt_len + turn.logprobs))
        per_token = [s.advantage] * len(s.response_ids)
        if distill_coef and s.teacher_logprobs:
            extra = distill_advantages(s.logprobs, s.teacher_logprobs, distill_coef)
            per_token = [a + d for a, d in zip(per_token, extra, strict=True)]
        prompt_len = len(s.prompt_ids)
        tokens.append(tuple(s.prompt_ids + s.response_ids))
        produced = s.response_mask or [1.0] * len(s.response_ids)  # agentic: engine tokens
        masks.append(tuple([0.0] * prompt_len + [float(trained) * m for m in produced]))
        weights.append(tuple([0.0] * prompt_len + per_token))
        old.append(tuple([0.0] * prompt_len + s.logprobs))
    # per_turn's rows vary in number: rows without loss make them a multiple of the samples',
    # which split over the data-parallel ranks and micro-batches (config/rules.py)
    while samples and len(tokens) % len(samples):
        tokens.append((tokens[0] * 2)[:2])
        masks.append((0.0, 0.0))
        weights.append((0.0, 0.0))
        old.append((0.0, 0.0))
    routed = [s.routed_experts for s in samples]
    replay = tuple(routed) if all(r is not None for r in routed) else None
    images = None
    if any(s.images is not None for s in samples):  # one row per sample (no per_turn rows)
        images = tuple(s.images for s in samples)
    return TokenBatch(tuple(tokens), tuple(masks), tuple(weights), tuple(old), replay, images)


def sample_metrics(
    samples: list[Sample], rollout_s: float, drawn_tokens: float | None = None
) -> dict[str, float]:
    """The batch's mean reward, response length and invalid samples; the rollout's tokens per
    second (over every response drawn, ``drawn_tokens``, when dynamic sampling drew more); the
    reverse KL to the teacher where it scored, and the samples it did not score."""
    valid = [s for s in samples if s.valid]
    generated = sum(
        len(s.response_ids) + sum(len(t.response_ids) for t in s.earlier_turns or ())
        for s in samples
    )
    drawn = generated if drawn_tokens is None else drawn_tokens
    out = {
        "reward": sum(s.reward for s in valid) / len(valid) if valid else float("nan"),
        "response_tokens": generated / len(samples),
        "tokens_per_s": drawn / rollout_s if rollout_s else 0.0,
        "samples_invalid": len(samples) - len(valid),
    }
    agentic = [s for s in samples if s.response_mask is not None]
    if agentic:
        out["agent/turns"] = sum(s.turns for s in agentic) / len(agentic)
        out |= {f"agent/{o}": sum(s.outcome == o for s in agentic) for o in OUTCOMES}
    scored = [s for s in samples if s.teacher_logprobs]
    if any(s.teacher_logprobs is not None for s in samples):  # a teacher scored this batch
        # an empty response, or one showing a media placeholder (``vision_scoring.teachable``)
        out["teacher/unscored"] = sum(s.teacher_logprobs == [] for s in samples)
    if scored:
        diffs = [
            lp - t for s in scored for lp, t in zip(s.logprobs, s.teacher_logprobs, strict=True)
        ]
        out["reverse_kl"] = sum(diffs) / len(diffs)
    return out
