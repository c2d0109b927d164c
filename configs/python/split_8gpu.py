"""8 GPUs in split mode (configs/split_8gpu.yaml) in Python."""

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
    name="split-8gpu",
    cluster=ClusterConfig(nnodes=1, nproc_per_node=8, device="cuda"),
    placement=PlacementConfig(mode="split"),
    trainer=TrainerConfig(model=QWEN3_8B, tp_size=2, micro_batch_size=2),
    rollout=RolloutConfig(ranks=4, ranks_per_engine=2),
    genrm=GenRMConfig(model=QWEN3_8B, ranks=2, ranks_per_engine=2),
    teacher=TeacherConfig(model=QWEN3_32B, ranks=2, ranks_per_engine=2),
    algorithm=AlgorithmConfig(num_steps=200, n_samples_per_prompt=8, distill_coef=0.1),
    data=math_data(prompts_per_step=32, max_response_tokens=2048),
    reward=ANSWER_AND_JUDGE,
)
