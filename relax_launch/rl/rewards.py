"""Reward sources: built-in checks, user functions (``module:function``) and the GenRM judge.

A function takes a list of ``Sample`` and returns one float per sample; it may be ``async``.
The judge's reply is decoded under a regex, so even a judge that ignores the instructions
writes a score. The reward of a sample is the weighted sum of its sources. A source that
raises, returns the wrong count or a non-number, or a judge reply without a score does not
become a silent zero: the source's ``fallback`` value is used if it has one, else the sample
is marked invalid (it gets no gradient; its group is normalised without it); either way the
failure is counted in the step's metrics (``reward/NAME/failed``). A step where every sample
is invalid stops the job with the first error.

``builtin:math_verify`` and ``builtin:reasoning_gym`` score each sample in a worker process
(``rl/reward_pool.py``) under the source's ``timeout_s``: a sample over it gets 0 and is
counted in ``reward/NAME/timeouts``. ``builtin:code_tests`` runs each sample's program against
its row's ``tests`` in a sandbox (``rl/code_pool.py``), one pool per source: its reward is the
fraction of tests passed (within ``timeout_s``: a sample over it keeps those passed before).
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import math
import os
import re
from collections.abc import Callable
from typing import Any

from relax_launch.rl.code_config import CodeTestsConfig
from relax_launch.rl.code_pool import CodeSandboxPool
from relax_launch.rl.config import RewardConfig, RewardSource
from relax_launch.rl.reward_pool import ScoringPool
from relax_launch.rl.samples import Sample
from relax_launch.rl.vision_scoring import image_parts_sent, judge_message

NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
ANSWER_LINE = re.compile(r"^Answer:\s*\S.*$")
# The judge is asked for "Score: N" (0-10) and its reply is prefilled with "Score:", so it only
# writes the number, and is decoded under JUDGE_SCORE_REGEX (the engine's grammar backend), so
# that number is in 0..10 whatever the model; the reward is N / 10, clamped to [0, 1].
JUDGE_TEMPLATE = (
    "You are grading an answer.\nQuestion:\n{question}\n\nAnswer:\n{answer}\n\n"
    "{reference}Rate the answer from 0 (wrong) to 10 (perfect). "
    "Reply with one line: 'Score: <number>'."
)
JUDGE_PREFILL = "Score:"
JUDGE_SCORE_REGEX = r" ?(10|[0-9](\.[0-9])?)"  # judges such as SmolLM2 say "2.5"
SCORE = re.compile(r"score\s*[:=]\s*(-?\d+(?:\.\d+)?)", re.IGNORECASE)


class RewardError(RuntimeError):
    """Every sample of a step lost its reward; the message names the source and the cause."""


def exact_numeric(samples: list[Sample]) -> list[float]:
    """1.0 when the last number in the response equals the label, else 0.0."""
    out = []
    for s in samples:
        numbers = NUMBER.findall(s.text)
        out.append(
            float(bool(numbers) and s.label is not None and float(numbers[-1]) == float(s.label))
        )
    return out


def format_reward(samples: list[Sample]) -> list[float]:
    """1.0 when the response's last non-empty line reads 'Answer: <something>'."""
    out = []
    for s in samples:
        lines = [line.strip() for line in s.text.strip().splitlines() if line.strip()]
        out.append(float(bool(lines) and ANSWER_LINE.match(lines[-1]) is not None))
    return out


def environment_reward(samples: list[Sample]) -> list[float | None]:
    """The environment's rubric, computed with its rollout (``rl/environments.py``); a sample
    whose rollout failed has none."""
    return [(s.scores or {}).get("environment") for s in samples]


def math_verify_call(sample: Sample) -> tuple[str, tuple]:
    """The worker call scoring a sample with math-verify (``rl/math_reward.py``)."""
    return "math_verify", (sample.text, sample.label)


def reasoning_gym_call(sample: Sample) -> tuple[str, tuple]:
    """The worker call scoring a sample with its task's ``score_answer``
    (``rl/reasoning_gym_tasks.py``)."""
    return "reasoning_gym", (sample.text, sample.data_source, sample.meta)


def code_tests_call(sample: Sample) -> tuple[str, tuple]:
    """The sandbox call running a sample's program against its row's tests
    (``rl/code_pool.py``)."""
    return "code_tests", (sample.text, (sample.meta or {}).get("tests"))


BUILTINS: dict[str, Callable[[list[Sample]], list[float]]] = {
    "exact_numeric": exact_numeric,
    "format": format_reward,
    "environment": environment_reward,
}
# sample -> (worker kind, args): scored in the pool's worker processes
POOLED: dict[str, Callable[[Sample], tuple[str, tuple]]] = {
    "math_verify": math_verify_call,
    "reasoning_gym": reasoning_gym_call,
    "code_tests": code_tests_call,
}
POOL_SIZE = min(4, os.cpu_count() or 1)


def parse_score(reply: str) -> float:
    """The judge's 'Score: N' as N / 10 (clamped to [0, 1]); ValueError when there is none."""
    match = SCORE.search(reply)
    if match is None:
        raise ValueError(f"no 'Score: N' in the judge's reply {reply[:120]!r}")
    return min(max(float(match.group(1)) / 10.0, 0.0), 1.0)


def load_function(spec: str) -> Callable[..., Any]:
    if spec.startswith("builtin:"):
        return {**BUILTINS, **POOLED}[spec[8:]]
    module_name, _, attr = spec.partition(":")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"reward function {spec!r} cannot be loaded: {exc}") from None


class Rewards:
    """Scores samples with every configured source; for GenRM, ``judge(conversations, regex,
    source)`` returns the judge's reply to each conversation, decoded under ``regex``, from the
    genrm model whose route_keys name the reward source ``source`` (else the default one).
    The judges of ``vision_judges`` (reward source names) are shown the prompts' images."""

    def __init__(
        self,
        config: RewardConfig,
        judge: Callable[[list[list[dict]], str, str], list[str]] | None = None,
        vision_judges: frozenset[str] = frozenset(),
    ) -> None:
        self.sources = config.sources
        self.functions = {s.name: load_function(s.function) for s in self.sources if s.function}
        self.judge = judge
        self.vision_judges = vision_judges
        sandboxed = {s.name for s in self.sources if s.function == "builtin:code_tests"}
        # started now, so the workers' imports overlap the engines' first generation
        workers = any(s.pooled and s.name not in sandboxed for s in self.sources)
        self.pool = ScoringPool(POOL_SIZE) if workers else None
        self.sandboxes = {
            s.name: CodeSandboxPool(s.code or CodeTestsConfig())
            for s in self.sources
            if s.name in sandboxed
        }

    def close(self) -> None:
        """Stop the scoring workers and the code sandboxes (at the end of the job)."""
        if self.pool is not None:
            self.pool.close()
        for sandboxes in self.sandboxes.values():
            sandboxes.close()

    def score(self, samples: list[Sample]) -> dict[str, float]:
        """Write ``rewards``/``reward``/``valid`` on each sample; return per-source metrics."""
        metrics: dict[str, float] = {}
        first_error = None
        timeouts: dict[str, int] = {}  # this call's (an off-policy step scores on a thread)
        images: dict[str, int] = {}  # the image parts each judge was sent (none: it failed)
        for source in self.sources:
            values, error = self._run(source, samples, timeouts, images)
            first_error = first_error or error
            failed = 0
            for sample, value in zip(samples, values, strict=True):
                if value is None:
                    failed += 1
                    value = source.fallback
                if value is None:
                    sample.valid = False
                else:
                    sample.rewards[source.name] = value
            ok = [v for v in values if v is not None]
            metrics[f"reward/{source.name}"] = sum(ok) / len(ok) if ok else float("nan")
            metrics[f"reward/{source.name}/failed"] = failed
            if source.pooled:
                metrics[f"reward/{source.name}/timeouts"] = timeouts.get(source.name, 0)
            if source.name in self.vision_judges:
                metrics[f"reward/{source.name}/images"] = images.get(source.name, 0)
        for sample in samples:
            if sample.valid:
                sample.reward = sum(s.weight * sample.rewards[s.name] for s in self.sources)
        if not any(s.valid for s in samples):
            raise RewardError(f"no sample of this step has a reward: {first_error}")
        return metrics

    def _run(
        self,
        source: RewardSource,
        samples: list[Sample],
        timeouts: dict[str, int],
        images: dict[str, int],
    ) -> tuple[list[float | None], str | None]:
        try:
            if source.genrm:
                return self._judge(samples, source.name, images)
            if source.pooled:
                return self._pooled(source, samples, timeouts)
            values = self.functions[source.name](samples)
            if inspect.isawaitable(values):
                values = asyncio.run(values)
            return _checked(source.name, values, len(samples)), None
        except Exception as exc:  # noqa: BLE001 - a user function's failure is reported, not fatal
            return [None] * len(
                samples
            ), f"reward source {source.name!r} raised {type(exc).__name__}: {exc}"

    def _pooled(
        self, source: RewardSource, samples: list[Sample], timeouts: dict[str, int]
    ) -> tuple[list[float | None], str | None]:
        """Each sample in a worker or a sandbox; one over ``timeout_s`` is counted and keeps
        the value it has (a sandbox's tests passed before), else 0."""
        call = self.functions[source.name]
        pool = self.sandboxes.get(source.name, self.pool)
        outcomes = pool.run([call(s) for s in samples], source.timeout_s)
        timeouts[source.name] = sum(o.timed_out for o in outcomes)
        values = [(o.value or 0.0) if o.timed_out else o.value for o in outcomes]
        errors = [o.error for o in outcomes if o.error]
        return values, f"reward source {source.name!r}: {errors[0]}" if errors else None

    def _judge(
        self, samples: list[Sample], source: str, images: dict[str, int]
    ) -> tuple[list[float | None], str | None]:
        if self.judge is None:
            raise RewardError("a genrm reward source needs the genrm role")
        seen = source in self.vision_judges  # else a text judge: told of the images
        prompts = [
            [
                judge_message(s, judge_prompt(s), seen),
                {"role": "assistant", "content": JUDGE_PREFILL},
            ]
            for s in samples
        ]
        values: list[float | None] = []
        error = None
        replies = self.judge(prompts, JUDGE_SCORE_REGEX, source)
        images[source] = image_parts_sent(prompts)  # answered: every request was sent
        for reply in replies:
            try:
                values.append(parse_score(f"{JUDGE_PREFILL} {reply}"))
            except ValueError as exc:
                values.append(None)
                error = error or f"genrm: {exc}"
        return values, error


def judge_prompt(sample: Sample) -> str:
    reference = f"Reference answer: {sample.label}\n\n" if sample.label is not None else ""
    return JUDGE_TEMPLATE.format(question=sample.question, answer=sample.text, reference=reference)


def _checked(name: str, values: Any, count: int) -> list[float | None]:
    if not isinstance(values, list | tuple) or len(values) != count:
        raise ValueError(f"{name} must return a list of {count} numbers, got {values!r:.80}")
    out: list[float | None] = []
    for v in values:
        ok = isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
        out.append(float(v) if ok else None)
    return out
