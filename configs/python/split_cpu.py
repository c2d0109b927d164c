"""placement.mode=split on the CPU (configs/split_cpu.yaml) with the Python API."""

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
    name="split-cpu",
    cluster=ClusterConfig(nnodes=1, nproc_per_node=3, device="cpu"),
    placement=PlacementConfig(mode="split"),
    trainer=TrainerConfig(model=SMOLLM2, dtype="float32", lr=1e-5, micro_batch_size=2),
    rollout=RolloutConfig(ranks=1, engine=ENGINE),
    teacher=TeacherConfig(model=SMOLLM2, ranks=1, engine=ENGINE),
    genrm=GenRMConfig(model=SMOLLM2, ranks=1, engine=ENGINE),
    algorithm=AlgorithmConfig(
        num_steps=12, n_samples_per_prompt=4, temperature=0.7, distill_coef=0.01
    ),
    data=DataConfig(
        dataset="builtin:arithmetic",
        prompts_per_step=3,
        max_prompt_tokens=128,
        max_response_tokens=16,
    ),
    reward=RewardConfig(
        sources=(
            RewardSource(name="answer", function="builtin:exact_numeric"),
            RewardSource(name="judge", genrm=True, weight=0.5, fallback=0.0),
        )
    ),
)
