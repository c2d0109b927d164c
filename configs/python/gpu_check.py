"""The job of scripts/gpu_check.sh (configs/gpu_check.yaml) written with the Python API."""

from relax_launch.config import (
    AlgorithmConfig,
    ClusterConfig,
    DataConfig,
    JobConfig,
    PlacementConfig,
    RewardConfig,
    RewardSource,
    RolloutConfig,
    TrainerConfig,
)

config = JobConfig(
    name="gpu-check",
    cluster=ClusterConfig(nnodes=1, nproc_per_node=2, device="cuda"),
    placement=PlacementConfig(mode="decoupled"),
    trainer=TrainerConfig(
        model="builtin:smollm2-135m-instruct",
        ranks=1,
        dtype="float32",
        lr=1e-5,
        micro_batch_size=4,
    ),
    rollout=RolloutConfig(ranks=1, engine={"mem_fraction_static": 0.5}),
    algorithm=AlgorithmConfig(num_steps=2, n_samples_per_prompt=4, temperature=0.7),
    data=DataConfig(
        dataset="builtin:arithmetic",
        prompts_per_step=4,
        max_prompt_tokens=128,
        max_response_tokens=32,
    ),
    reward=RewardConfig(sources=(RewardSource(name="answer", function="builtin:exact_numeric"),)),
)
