"""Qwen3-30B-A3B on 2 x 8 GPUs, decoupled, experts split over 4 EP ranks of TP 2 with the
distributed optimizer and full recomputation, with routing replay
(configs/qwen3_30b_a3b_moe_2x8.yaml) in Python."""

from base import ANSWER, math_data, qwen3_math

from relax_launch.config import AlgorithmConfig, RewardConfig, RolloutConfig, TrainerConfig

config = qwen3_math(
    "qwen3-30b-a3b-moe",
    nnodes=2,
    mode="decoupled",
    trainer=TrainerConfig(
        model="/models/Qwen3-30B-A3B",
        ranks=8,
        tp_size=2,
        ep_size=4,
        lr=1e-6,
        micro_batch_size=1,
        distributed_optimizer=True,
        recompute="full",
    ),
    rollout=RolloutConfig(ranks=8, tp_size=4),
    algorithm=AlgorithmConfig(num_steps=200, n_samples_per_prompt=8, routing_replay=True),
    data=math_data(prompts_per_step=32, max_response_tokens=4096),
    reward=RewardConfig(sources=(ANSWER,)),
)
