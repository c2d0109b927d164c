"""On-policy distillation on the CPU (configs/distill_cpu.yaml) written with the Python API: a
smaller student learns from SmolLM2-135M-Instruct."""

from base import arithmetic, quickstart, trainer

from relax_launch.config import AlgorithmConfig

config = quickstart(
    "distill-cpu",
    trainer=trainer(ranks=2, model="builtin:smollm2-student", lr=1e-4, micro_batch_size=2),
    algorithm=AlgorithmConfig(num_steps=8, n_samples_per_prompt=4, distill_coef=1.0),
    data=arithmetic(max_response_tokens=32),
)
