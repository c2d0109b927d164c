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
from relax_launch.rl.config import (
    AlgorithmConfig,
    CheckpointConfig,
    DataConfig,
    EvalConfig,
    LoggingConfig,
    RewardConfig,
)
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
        from other weights (off-policy) or another precision than the trainer's, else none."""
        chosen = self.algorithm.rollout_correction
        if chosen != "auto":
            return chosen
        other_weights = self.rollout_overlaps_training
        return "token_tis" if other_weights or self.precision_differs else "none"

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
        correction = self.rollout_correction()
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

    def rollout_model(self) -> str:
        """The rollout engines' model: rollout.model, or the trainer's."""
        return self.rollout.model or self.trainer.model

    @model_validator(mode="after")
    def _cross_section_rules(self) -> JobConfig:
        problems = _role_usage_problems(self) + _colocation_problems(self) + _engine_problems(self)
        problems += _batch_problems(self) + _fault_tolerance_problems(self)
        problems += _algorithm_problems(self) + _lora_problems(self)
        problems += _disaggregation_problems(self)
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


def _disaggregation_problems(job: JobConfig) -> list[str]:
    """What prefill/decode engines cannot be combined with yet, and why."""
    problems = []
    for name, role in job.inference_roles().items():
        if role.prefill is None:
            continue
        clashes = {
            "placement.mode=decoupled": (
                job.placement.mode != "decoupled",
                "colocated engines release their KV cache between phases, and the KV transfer "
                "registers that memory once at start",
            ),
        }
        if name == "rollout":
            clashes |= _rollout_disaggregation_clashes(job)
        problems += [
            f"{name}.prefill (prefill/decode engines) needs {what}: {why}. Change it or remove "
            f"{name}.prefill."
            for what, (clash, why) in clashes.items()
            if clash
        ]
    return problems


def _rollout_disaggregation_clashes(job: JobConfig) -> dict[str, tuple[bool, str]]:
    return {
        "rollout.fault_tolerance off": (
            job.rollout.fault_tolerance,
            "a restarted half would have to rejoin its partner's KV transfer",
        ),
        "algorithm.routing_replay off": (
            job.algorithm.routing_replay,
            "the routed experts of a prompt are recorded on the prefill side",
        ),
        "trainer.lora.engines=merged": (
            job.trainer.lora is not None and job.trainer.lora.engines == "adapter",
            "both halves would have to load each adapter version",
        ),
        "rollout.pp_size=1 and rollout.prefill.pp_size=1": (
            job.rollout.pp_size > 1 or job.rollout.prefill.pp_size > 1,
            "SGLang's prefill and decode loops pass requests between pipeline stages in an "
            "order of their own, which the weight sync's relay to every stage does not keep yet",
        ),
    }


def _lora_problems(job: JobConfig) -> list[str]:
    """Where the rollout engines can serve the policy as a LoRA adapter."""
    lora = job.trainer.lora
    if lora is None or lora.engines != "adapter" or job.placement.mode == "decoupled":
        return []
    return [
        f"trainer.lora.engines=adapter needs placement.mode=decoupled (not "
        f"{job.placement.mode}): the colocated engines swap their weights in and out of memory, "
        "which SGLang's LoRA serving does not follow; use trainer.lora.engines=merged."
    ]


def _algorithm_problems(job: JobConfig) -> list[str]:
    """Algorithm settings that depend on the data limits, the placement or the precisions."""
    a, problems = job.algorithm, []
    if a.dynamic_sampling and job.placement.mode == "defer":
        problems.append(
            "algorithm.dynamic_sampling draws more prompts after scoring, which placement.mode="
            "defer cannot do (its roles hand the same memory over in turns): turn it off or use "
            "split or decoupled."
        )
    if a.max_staleness:
        clashes = {
            "placement.mode=decoupled": job.placement.mode != "decoupled",
            "algorithm.off_policy_steps=0": a.off_policy_steps > 0,
            "algorithm.dynamic_sampling off": a.dynamic_sampling,
            "rollout.fault_tolerance off": job.rollout.fault_tolerance,
        }
        if needed := [what for what, clash in clashes.items() if clash]:
            problems.append(
                f"algorithm.max_staleness={a.max_staleness} (fully asynchronous) needs "
                f"{' and '.join(needed)}: change them or set algorithm.max_staleness=0."
            )
    if a.routing_replay and (a.max_staleness or job.rollout.function):
        problems.append(
            "algorithm.routing_replay records the experts of each generate call; the fully "
            "asynchronous rollout (algorithm.max_staleness) and rollout functions (rollout."
            "function) assemble samples from several calls, which it does not follow yet: turn "
            "one of them off."
        )
    if a.overlong_buffer_tokens >= job.data.max_response_tokens:
        problems.append(
            f"algorithm.overlong_buffer_tokens={a.overlong_buffer_tokens} must be below "
            f"data.max_response_tokens={job.data.max_response_tokens}."
        )
    problems += _eval_problems(job)
    if "rollout_correction_cap" in a.model_fields_set and job.rollout_correction() == "none":
        problems.append(
            "algorithm.rollout_correction_cap is set but the rollout correction is none (auto "
            "turns it on only off-policy or at another engine dtype): set "
            "algorithm.rollout_correction=token_tis or sequence_mis, or remove the cap."
        )
    return problems


def _eval_problems(job: JobConfig) -> list[str]:
    """Evaluation needs prompts the training never sees."""
    if job.eval is None:
        return []
    problems = []
    held_out = job.eval.data
    same_task = held_out.dataset == job.data.dataset and job.data.dataset.startswith("builtin:")
    if same_task and held_out.seed == job.data.seed:
        problems.append(
            f"eval.data.seed={held_out.seed} equals data.seed: {held_out.dataset} would "
            "evaluate on the training prompts; give eval.data.seed another value."
        )
    return problems
