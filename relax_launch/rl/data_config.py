"""Config sections of the prompts the RL loop trains and evaluates on: where they come from
(a built-in task, a file, a dataset directory) and which fields hold them, the training data's
lengths, and the evaluation on held-out prompts (its sampling and pass@k)."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

from pydantic import Field, field_validator, model_validator

from relax_launch.config.section import Section
from relax_launch.rl.reasoning_gym_config import PREFIX, ReasoningGymConfig

BUILTIN_DATASETS = ("arithmetic", "format", "word_problems", "code", "shape_counting")


class PromptSource(Section):
    """Where prompts come from, and which fields of a dataset file hold them: the part of the
    data section that ``eval.data`` shares."""

    where: ClassVar[str] = "data"  # the section's path, in messages

    dataset: str = Field(
        "builtin:arithmetic",
        description="builtin:arithmetic / format / word_problems / code / shape_counting (an "
        "image of coloured shapes and a count to give: for a vision-language trainer.model), "
        "reasoning_gym:TASK[+TASK...] (reasoning-gym's procedural tasks, see reasoning_gym), a "
        ".jsonl or .parquet file, or a directory: an HF datasets save_to_disk directory or a "
        "directory of Parquet files (the Hub's layout). Rows have a prompt (text) or messages "
        "(chat; content may be parts with images, and an images column fills image parts "
        "without one: docs/vlm.md), an optional label and data_source, and tests for "
        "builtin:code_tests.",
    )
    reasoning_gym: ReasoningGymConfig | None = Field(
        None,
        description="dataset reasoning_gym:...: rows per task, each task's config, the answer "
        "format; unset: reasoning-gym's defaults.",
    )
    split: str = Field(
        "train", description="The split of a dataset directory (DatasetDict or Hub layout)."
    )
    prompt_key: str = Field("prompt", min_length=1, description="The field holding prompt text.")
    messages_key: str = Field(
        "messages", min_length=1, description="The field holding a chat ({role, content} list)."
    )
    label_key: str = Field(
        "label", min_length=1, description="The field holding the label reward functions see."
    )
    data_source_key: str = Field(
        "data_source",
        min_length=1,
        description="The field holding a row's data source (reward functions see it; the "
        "teacher model whose route_keys name it scores the row's samples).",
    )
    seed: int = Field(0, description="Seed of prompt shuffling and built-in task generation.")

    @field_validator("dataset")
    @classmethod
    def _dataset_known(cls, dataset: str) -> str:
        if dataset.startswith("builtin:") and dataset[8:] not in BUILTIN_DATASETS:
            raise ValueError(
                f"unknown built-in dataset {dataset!r}; choose one of "
                + ", ".join(f"builtin:{d}" for d in BUILTIN_DATASETS)
                + " or give a .jsonl or .parquet file or a dataset directory"
            )
        if dataset.startswith(PREFIX):
            return dataset
        suffix = Path(dataset).suffix
        if not dataset.startswith("builtin:") and suffix not in ("", ".jsonl", ".parquet"):
            raise ValueError(
                f"{dataset!r} is neither builtin:NAME, a .jsonl or .parquet file nor a directory"
            )
        return dataset

    @model_validator(mode="after")
    def _mapping_acts(self) -> PromptSource:
        """Keys and splits that the dataset would never read are refused."""
        mapping = {"prompt_key", "messages_key", "label_key"} & self.model_fields_set
        named = sorted(mapping | {"split"} & self.model_fields_set)
        if self.dataset.startswith("builtin:") and named:
            fields = ", ".join(f"{self.where}.{name}" for name in named)
            raise ValueError(
                f"{fields} names fields of a dataset file; {self.dataset} has its own: remove it"
            )
        if self.dataset.startswith(PREFIX):
            self._no_file_fields(named)
        elif self.reasoning_gym is not None:
            raise ValueError(
                f"{self.where}.reasoning_gym configures a reasoning_gym:... dataset; "
                f"{self.dataset} is not one: remove it"
            )
        if "split" in self.model_fields_set and Path(self.dataset).suffix:
            raise ValueError(
                f"{self.where}.split selects a split of a dataset directory; {self.dataset} is "
                f"one file: remove {self.where}.split"
            )
        return self

    def _no_file_fields(self, named: list[str]) -> None:
        """A reasoning-gym dataset has no file fields (its tasks are checked against the
        library by ``rl/inputs.py``, before any process starts)."""
        if named:
            fields = ", ".join(f"{self.where}.{name}" for name in named)
            raise ValueError(f"{fields} names fields of a dataset file; {self.dataset}: remove it")


class DataConfig(PromptSource):
    """Where the training prompts come from and how long prompts and responses may be."""

    prompts_per_step: int = Field(4, ge=1, description="Prompts drawn per RL step.")
    max_prompt_tokens: int = Field(256, ge=1, description="Longest prompt, in tokens.")
    max_response_tokens: int = Field(128, ge=1, description="Longest sampled response, in tokens.")
    shuffle: bool = Field(True, description="Shuffle prompts (deterministically from seed).")


class EvalData(PromptSource):
    """The held-out prompts: a data section's source, read in file order."""

    where: ClassVar[str] = "eval.data"

    dataset: str = Field(description="Held-out prompts, in any data.dataset form.")
    split: str = Field("test", description="The split of a dataset directory.")
    seed: int = Field(
        1, description="Seed of a built-in task's prompts (data.seed draws the training ones)."
    )


class SamplingConfig(Section):
    """How responses are sampled."""

    n_samples: int = Field(1, ge=1, description="Samples per prompt.")
    temperature: float = Field(
        0.0, ge=0, description="Sampling temperature; 0: greedy (then n_samples must be 1)."
    )
    max_response_tokens: int | None = Field(
        None, ge=1, description="Longest response; unset: data.max_response_tokens."
    )

    @model_validator(mode="after")
    def _greedy_is_one_sample(self) -> SamplingConfig:
        if self.temperature == 0 and self.n_samples > 1:
            raise ValueError(
                f"temperature=0 is greedy: its {self.n_samples} samples would be the same; "
                "set n_samples=1 or a temperature > 0"
            )
        return self


class EvalConfig(Section):
    """Periodic evaluation on held-out prompts with the rollout engines' current weights."""

    data: EvalData = Field(description="The held-out prompts (dataset, split, keys, seed).")
    sampling: SamplingConfig = Field(
        default_factory=SamplingConfig, description="How eval responses are sampled (greedy)."
    )
    max_prompts: int | None = Field(
        None, ge=1, description="Evaluate the first this-many prompts (file order); unset: all."
    )
    every_steps: int = Field(
        0,
        ge=0,
        description="Evaluate after every this-many steps, and after the last; 0: only "
        "after the last.",
    )
    before_training: bool = Field(
        False,
        description="Also evaluate the starting weights before the first step (metrics.jsonl's "
        "step-0 row, eval scores only); a resumed run does not. Decoupled placement only, "
        "not with algorithm.max_staleness.",
    )
    pass_threshold: float = Field(
        1.0, description="A sample whose summed reward reaches this passes (for pass@k)."
    )
    pass_k: tuple[int, ...] = Field(
        (1,), description="The k of each reported pass@k (unbiased estimate, each <= n_samples)."
    )

    @model_validator(mode="after")
    def _pass_k_in_range(self) -> EvalConfig:
        n = self.sampling.n_samples
        if not self.pass_k or any(k < 1 or k > n for k in self.pass_k):
            raise ValueError(
                f"eval.pass_k={list(self.pass_k)} needs each k in 1..eval.sampling.n_samples={n}"
            )
        return self
