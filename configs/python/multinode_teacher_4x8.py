"""4 x 8 GPUs with a two-node teacher engine (configs/multinode_teacher_4x8.yaml) in Python."""

from _gpu_common import ANSWER, QWEN3_8B, math_data

from relax_launch.config import (
    AlgorithmConfig,
    ClusterConfig,
    JobConfig,
    PlacementConfig,
    RewardConfig,
    RolloutConfig,
    TeacherConfig,
    TrainerConfig,
)

config = JobConfig(
    name="multinode-teacher",
    cluster=ClusterConfig(nnodes=4, nproc_per_node=8, device="cuda"),
    placement=PlacementConfig(mode="decoupled"),
    trainer=TrainerConfig(model=QWEN3_8B, ranks=8, tp_size=4, micro_batch_size=4),
    rollout=RolloutConfig(ranks=8, ranks_per_engine=2),
    teacher=TeacherConfig(
        model="/models/Qwen3-235B-A22B", ranks=16, ranks_per_engine=16, tp_size=8, pp_size=2
    ),
    algorithm=AlgorithmConfig(
        num_steps=500, n_samples_per_prompt=8, distill_coef=0.5, off_policy_steps=1
    ),
    data=math_data(prompts_per_step=64, max_response_tokens=4096),
    reward=RewardConfig(sources=(ANSWER,)),
)
