"""Qwen2.5-VL-7B-Instruct on one node of 8 GPUs, decoupled
(configs/qwen2_5_vl_7b_decoupled_8gpu.yaml) in Python: RL with images, the whole model trained,
rollout engines reading images as the trainer does."""

from base import qwen3_math

from relax_launch.config import (
    AlgorithmConfig,
    DataConfig,
    RewardConfig,
    RewardSource,
    RolloutConfig,
    TrainerConfig,
)

config = qwen3_math(
    "qwen2.5-vl-7b-decoupled",
    nnodes=1,
    mode="decoupled",
    trainer=TrainerConfig(
        model="/models/Qwen2.5-VL-7B-Instruct",
        ranks=4,
        tp_size=2,
        lr=1e-6,
        micro_batch_size=1,
        distributed_optimizer=True,
        recompute="full",
    ),
    rollout=RolloutConfig(ranks=4, tp_size=1, engine={"image_processor_backend": "pil"}),
    algorithm=AlgorithmConfig(num_steps=300, n_samples_per_prompt=8),
    data=DataConfig(
        dataset="/data/geo3k_train.parquet",
        prompts_per_step=32,
        max_prompt_tokens=1024,
        max_response_tokens=2048,
    ),
    reward=RewardConfig(sources=(RewardSource(name="answer", function="builtin:exact_numeric"),)),
)
