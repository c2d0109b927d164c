"""Prefill/decode disaggregation on one CPU machine (configs/pd_cpu.yaml) written with the
Python API: a tiny random Llama's rollout served by a prefill engine and a decode engine."""

from base import cpu, cpu_engines, quickstart, trainer

from relax_launch.config import AlgorithmConfig, PrefillConfig, RolloutConfig

config = quickstart(
    "pd-cpu",
    cluster=cpu(3),
    trainer=trainer(ranks=1, model="builtin:tiny-llama", lr=1e-3),
    rollout=cpu_engines(
        RolloutConfig, model=None, max_total_tokens=2048, prefill=PrefillConfig(ranks=1)
    ),
    teacher=None,
    algorithm=AlgorithmConfig(num_steps=3, n_samples_per_prompt=4, temperature=0.7),
)
