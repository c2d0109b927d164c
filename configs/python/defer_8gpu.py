"""8 GPUs in defer mode (configs/defer_8gpu.yaml) in Python."""

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
    name="defer-8gpu",
    cluster=ClusterConfig(nnodes=1, nproc_per_node=8, device="cuda"),
    placement=PlacementConfig(mode="defer"),
    trainer=TrainerConfig(model=QWEN3_8B, tp_size=4, micro_batch_size=4),
    rollout=RolloutConfig(ranks=8, ranks_per_engine=2),
    teacher=TeacherConfig(model=QWEN3_32B, ranks=8, ranks_per_engine=4),
    genrm=GenRMConfig(model=QWEN3_8B, ranks=4, ranks_per_engine=4),
    algorithm=AlgorithmConfig(num_steps=200, n_samples_per_prompt=8, distill_coef=0.1),
    data=math_data(prompts_per_step=32, max_response_tokens=2048),
    reward=ANSWER_AND_JUDGE,
)
