"""Agentic RL on the CPU (configs/agentic_cpu.yaml) written with the Python API: conversations
with a calculator tool, on 2 ranks, no teacher."""

from base import cpu, cpu_engines, quickstart, trainer

from relax_launch.config import AlgorithmConfig, DataConfig, RolloutConfig

config = quickstart(
    "agentic-cpu",
    cluster=cpu(2),
    trainer=trainer(ranks=1),
    rollout=cpu_engines(RolloutConfig, model=None, function="builtin:calculator"),
    teacher=None,
    algorithm=AlgorithmConfig(num_steps=6, n_samples_per_prompt=4, temperature=0.7),
    data=DataConfig(
        dataset="builtin:word_problems",
        prompts_per_step=4,
        max_prompt_tokens=160,
        max_response_tokens=96,
    ),
)
