"""What the example configs share, torchtitan style: a base job per family and the sections
they are made of; each example states only what makes it different from its base.

- ``quickstart``: the CPU quickstart's job (SmolLM2-135M on 4 ranks, decoupled).
- ``qwen3_math``: the GPU examples' job (Qwen3-8B on math prompts, 8 GPUs a node).
"""

from __future__ import annotations

from typing import Any, TypeVar

from relax_launch.config import (
    AlgorithmConfig,
    ClusterConfig,
    DataConfig,
    InferenceRoleConfig,
    JobConfig,
    PlacementConfig,
    RewardConfig,
    RewardSource,
    RolloutConfig,
    TeacherConfig,
    TrainerConfig,
)

Role = TypeVar("Role", bound=InferenceRoleConfig)

SMOLLM2 = "builtin:smollm2-135m-instruct"
QWEN3_8B = "/models/Qwen3-8B"
QWEN3_32B = "/models/Qwen3-32B"
ANSWER = RewardSource(name="answer", function="builtin:exact_numeric")


def rewards(judge: bool = False, **judge_fields: Any) -> RewardConfig:
    """The exact numeric answer; with ``judge``, plus the GenRM's score at half weight."""
    if not judge:
        return RewardConfig(sources=(ANSWER,))
    return RewardConfig(
        sources=(ANSWER, RewardSource(name="judge", genrm=True, weight=0.5, **judge_fields))
    )


# ---- the CPU quickstart's family ----------------------------------------------------------


def cpu(nproc_per_node: int) -> ClusterConfig:
    return ClusterConfig(nnodes=1, nproc_per_node=nproc_per_node, device="cpu")


def trainer(ranks: int | None = None, **fields: Any) -> TrainerConfig:
    """SmolLM2 trained in float32 (``ranks`` unset: every rank, as colocated jobs have it)."""
    base = {"model": SMOLLM2, "dtype": "float32", "lr": 1e-5, "micro_batch_size": 4}
    return TrainerConfig(**base | ({"ranks": ranks} if ranks else {}) | fields)


def cpu_engines(
    role: type[Role], model: str | None = SMOLLM2, max_total_tokens: int = 8192, **fields: Any
) -> Role:
    """One CPU engine of ``role`` (SGLang's CPU engine needs its token budget stated); the
    rollout's model is the trainer's (``model=None``)."""
    named = {"model": model} if model else {}
    return role(**{"ranks": 1} | named | fields, engine={"max_total_tokens": max_total_tokens})


def arithmetic(**fields: Any) -> DataConfig:
    base = {
        "dataset": "builtin:arithmetic",
        "prompts_per_step": 4,
        "max_prompt_tokens": 128,
        "max_response_tokens": 16,
    }
    return DataConfig(**base | fields)


def quickstart(name: str, **sections: Any) -> JobConfig:
    """The CPU quickstart: ranks 0-1 the trainer (data parallel 2), rank 2 the rollout engine,
    rank 3 a teacher (SmolLM2 itself, a small distillation term); 12 GRPO steps on
    arithmetic. ``sections`` replace its own (None removes one)."""
    base = {
        "cluster": cpu(4),
        "placement": PlacementConfig(mode="decoupled"),
        "trainer": trainer(ranks=2),
        "rollout": cpu_engines(RolloutConfig, model=None),
        "teacher": cpu_engines(TeacherConfig),
        "algorithm": AlgorithmConfig(
            num_steps=12, n_samples_per_prompt=4, temperature=0.7, distill_coef=0.01
        ),
        "data": arithmetic(),
        "reward": rewards(),
    }
    return JobConfig(name=name, **base | sections)


# ---- the GPU examples' family -------------------------------------------------------------


def math_data(prompts_per_step: int, max_response_tokens: int) -> DataConfig:
    return DataConfig(
        dataset="/data/math_prompts.jsonl",
        prompts_per_step=prompts_per_step,
        max_prompt_tokens=1024,
        max_response_tokens=max_response_tokens,
    )


def qwen3_8b_trainer(**fields: Any) -> TrainerConfig:
    """Qwen3-8B on a node's 8 GPUs (TP 4 x DP 2), 4 sequences of up to 5120 tokens a
    micro-batch: the distributed optimizer and full recomputation keep a GPU at 40 GB."""
    base = {"model": QWEN3_8B, "ranks": 8, "tp_size": 4, "micro_batch_size": 4}
    sharded = {"distributed_optimizer": True, "recompute": "full"}
    return TrainerConfig(**base | sharded | fields)


def qwen3_math(name: str, nnodes: int, mode: str, **sections: Any) -> JobConfig:
    """Qwen3-8B trained on math prompts over ``nnodes`` nodes of 8 GPUs in placement ``mode``:
    GRPO with 8 samples a prompt and a distillation term, rewarded by the answer and a judge.
    ``sections`` add the roles and replace the defaults."""
    base = {
        "cluster": ClusterConfig(nnodes=nnodes, nproc_per_node=8, device="cuda"),
        "placement": PlacementConfig(mode=mode),
        "algorithm": AlgorithmConfig(num_steps=200, n_samples_per_prompt=8, distill_coef=0.1),
        "data": math_data(prompts_per_step=32, max_response_tokens=2048),
        "reward": rewards(judge=True),
    }
    return JobConfig(name=name, **base | sections)
