"""Rollout, teacher and GenRM on one CPU machine (configs/three_roles_cpu.yaml) with the Python
API: one step off-policy, with a KL penalty to the initial policy."""

from base import arithmetic, cpu_engines, quickstart, rewards, trainer

from relax_launch.config import AlgorithmConfig, GenRMConfig

config = quickstart(
    "three-roles-cpu",
    trainer=trainer(ranks=1, micro_batch_size=2),
    genrm=cpu_engines(GenRMConfig),
    algorithm=AlgorithmConfig(
        num_steps=6, n_samples_per_prompt=4, distill_coef=0.01, kl_coef=0.02, off_policy_steps=1
    ),
    data=arithmetic(prompts_per_step=2, max_response_tokens=32),
    reward=rewards(judge=True, fallback=0.0),
)
