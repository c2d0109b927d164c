"""Qwen3-8B on 2 x 8 GPUs, decoupled (configs/qwen3_8b_decoupled_2x8.yaml) in Python: one step
off-policy, longer responses."""

from base import QWEN3_8B, QWEN3_32B, math_data, qwen3_8b_trainer, qwen3_math

from relax_launch.config import (
    AlgorithmConfig,
    GenRMConfig,
    RolloutConfig,
    TeacherConfig,
)

config = qwen3_math(
    "qwen3-8b-decoupled",
    nnodes=2,
    mode="decoupled",
    trainer=qwen3_8b_trainer(lr=1e-6),
    rollout=RolloutConfig(ranks=4, tp_size=2),
    genrm=GenRMConfig(model=QWEN3_8B, ranks=2, tp_size=2),
    teacher=TeacherConfig(model=QWEN3_32B, ranks=2, tp_size=2),
    algorithm=AlgorithmConfig(
        num_steps=500, n_samples_per_prompt=8, distill_coef=0.1, off_policy_steps=1
    ),
    data=math_data(prompts_per_step=64, max_response_tokens=4096),
)
