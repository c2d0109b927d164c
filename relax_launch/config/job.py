"""JobConfig: the whole job, built from its components' sections (cross-section rules:
``config/rules.py``)."""

from __future__ import annotations

import math
from pathlib import Path

from pydantic import Field, model_validator

from relax_launch.config.rules import cross_section_problems
from relax_launch.config.section import Section
from relax_launch.inference.config import (
    GatewayConfig,
    GenRMConfig,
    InferenceRoleConfig,
    RolloutConfig,
    TeacherConfig,
)
from relax_launch.placement.config import ClusterConfig, PlacementConfig
from relax_launch.rl.config import (
    AlgorithmConfig,
    CheckpointConfig,
    LoggingConfig,
    RewardConfig,
)
from relax_launch.rl.critic_config import CriticConfig
from relax_launch.rl.data_config import DataConfig, EvalConfig
from relax_launch.rl.policy_loss_config import OWN_CORRECTION
from relax_launch.trainer.config import TrainerConfig
from relax_launch.weights.config import WeightSyncConfig

ROLLOUT_WAIT_REQUESTS = 3  # request timeouts a step's rollout may take (see rollout_wait_s)


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
    critic: CriticConfig | None = Field(
        None, description="PPO's value model (algorithm.advantage_estimator=gae); unset: none."
    )
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig, description="Algorithm.")
    data: DataConfig = Field(default_factory=DataConfig, description="Prompt data.")
    eval: EvalConfig | None = Field(
        None, description="Periodic evaluation on held-out prompts; unset: none."
    )
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

    def fault_tolerant(self, role: str) -> bool:
        """Whether a dead engine of ``role`` is restarted (``{role}.fault_tolerance``)."""
        section = self.inference_roles().get(role)
        return section is not None and section.fault_tolerance

    @property
    def log_dir(self) -> Path:
        """The run directory: logging.dir with {name} filled in."""
        return Path(self.logging.dir.format(name=self.name))

    @property
    def checkpoint_dir(self) -> Path:
        """Where checkpoints go and where a resume looks: checkpoint.dir with {name} filled in,
        else ``checkpoints/`` in the run directory (written only when the job is stopped)."""
        if self.checkpoint.dir is None:
            return self.log_dir / "checkpoints"
        return Path(self.checkpoint.dir.format(name=self.name))

    @property
    def export_dir(self) -> Path:
        """Where the policy's Hugging Face exports go: checkpoint.export_hf.dir with {name}
        filled in, else ``hf/`` in the run directory."""
        directory = self.checkpoint.export_hf.dir
        return self.log_dir / "hf" if directory is None else Path(directory.format(name=self.name))

    def engine_dtype(self, role: str) -> str:
        """The one precision decision for a role's engines: its engine.dtype, else the trainer's
        dtype (so the rollout policy's logprobs match the trainer's)."""
        return self.inference_roles()[role].engine.get("dtype", self.trainer.dtype)

    def rollout_correction(self) -> str:
        """algorithm.rollout_correction with ``auto`` resolved: token_tis when the samples come
        from other weights (off-policy) or another precision than the trainer's, else none
        (always none for the losses that weigh each token by that ratio themselves)."""
        chosen = self.algorithm.rollout_correction
        if chosen != "auto":
            return chosen
        if self.algorithm.policy_loss in OWN_CORRECTION:
            return "none"
        other_weights = self.rollout_overlaps_training
        return "token_tis" if other_weights or self.precision_differs else "none"

    @property
    def starts_staggered(self) -> bool:
        """Whether roles that share devices start one at a time (placement.staggered_start)."""
        chosen = self.placement.staggered_start
        if self.placement.mode == "decoupled":
            return False
        return self.cluster.device == "cuda" if chosen == "auto" else chosen

    @property
    def rollout_overlaps_training(self) -> bool:
        """Whether the engines generate while the trainer trains (off-policy, async)."""
        return self.algorithm.off_policy_steps > 0 or self.algorithm.max_staleness > 0

    @property
    def precision_differs(self) -> bool:
        """Whether the rollout engines compute at another precision than the trainer."""
        return self.engine_dtype("rollout") != self.trainer.dtype

    def precision_notice(self) -> str | None:
        """Said once before a run whose rollout engines compute at another precision than the
        trainer: PPO's old logprobs come from the engines, so the ratios start away from 1."""
        if not self.precision_differs:
            return None
        gap = (
            f"rollout.engine.dtype={self.rollout.engine['dtype']} differs from trainer.dtype="
            f"{self.trainer.dtype}: the engines' logprobs and the trainer's differ by the "
            "precision gap"
        )
        correction, loss = self.rollout_correction(), self.algorithm.policy_loss
        if loss in OWN_CORRECTION:
            return f"{gap}; algorithm.policy_loss={loss} weighs each token by that ratio itself."
        if correction != "none":
            return (
                f"{gap}; algorithm.rollout_correction={correction} weights each token by the "
                "trainer-over-engine ratio (metrics mismatch_kl, is_cut_fraction)."
            )
        return (
            f"{gap}, so importance ratios start away from 1 and the clip range absorbs part of "
            "it; set algorithm.rollout_correction=token_tis, or remove rollout.engine.dtype for "
            "exact parity."
        )

    def off_policy_notice(self) -> str | None:
        """Said once before an off-policy run that ``auto`` gave a rollout correction."""
        if self.precision_differs or self.algorithm.rollout_correction != "auto":
            return None  # the precision notice says it, or the user chose
        if self.rollout_correction() == "none":
            return None
        return (
            "algorithm.off_policy_steps or max_staleness trains on samples of earlier weights: "
            f"rollout_correction=auto weights each token by the trainer-over-engine ratio "
            f"truncated at {self.algorithm.rollout_correction_cap} (token_tis); set "
            "algorithm.rollout_correction=none to train without it."
        )

    def request_timeout_s(self) -> float:
        """gateway.request_timeout_s with ``auto`` resolved from this job's work: every sample
        of a step queued on one rollout engine, each at its longest prompt and response."""
        samples = self.data.prompts_per_step * self.algorithm.n_samples_per_prompt
        per_sample = self.data.max_prompt_tokens + self.data.max_response_tokens
        queued = math.ceil(samples / self.rollout.num_engines) * per_sample
        return self.gateway.timeout_s(queued)

    def rollout_wait_s(self) -> float:
        """How long a step waits for its rollout: ROLLOUT_WAIT_REQUESTS request timeouts, one
        each for generation, teacher scoring and judging (all of a phase's requests are sent
        at once, so each phase ends within one request timeout)."""
        return ROLLOUT_WAIT_REQUESTS * self.request_timeout_s()

    def rollout_model(self) -> str:
        """The rollout engines' model: rollout.model, or the trainer's."""
        return self.rollout.model or self.trainer.model

    @model_validator(mode="after")
    def _cross_section_rules(self) -> JobConfig:
        problems = cross_section_problems(self)
        if problems:
            raise ValueError("\n".join(problems))
        return self
