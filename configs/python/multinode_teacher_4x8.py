"""4 x 8 GPUs with a two-node teacher engine (configs/multinode_teacher_4x8.yaml) in Python:
the teacher is one engine of TP 8 x PP 2 over nodes 2-3."""

from base import math_data, qwen3_8b_trainer, qwen3_math, rewards

from relax_launch.config import AlgorithmConfig, RolloutConfig, TeacherConfig

config = qwen3_math(
    "multinode-teacher",
    nnodes=4,
    mode="decoupled",
    trainer=qwen3_8b_trainer(),
    rollout=RolloutConfig(ranks=8, tp_size=2),
    teacher=TeacherConfig(model="/models/Qwen3-235B-A22B", ranks=16, tp_size=8, pp_size=2),
    algorithm=AlgorithmConfig(
        num_steps=500, n_samples_per_prompt=8, distill_coef=0.5, off_policy_steps=1
    ),
    data=math_data(prompts_per_step=64, max_response_tokens=4096),
    reward=rewards(),
)
