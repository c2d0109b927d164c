"""The CPU quickstart's loop on a tiny random Qwen3 (configs/qwen3_tiny_cpu.yaml) written with
the Python API."""

from base import cpu_engines, quickstart, trainer

from relax_launch.config import AlgorithmConfig, RolloutConfig, TeacherConfig

TINY_QWEN3 = "builtin:tiny-qwen3"

config = quickstart(
    "qwen3-tiny-cpu",
    trainer=trainer(ranks=2, model=TINY_QWEN3, lr=1e-3),
    rollout=cpu_engines(RolloutConfig, model=None, max_total_tokens=2048),
    teacher=cpu_engines(TeacherConfig, model=TINY_QWEN3, max_total_tokens=2048),
    algorithm=AlgorithmConfig(
        num_steps=3, n_samples_per_prompt=4, temperature=0.7, distill_coef=0.01
    ),
)
