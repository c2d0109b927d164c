"""Rollout + Teacher + GenRM on the CPU (configs/three_roles_cpu.yaml) with the Python API."""

from relax_launch.config import (
    AlgorithmConfig,
    ClusterConfig,
    DataConfig,
    GenRMConfig,
    JobConfig,
    PlacementConfig,
    RewardConfig,
    RewardSource,
    RolloutConfig,
    TeacherConfig,
    TrainerConfig,
)

SMOLLM2 = "builtin:smollm2-135m-instruct"
ENGINE = {"max_total_tokens": 8192}

config = JobConfig(
    name="three-roles-cpu",
    cluster=ClusterConfig(nnodes=1, nproc_per_node=4, device="cpu"),
    placement=PlacementConfig(mode="decoupled"),
    trainer=TrainerConfig(model=SMOLLM2, ranks=1, dtype="float32", lr=1e-5, micro_batch_size=2),
    rollout=RolloutConfig(ranks=1, engine=ENGINE),
    teacher=TeacherConfig(model=SMOLLM2, ranks=1, engine=ENGINE),
    genrm=GenRMConfig(model=SMOLLM2, ranks=1, engine=ENGINE),
    algorithm=AlgorithmConfig(
        num_steps=6, n_samples_per_prompt=4, distill_coef=0.01, kl_coef=0.02, off_policy_steps=1
    ),
    data=DataConfig(
        dataset="builtin:arithmetic",
        prompts_per_step=2,
        max_prompt_tokens=128,
        max_response_tokens=32,
    ),
    reward=RewardConfig(
        sources=(
            RewardSource(name="answer", function="builtin:exact_numeric"),
            RewardSource(name="judge", genrm=True, weight=0.5, fallback=0.0),
        )
    ),
)
