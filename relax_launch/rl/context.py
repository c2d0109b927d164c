"""What every RL step reads and returns: ``RLContext``, built once by the program and never
changed; ``PromptFeed``, the step's prompts drawn in order; ``StepResult``, what one step hands
back to the run (its metrics, the prompt position its batch ends at, where its time went)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from relax_launch.notify import Notifier
from relax_launch.rl.checkpoints import Checkpoints
from relax_launch.rl.config import AlgorithmConfig
from relax_launch.rl.control import StepControl
from relax_launch.rl.critic_config import CriticConfig
from relax_launch.rl.data import Prompt, PromptCursor, PromptStream, prompt_ids
from relax_launch.rl.data_config import DataConfig
from relax_launch.rl.evaluation import Evaluation
from relax_launch.rl.exports import PolicyExports
from relax_launch.rl.interfaces import Job
from relax_launch.rl.mismatch_guard import MismatchGuard
from relax_launch.rl.report import MetricsLog
from relax_launch.rl.rewards import Rewards
from relax_launch.rl.samples import Sample
from relax_launch.rl.vision_prompts import VisionEncoder
from relax_launch.trainer.losses import LossSpec

# (engines, prompts with their token ids, n, temperature, max_tokens) -> samples
Generator = Callable[..., list[Sample]]
Score = Callable[["RLContext", list[Sample], dict[str, float]], dict[str, float]]
Collect = Callable[..., Any]  # (ctx, seconds[, draw]) -> phases.RolloutBatch


class PromptFeed:
    """The step's prompts with their token ids, in the stream's order; a prompt longer than
    ``data.max_prompt_tokens`` is skipped, counted in ``skipped``, and the next one taken.
    With ``vision`` (a vision-language policy) prompts with images are encoded by it
    (``rl/vision_prompts.py``): the ids are the trainer's, image tokens included."""

    def __init__(
        self,
        stream: PromptStream,
        tokenizer: Any,
        data: DataConfig,
        skipped: int = 0,
        vision: VisionEncoder | None = None,
    ):
        self.stream, self.tokenizer, self.data, self.skipped = stream, tokenizer, data, skipped
        self.vision = vision

    def draw(self) -> list[tuple[Prompt, list[int]]]:
        chosen: list[tuple[Prompt, list[int]]] = []
        for _ in range(100 * self.data.prompts_per_step):
            if len(chosen) == self.data.prompts_per_step:
                return chosen
            prompt = self.stream.next_batch(1)[0]
            if self.vision is not None:
                prompt, ids = self.vision.encode(prompt)
            else:
                ids = prompt_ids(self.tokenizer, prompt)
            if len(ids) > self.data.max_prompt_tokens:
                self.skipped += 1
                continue
            chosen.append((prompt, ids))
        raise RuntimeError(
            f"data.dataset: almost every prompt is longer than data.max_prompt_tokens="
            f"{self.data.max_prompt_tokens}; raise it or shorten the prompts"
        )

    def position(self) -> PromptCursor:
        """Where the stream is: right after the prompts drawn so far."""
        return self.stream.checkpoint()


@dataclass(frozen=True)
class RLContext:
    """What every step needs, built once from the job's sections (``rl.program``). Which
    variant of a phase a step runs is decided here, not by flags inside the phases:
    ``generator`` (replies or conversations), ``score`` (with the teacher's logprobs or
    without), ``collect`` (one round, or rounds until the groups carry signal)."""

    job: Job
    algorithm: AlgorithmConfig
    data: DataConfig
    feed: PromptFeed
    tokenizer: Any
    rewards: Rewards
    log: MetricsLog
    checkpoints: Checkpoints  # where they go: checkpoint.dir, else the run directory
    checkpoint_every: int | None  # steps; 0: only at the end; None: only on a stop
    generator: Generator
    score: Score
    collect: Collect
    correction: str = "none"  # algorithm.rollout_correction with auto resolved (by the job)
    # how long a step waits for its rollout: 3 request timeouts, sized by the job's batch
    rollout_wait_s: float = 900.0
    evaluation: Evaluation | None = None  # the eval section's prompts, when it has one
    exports: PolicyExports | None = None  # Hugging Face exports during the run
    guard: MismatchGuard | None = None  # algorithm.mismatch_guard (None: off)
    control: StepControl | None = None  # algorithm.control's actions on the train step
    notifier: Notifier | None = None  # logging.notify: rank 0's events (up, checkpoint failed)
    critic: CriticConfig | None = None  # PPO's value model (advantage_estimator gae)

    @property
    def spec(self) -> LossSpec:
        a = self.algorithm
        spec = LossSpec(
            clip_low=a.clip_eps,
            clip_high=a.clip_eps_high or a.clip_eps,
            aggregation=a.loss_aggregation,
            kl_coef=a.kl_coef,
            ratio=a.policy_ratio,
            correction=self.correction,
            correction_cap=a.rollout_correction_cap,
            max_response_tokens=self.data.max_response_tokens,
            surrogate=a.policy_loss,
            cispo_clip_high=a.cispo_clip_high,
            sapo_tau_pos=a.sapo_tau_pos,
            sapo_tau_neg=a.sapo_tau_neg,
            m2po_threshold=a.m2po_threshold,
        )
        return self.control.loss_spec(spec) if self.control is not None else spec

    def sampling(self) -> dict[str, Any]:
        """The generator's sampling arguments for the step's prompts."""
        a = self.algorithm
        return {
            "n": a.n_samples_per_prompt,
            "temperature": a.temperature,
            "max_tokens": self.data.max_response_tokens,
        }


@dataclass
class StepResult:
    """One step, as the run takes it: its metrics row (the run adds the step's wall time),
    the prompt position its trained batch ends at (what a checkpoint after it saves) and the
    seconds each main-thread phase took."""

    metrics: dict[str, float]
    cursor: PromptCursor
    seconds: dict[str, float]
