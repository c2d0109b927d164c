"""The job of scripts/gpu_check.sh (configs/gpu_check.yaml) written with the Python API: the
quickstart's model on one GPU's two ranks, trainer and one rollout engine."""

from base import arithmetic, quickstart, trainer

from relax_launch.config import AlgorithmConfig, ClusterConfig, RolloutConfig

config = quickstart(
    "gpu-check",
    cluster=ClusterConfig(nnodes=1, nproc_per_node=2, device="cuda"),
    trainer=trainer(ranks=1),
    rollout=RolloutConfig(ranks=1, engine={"mem_fraction_static": 0.5}),
    teacher=None,
    algorithm=AlgorithmConfig(num_steps=2, n_samples_per_prompt=4, temperature=0.7),
    data=arithmetic(max_response_tokens=32),
)
