"""Agentic RL on the CPU (configs/agentic_cpu.yaml) written with the Python API."""

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
    name="agentic-cpu",
    cluster=ClusterConfig(nnodes=1, nproc_per_node=2, device="cpu"),
    placement=PlacementConfig(mode="decoupled"),
    trainer=TrainerConfig(
        model="builtin:smollm2-135m-instruct",
        ranks=1,
        dtype="float32",
        lr=1e-5,
        micro_batch_size=4,
    ),
    rollout=RolloutConfig(
        ranks=1, function="builtin:calculator", engine={"max_total_tokens": 8192}
    ),
    algorithm=AlgorithmConfig(num_steps=6, n_samples_per_prompt=4, temperature=0.7),
    data=DataConfig(
        dataset="builtin:word_problems",
        prompts_per_step=4,
        max_prompt_tokens=160,
        max_response_tokens=96,
    ),
    reward=RewardConfig(sources=(RewardSource(name="answer", function="builtin:exact_numeric"),)),
)
