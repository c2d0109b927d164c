"""Periodic evaluation: held-out prompts sampled by the rollout engines with the weights just
trained and synced (in split/defer in turns of its own, ``rl/colocated.py``), scored by the job's
reward sources; mean reward and unbiased pass@k go to the step's
metrics (so to metrics.jsonl, TensorBoard, the curves and the summary)."""

from __future__ import annotations

from math import comb
from typing import Any

from relax_launch.inference.inprocess import EngineClients
from relax_launch.rl import rollout
from relax_launch.rl.data import Prompt, held_out, load_prompts, prompt_ids
from relax_launch.rl.data_config import DataConfig, EvalConfig
from relax_launch.rl.reasoning_gym_config import PREFIX
from relax_launch.rl.rewards import Rewards
from relax_launch.rl.samples import Sample
from relax_launch.rl.vision_prompts import VisionEncoder


def pass_at_k(n: int, passed: int, k: int) -> float:
    """The unbiased pass@k of one prompt from ``passed`` of ``n`` samples: the chance that k of
    them drawn without replacement include one that passed (Chen et al., 2021)."""
    if n - passed < k:
        return 1.0
    return 1.0 - comb(n - passed, k) / comb(n, k)


def average(values: list[float]) -> float:
    return sum(values) / len(values)


class Evaluation:
    """The eval prompts, tokenized once (those over the prompt limit left out and counted, and
    those the training asks too, ``data.held_out``), and the response limit
    (``eval.sampling``'s, else ``data.max_response_tokens``). ``training``: the training
    prompts already read (read again from ``data`` when not given); ``rows``: the eval prompts
    already read (``rl/inputs.py``: read from ``config.data`` when not given). ``vision``: a
    vision-language policy's encoder, so prompts with images are sampled with them
    (``rl/vision_prompts.py``), as the training's are."""

    def __init__(
        self,
        config: EvalConfig,
        tokenizer: Any,
        data: DataConfig,
        training: list[Prompt] | None = None,
        vision: VisionEncoder | None = None,
        rows: list[Prompt] | None = None,
    ) -> None:
        self.config = config
        max_prompt_tokens = data.max_prompt_tokens
        self.max_tokens = config.sampling.max_response_tokens or data.max_response_tokens
        prompts = load_prompts(config.data) if rows is None else rows
        if training is None and all(d.dataset.startswith(PREFIX) for d in (config.data, data)):
            training = load_prompts(data)
        kept = held_out(prompts, config.data, training or [], data)
        self.seen_in_training = len(prompts) - len(kept)
        prompts = kept[: config.max_prompts]  # the held-out rows up to the limit
        self.prompts: list[tuple[Prompt, list[int]]] = []
        for prompt in prompts:
            if vision is not None:
                prompt, ids = vision.encode(prompt)
            else:
                ids = prompt_ids(tokenizer, prompt)
            if len(ids) <= max_prompt_tokens:
                self.prompts.append((prompt, ids))
        self.skipped = len(prompts) - len(self.prompts)
        if not prompts:
            raise ValueError(
                f"eval.data.dataset {config.data.dataset}: every prompt is also a training "
                "prompt (the task has few distinct questions): give it a larger task config"
            )
        if not self.prompts:
            raise ValueError(
                f"eval.data.dataset {config.data.dataset}: every prompt is longer than "
                f"data.max_prompt_tokens={max_prompt_tokens}"
            )

    def due(self, step: int, num_steps: int) -> bool:
        """Whether to evaluate after ``step`` (1-based): every ``every_steps`` and the last."""
        every = self.config.every_steps
        return step == num_steps or (every > 0 and step % every == 0)

    def run(self, engines: EngineClients, rewards: Rewards) -> dict[str, float]:
        """Sample, score and summarise (``summarize``)."""
        samples = self.sample(engines)
        return self.summarize(samples, rewards.score(samples))

    def sample(self, engines: EngineClients) -> list[Sample]:
        """``n_samples`` per eval prompt from the rollout engines' current weights."""
        sampling = self.config.sampling
        return rollout.generate(
            engines,
            self.prompts,
            n=sampling.n_samples,
            temperature=sampling.temperature,
            max_tokens=self.max_tokens,
        )

    def summarize(
        self, samples: list[Sample], reward_metrics: dict[str, float]
    ) -> dict[str, float]:
        """``eval/reward``, ``eval/pass@k``, the mean response length and failed rewards, from
        scored samples and the reward sources' metrics."""
        c, n = self.config, self.config.sampling.n_samples
        scored = [s for s in samples if s.valid]
        out = {
            "eval/reward": sum(s.reward for s in scored) / len(scored),
            "eval/response_tokens": sum(len(s.response_ids) for s in samples) / len(samples),
            "eval/samples_invalid": len(samples) - len(scored),
            "eval/prompts": len(self.prompts),
            "eval/skipped_long_prompts": self.skipped,
            "eval/skipped_training_prompts": self.seen_in_training,
        }
        out |= {
            f"eval/{k}": v
            for k, v in reward_metrics.items()
            if k.endswith(("/failed", "/timeouts"))
        }
        passed = [
            sum(s.valid and s.reward >= c.pass_threshold for s in samples[g * n : (g + 1) * n])
            for g in range(len(self.prompts))
        ]
        for k in c.pass_k:
            out[f"eval/pass@{k}"] = average([pass_at_k(n, p, k) for p in passed])
        if c.data.dataset.startswith(PREFIX):  # and per reasoning-gym task
            out |= self.per_task(samples, passed)
        return out

    def per_task(self, samples: list[Sample], passed: list[int]) -> dict[str, float]:
        """``eval/TASK/pass@k`` and ``eval/TASK/reward`` of each task's prompts."""
        c, n, out = self.config, self.config.sampling.n_samples, {}
        for task in dict.fromkeys(p.data_source for p, _ in self.prompts):
            groups = [g for g, (p, _) in enumerate(self.prompts) if p.data_source == task]
            mine = [s for g in groups for s in samples[g * n : (g + 1) * n] if s.valid]
            out[f"eval/{task}/reward"] = average([s.reward for s in mine]) if mine else float("nan")
            for k in c.pass_k:
                out[f"eval/{task}/pass@{k}"] = average([pass_at_k(n, passed[g], k) for g in groups])
        return out
