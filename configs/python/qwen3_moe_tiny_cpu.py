"""A tiny random Qwen3-MoE with its experts split over two trainer ranks and routing replay
(configs/qwen3_moe_tiny_cpu.yaml) written with the Python API."""

from base import cpu, cpu_engines, quickstart, trainer

from relax_launch.config import AlgorithmConfig, RolloutConfig

config = quickstart(
    "qwen3-moe-tiny-cpu",
    cluster=cpu(3),
    trainer=trainer(ranks=2, model="builtin:tiny-qwen3-moe", lr=1e-3, ep_size=2),
    rollout=cpu_engines(RolloutConfig, model=None, max_total_tokens=2048),
    teacher=None,
    algorithm=AlgorithmConfig(
        num_steps=3, n_samples_per_prompt=4, temperature=0.7, routing_replay=True
    ),
)
