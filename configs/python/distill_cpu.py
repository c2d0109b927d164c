"""On-policy distillation on the CPU (configs/distill_cpu.yaml) written with the Python API."""

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

ENGINE = {"max_total_tokens": 8192}

config = JobConfig(
    name="distill-cpu",
    cluster=ClusterConfig(nnodes=1, nproc_per_node=4, device="cpu"),
    placement=PlacementConfig(mode="decoupled"),
    trainer=TrainerConfig(
        model="builtin:smollm2-student", ranks=2, dtype="float32", lr=1e-4, micro_batch_size=2
    ),
    rollout=RolloutConfig(ranks=1, engine=ENGINE),
    teacher=TeacherConfig(model="builtin:smollm2-135m-instruct", ranks=1, engine=ENGINE),
    algorithm=AlgorithmConfig(num_steps=8, n_samples_per_prompt=4, distill_coef=1.0),
    data=DataConfig(
        dataset="builtin:arithmetic",
        prompts_per_step=4,
        max_prompt_tokens=128,
        max_response_tokens=32,
    ),
    reward=RewardConfig(sources=(RewardSource(name="answer", function="builtin:exact_numeric"),)),
)
