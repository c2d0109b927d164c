"""8 GPUs in split mode (configs/split_8gpu.yaml) in Python: the trainer on all 8, each engine
role on its own share of them."""

from base import QWEN3_8B, QWEN3_32B, qwen3_math

from relax_launch.config import GenRMConfig, RolloutConfig, TeacherConfig, TrainerConfig

config = qwen3_math(
    "split-8gpu",
    nnodes=1,
    mode="split",
    trainer=TrainerConfig(
        model=QWEN3_8B, tp_size=2, micro_batch_size=1, distributed_optimizer=True
    ),
    rollout=RolloutConfig(ranks=4, tp_size=2),
    genrm=GenRMConfig(model=QWEN3_8B, ranks=2, tp_size=2),
    teacher=TeacherConfig(model=QWEN3_32B, ranks=2, tp_size=2),
)
