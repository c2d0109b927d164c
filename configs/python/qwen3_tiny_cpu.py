"""The CPU quickstart's loop on a tiny random Qwen3 (configs/qwen3_tiny_cpu.yaml) written with
the Python API."""

from relax_launch.config import (
    AlgorithmConfig,
    ClusterConfig,
    DataConfig,
    JobConfig,
    PlacementConfig,
    RewardConfig,
    RewardSource,
    RolloutConfig,
    TeacherConfig,
    TrainerConfig,
)

TINY_QWEN3 = "builtin:tiny-qwen3"
ENGINE = {"max_total_tokens": 2048}

config = JobConfig(
    name="qwen3-tiny-cpu",
    cluster=ClusterConfig(nnodes=1, nproc_per_node=4, device="cpu"),
    placement=PlacementConfig(mode="decoupled"),
    trainer=TrainerConfig(model=TINY_QWEN3, ranks=2, dtype="float32", lr=1e-3, micro_batch_size=4),
    rollout=RolloutConfig(ranks=1, engine=ENGINE),
    teacher=TeacherConfig(model=TINY_QWEN3, ranks=1, engine=ENGINE),
    algorithm=AlgorithmConfig(
        num_steps=3, n_samples_per_prompt=4, temperature=0.7, distill_coef=0.01
    ),
    data=DataConfig(
        dataset="builtin:arithmetic",
        prompts_per_step=4,
        max_prompt_tokens=128,
        max_response_tokens=16,
    ),
    reward=RewardConfig(sources=(RewardSource(name="answer", function="builtin:exact_numeric"),)),
)
