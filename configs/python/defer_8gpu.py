"""8 GPUs in defer mode (configs/defer_8gpu.yaml) in Python: every role on all 8 GPUs, in
turns."""

from base import QWEN3_8B, QWEN3_32B, qwen3_math

from relax_launch.config import GenRMConfig, RolloutConfig, TeacherConfig, TrainerConfig

config = qwen3_math(
    "defer-8gpu",
    nnodes=1,
    mode="defer",
    trainer=TrainerConfig(
        model=QWEN3_8B, tp_size=4, micro_batch_size=2, distributed_optimizer=True
    ),
    rollout=RolloutConfig(ranks=8, tp_size=2),
    teacher=TeacherConfig(model=QWEN3_32B, ranks=8, tp_size=4),
    genrm=GenRMConfig(model=QWEN3_8B, ranks=4, tp_size=4),
)
