"""JobConfig: the whole job, built from its components' sections, plus cross-section rules."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, model_validator

from relax_launch.config.section import Section
from relax_launch.inference.config import (
    GatewayConfig,
    GenRMConfig,
    InferenceRoleConfig,
    RolloutConfig,
    TeacherConfig,
)
from relax_launch.placement.config import ClusterConfig, PlacementConfig
from relax_launch.rl.config import AlgorithmConfig, DataConfig, RewardConfig
from relax_launch.runtime.config import CheckpointConfig, LoggingConfig
from relax_launch.trainer.config import TrainerConfig
from relax_launch.weights.config import WeightSyncConfig


class JobConfig(Section):
    """One relax-launch job. The same schema backs YAML files and the Python API."""

    name: str = Field(
        "relax-job", pattern=r"^[A-Za-z0-9_.-]+$", description="Job name (logs, run directory)."
    )
    cluster: ClusterConfig = Field(default_factory=ClusterConfig, description="Cluster shape.")
    placement: PlacementConfig = Field(
        default_factory=PlacementConfig, description="Placement mode."
    )
    trainer: TrainerConfig = Field(description="The Megatron-core trainer.")
    rollout: RolloutConfig = Field(
        default_factory=RolloutConfig, description="The rollout policy engines."
    )
    teacher: TeacherConfig | None = Field(None, description="Teacher engines; unset: no teacher.")
    genrm: GenRMConfig | None = Field(None, description="GenRM judge engines; unset: no judge.")
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig, description="Algorithm.")
    data: DataConfig = Field(default_factory=DataConfig, description="Prompt data.")
    reward: RewardConfig = Field(default_factory=RewardConfig, description="Reward sources.")
    weight_sync: WeightSyncConfig = Field(
        default_factory=WeightSyncConfig, description="Trainer -> rollout weight sync."
    )
    gateway: GatewayConfig = Field(default_factory=GatewayConfig, description="HTTP gateway.")
    checkpoint: CheckpointConfig = Field(
        default_factory=CheckpointConfig, description="Checkpoints."
    )
    logging: LoggingConfig = Field(default_factory=LoggingConfig, description="Logs and metrics.")

    def inference_roles(self) -> dict[str, InferenceRoleConfig]:
        """The configured inference roles, in placement order (rollout, genrm, teacher)."""
        roles = {"rollout": self.rollout, "genrm": self.genrm, "teacher": self.teacher}
        return {name: cfg for name, cfg in roles.items() if cfg is not None}

    @property
    def log_dir(self) -> Path:
        """The run directory: logging.dir with {name} filled in."""
        return Path(self.logging.dir.format(name=self.name))

    def engine_dtype(self, role: str) -> str:
        """The one precision decision for a role's engines: its engine.dtype, else the trainer's
        dtype (so the rollout policy's logprobs match the trainer's)."""
        return self.inference_roles()[role].engine.get("dtype", self.trainer.dtype)

    def precision_notice(self) -> str | None:
        """Said once before a run whose rollout engines compute at another precision than the
        trainer: PPO's old logprobs come from the engines, so the ratios start away from 1."""
        if self.engine_dtype("rollout") == self.trainer.dtype:
            return None
        return (
            f"rollout.engine.dtype={self.rollout.engine['dtype']} differs from trainer.dtype="
            f"{self.trainer.dtype}: the engines' logprobs (PPO's old logprobs) and the trainer's "
            "differ by the precision gap, so importance ratios start away from 1 and the clip "
            "range absorbs part of it; remove rollout.engine.dtype for exact parity."
        )

    def rollout_model(self) -> str:
        """The rollout engines' model: rollout.model, or the trainer's."""
        return self.rollout.model or self.trainer.model

    @model_validator(mode="after")
    def _cross_section_rules(self) -> JobConfig:
        problems = _role_usage_problems(self) + _colocation_problems(self) + _engine_problems(self)
        problems += _batch_problems(self) + _fault_tolerance_problems(self)
        if problems:
            raise ValueError("\n".join(problems))
        return self


def _role_usage_problems(job: JobConfig) -> list[str]:
    problems = []
    if job.teacher is None and job.algorithm.distill_coef > 0:
        problems.append(
            "algorithm.distill_coef > 0 needs a teacher: add a teacher section with its model, "
            "or set algorithm.distill_coef=0."
        )
    if job.teacher is not None and job.algorithm.distill_coef == 0:
        problems.append(
            "teacher is configured but algorithm.distill_coef is 0, so its engines would idle: "
            "set algorithm.distill_coef > 0 or remove the teacher section."
        )
    if job.genrm is None and job.reward.uses_genrm:
        problems.append(
            "reward.sources has a genrm source but no genrm section: add genrm with its model, "
            "or drop that source."
        )
    if job.genrm is not None and not job.reward.uses_genrm:
        problems.append(
            "genrm is configured but no reward.sources entry has genrm: true, so its engines would "
            "idle: add a source {name: judge, genrm: true} or remove the genrm section."
        )
    return problems


def _colocation_problems(job: JobConfig) -> list[str]:
    mode = job.placement.mode
    if mode == "decoupled":
        if job.trainer.ranks is None:
            return [
                "trainer.ranks is required in placement.mode=decoupled (the trainer's own ranks)."
            ]
        if job.trainer.ranks < 1:
            return [f"trainer.ranks must be at least 1 (got {job.trainer.ranks})."]
        if "operation_timeout_s" in job.placement.model_fields_set:
            return [
                "placement.operation_timeout_s bounds the offloads and onloads between the phases "
                "of split/defer; placement.mode=decoupled has none: remove it."
            ]
        return []
    problems = []
    for name, role in job.inference_roles().items():
        # a colocated engine must give its memory back (a static model keeps a backup)
        required = ["enable_memory_saver"] + ["enable_weights_cpu_backup"] * (name != "rollout")
        refused = [flag for flag in required if role.engine.get(flag, True) is not True]
        if refused:
            problems.append(
                f"{name}.engine sets {', '.join(refused)} off, but placement.mode={mode} needs "
                "it: engines release their memory between phases. Remove it from the engine "
                "section (or use placement.mode=decoupled)."
            )
    if job.trainer.ranks is not None:
        problems.append(
            f"trainer.ranks is set but placement.mode={mode} puts the trainer on every rank: "
            "remove trainer.ranks (or use placement.mode=decoupled)."
        )
    if job.algorithm.off_policy_steps:
        problems.append(
            f"algorithm.off_policy_steps=1 overlaps generation with training, which "
            f"placement.mode={mode} cannot do (roles share ranks): set it to 0 or use decoupled."
        )
    return problems


ENGINE_DTYPES = ("bfloat16", "float16", "float32")


def _engine_problems(job: JobConfig) -> list[str]:
    problems = []
    for name, role in job.inference_roles().items():
        if role.engine.get("dtype", job.trainer.dtype) not in ENGINE_DTYPES:
            problems.append(
                f"{name}.engine.dtype={role.engine['dtype']!r} is not one of "
                f"{', '.join(ENGINE_DTYPES)}; unset, the engines run at trainer.dtype."
            )
        if job.cluster.device == "cpu" and "max_total_tokens" not in role.engine:
            problems.append(
                f"{name}.engine.max_total_tokens is required with cluster.device=cpu (SGLang "
                "would otherwise size its KV cache from host memory): set e.g. "
                f"{name}.engine.max_total_tokens=4096."
            )
        context = role.engine.get("context_length")
        needed = job.data.max_prompt_tokens + job.data.max_response_tokens
        if name == "rollout" and context is not None and context < needed:
            problems.append(
                f"rollout.engine.context_length={context} is shorter than data.max_prompt_tokens "
                f"+ data.max_response_tokens = {needed}: raise it or shorten the data limits."
            )
    return problems


def _batch_problems(job: JobConfig) -> list[str]:
    """A step's samples must split evenly over data-parallel ranks and micro-batches."""
    t = job.trainer
    ranks = t.ranks or job.cluster.nnodes * job.cluster.nproc_per_node
    if ranks % (t.tp_size * t.pp_size):
        return []  # the planner reports the trainer grid itself
    dp = ranks // (t.tp_size * t.pp_size)
    samples = job.data.prompts_per_step * job.algorithm.n_samples_per_prompt
    if samples % (dp * t.micro_batch_size):
        return [
            f"data.prompts_per_step x algorithm.n_samples_per_prompt = {samples} samples per step "
            f"do not split over {dp} data-parallel trainer ranks x trainer.micro_batch_size="
            f"{t.micro_batch_size}: make it a multiple of {dp * t.micro_batch_size}."
        ]
    return []


def _fault_tolerance_problems(job: JobConfig) -> list[str]:
    """What rollout.fault_tolerance needs: engines of their own, others to take over, and the
    controller choosing the engine."""
    if not job.rollout.fault_tolerance:
        return []
    needs = []
    if job.placement.mode != "decoupled":
        needs.append(f"placement.mode=decoupled (not {job.placement.mode})")
    if job.rollout.num_engines < 2:
        needs.append(f"two or more rollout engines (rollout.ranks={job.rollout.ranks} makes one)")
    if job.gateway.rollout_route_mode != "direct":
        needs.append("gateway.rollout_route_mode=direct (sglang-router picks engines itself)")
    if not needs:
        return []
    return [f"rollout.fault_tolerance needs {' and '.join(needs)}: set them or turn it off."]
