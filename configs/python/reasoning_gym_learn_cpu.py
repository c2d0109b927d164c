"""A reasoning-gym task learned end to end on the CPU (configs/reasoning_gym_learn_cpu.yaml)
written with the Python API: chain_sum, the number alone as the answer, held-out accuracy
before the first step and every 10 steps."""

from base import cpu, cpu_engines, quickstart, trainer

from relax_launch.config import AlgorithmConfig, DataConfig, RewardConfig, RolloutConfig
from relax_launch.config import RewardSource as Source

TASK = "reasoning_gym:chain_sum"
CHAIN_SUM = {
    "size": 240,
    "tasks": {"chain_sum": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}},
    "answer_format": "Answer with just the number.",
    "answer_pattern": r"(-?\d+)",
}

config = quickstart(
    "reasoning-gym-learn-cpu",
    cluster=cpu(2),
    trainer=trainer(ranks=1, micro_batch_size=8),
    rollout=cpu_engines(RolloutConfig, model=None),
    teacher=None,
    algorithm=AlgorithmConfig(num_steps=20, n_samples_per_prompt=4, temperature=0.8),
    data=DataConfig(
        dataset=TASK,
        reasoning_gym=CHAIN_SUM,
        prompts_per_step=8,
        max_prompt_tokens=128,
        max_response_tokens=32,
    ),
    reward=RewardConfig(sources=(Source(name="task", function="builtin:reasoning_gym"),)),
    eval={
        "before_training": True,
        "data": {"dataset": TASK, "seed": 1, "reasoning_gym": CHAIN_SUM | {"size": 96}},
        "every_steps": 10,
    },
)
