"""Qwen3-8B on 2 x 8 GPUs, decoupled (configs/qwen3_8b_decoupled_2x8.yaml) in Python."""

from _gpu_common import ANSWER_AND_JUDGE, QWEN3_8B, QWEN3_32B, math_data

from relax_launch.config import (
    AlgorithmConfig,
    ClusterConfig,
    GenRMConfig,
    JobConfig,
    PlacementConfig,
    RolloutConfig,
    TeacherConfig,
    TrainerConfig,
)

config = JobConfig(
    name="qwen3-8b-decoupled",
    cluster=ClusterConfig(nnodes=2, nproc_per_node=8, device="cuda"),
    placement=PlacementConfig(mode="decoupled"),
    trainer=TrainerConfig(model=QWEN3_8B, ranks=8, tp_size=4, lr=1e-6, micro_batch_size=4),
    rollout=RolloutConfig(ranks=4, ranks_per_engine=2, engine={"mem_fraction_static": 0.85}),
    genrm=GenRMConfig(model=QWEN3_8B, ranks=2, ranks_per_engine=2),
    teacher=TeacherConfig(model=QWEN3_32B, ranks=2, ranks_per_engine=2),
    algorithm=AlgorithmConfig(
        num_steps=500, n_samples_per_prompt=8, distill_coef=0.1, off_policy_steps=1
    ),
    data=math_data(prompts_per_step=64, max_response_tokens=4096),
    reward=ANSWER_AND_JUDGE,
)
