"""reasoning-gym tasks on the CPU (configs/reasoning_gym_cpu.yaml) written with the Python API:
two procedural tasks scored by their own score_answer and by math-verify, on 2 ranks."""

from base import cpu, cpu_engines, quickstart, trainer

from relax_launch.config import AlgorithmConfig, DataConfig, RewardConfig, RolloutConfig
from relax_launch.config import RewardSource as Source

TASKS = "reasoning_gym:chain_sum+basic_arithmetic"
TASK_CONFIG = {
    "chain_sum": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2},
    "basic_arithmetic": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1},
}

config = quickstart(
    "reasoning-gym-cpu",
    cluster=cpu(2),
    trainer=trainer(ranks=1),
    rollout=cpu_engines(RolloutConfig, model=None),
    teacher=None,
    algorithm=AlgorithmConfig(num_steps=12, n_samples_per_prompt=4, temperature=0.7),
    data=DataConfig(
        dataset=TASKS,
        reasoning_gym={"size": 500, "tasks": TASK_CONFIG},
        prompts_per_step=4,
        max_prompt_tokens=192,
        max_response_tokens=64,
    ),
    reward=RewardConfig(
        sources=(
            Source(name="task", function="builtin:reasoning_gym"),
            Source(name="math", function="builtin:math_verify", timeout_s=5, weight=0.5),
        )
    ),
    eval={
        "data": {"dataset": TASKS, "reasoning_gym": {"size": 16, "tasks": TASK_CONFIG}},
        "every_steps": 6,
    },
)
