"""Qwen3-8B on 2 x 8 GPUs with prefill/decode disaggregation and pipeline-parallel engines
(configs/qwen3_8b_pd_pp_2x8.yaml) in Python."""

from base import QWEN3_32B, qwen3_8b_trainer, qwen3_math, rewards

from relax_launch.config import PrefillConfig, RolloutConfig, TeacherConfig

config = qwen3_math(
    "qwen3-8b-pd-pp",
    nnodes=2,
    mode="decoupled",
    trainer=qwen3_8b_trainer(lr=1e-6),
    rollout=RolloutConfig(
        ranks=4,
        tp_size=2,
        prefill=PrefillConfig(ranks=2, tp_size=2),
    ),
    teacher=TeacherConfig(model=QWEN3_32B, ranks=2, pp_size=2),
    reward=rewards(),
)
