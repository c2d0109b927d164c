"""Config sections owned by the RL loop: the algorithm, the rewards, and what a run writes
(checkpoints, Hugging Face exports, metrics). The prompts it trains and evaluates on are
``data_config.py``'s."""

from __future__ import annotations

import importlib.util
import re
from typing import Literal

from pydantic import Field, field_validator, model_validator

from relax_launch.config.section import Section
from relax_launch.notify import url_problems
from relax_launch.rl.code_config import CodeTestsConfig
from relax_launch.rl.control_config import ControlConfig
from relax_launch.rl.policy_loss_config import PolicyLossFields

BUILTIN_REWARDS = ("exact_numeric", "format", "math_verify", "reasoning_gym", "code_tests")
BUILTIN_REWARDS += ("environment",)  # rollout.environment's rubric (rl/environments.py)
# scored in worker processes (rl/reward_pool.py) or sandboxes (rl/code_pool.py) under a
# per-sample time limit
POOLED_REWARDS = ("math_verify", "reasoning_gym", "code_tests")
_IMPORT_PATH = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


class MismatchGuardConfig(Section):
    """Bounds on a step's trainer-vs-engine metrics, and what a step beyond them does."""

    action: Literal["stop", "skip", "warn", "off"] = Field(
        "stop",
        description="stop: end the job after the step, the cause on the last line. skip: the "
        "trainer withholds the step's update (its batch is dropped) and the sync after it "
        "sends the weights again, checked by the parity probe; max_skips such steps in a row "
        "stop the job. warn: log it and count it in guard/tripped; the next sync's parity "
        "probe still checks the engines. off: no check.",
    )
    max_skips: int = Field(
        2,
        ge=1,
        description="action skip: steps in a row whose update may be withheld; one more stops "
        "the job (the re-syncs did not bring the engines back to the trainer's weights).",
    )
    logprob_diff_max: float | None = Field(
        None,
        gt=0,
        description="On-policy steps (staleness 0): largest |trainer - engine| logprob of a "
        "trained token allowed. Unset: 0.01 when trainer and rollout engines compute in "
        "float32 (measured up to 3.5e-5), else no bound (in bfloat16 a maximum over every "
        "token is heavy-tailed: measured up to 0.76 on healthy steps).",
    )
    mismatch_kl: float | None = Field(
        None,
        gt=0,
        description="On-policy steps: the mean k3 KL(engine || trainer) per token allowed. "
        "Unset: 1e-4 in float32 (measured below 1e-6); 0.1 with bfloat16 on either side "
        "(measured on the CPU up to 8.1e-3); no bound for float16.",
    )
    off_policy_mismatch_kl: float | None = Field(
        1.0,
        gt=0,
        description="Steps with stale samples (off_policy_steps, max_staleness): the mean k3 "
        "KL(engine || trainer) of the importance ratios allowed (measured up to 0.13 at lr 1e-2 "
        "one version stale; an engine with wrong weights shows about 3). null: no bound.",
    )


class AlgorithmConfig(PolicyLossFields):  # the policy loss's fields: rl/policy_loss_config.py
    """GRPO with optional KL to the initial policy and on-policy distillation."""

    num_steps: int = Field(1, ge=1, description="RL steps to run.")
    n_samples_per_prompt: int = Field(
        8, ge=2, description="Samples per prompt; GRPO normalises rewards within each group."
    )
    temperature: float = Field(1.0, gt=0, description="Rollout sampling temperature.")
    clip_eps: float = Field(0.2, gt=0, description="PPO clip range (lower side).")
    clip_eps_high: float | None = Field(
        None, gt=0, description="PPO clip range upper side; default clip_eps."
    )
    advantage_estimator: Literal["grpo", "dr_grpo", "rloo", "reinforce_pp_baseline", "gae"] = Field(
        "grpo",
        description="grpo: reward minus its group's mean over the group's std. dr_grpo: "
        "minus the mean only (pair with loss_aggregation: token_sum). rloo: minus the mean "
        "of the group's other rewards. reinforce_pp_baseline: minus the group mean, over "
        "the batch's std. gae: PPO's per-token GAE from a learned value model (needs a "
        "critic section; rl/gae.py).",
    )
    gamma: float = Field(
        1.0, ge=0, le=1, description="GAE's discount per response token (advantage gae)."
    )
    lam: float = Field(
        0.95, ge=0, le=1, description="GAE's lambda, its bias-variance trade (advantage gae)."
    )
    policy_ratio: Literal["token", "sequence"] = Field(
        "token",
        description="token: PPO's per-token ratio. sequence: GSPO's length-normalised sequence "
        "ratio, clipped per sequence (use clip ranges such as clip_eps=3e-4, "
        "clip_eps_high=4e-4 and loss_aggregation: sequence).",
    )
    loss_aggregation: Literal["token", "sequence", "token_sum"] = Field(
        "token",
        description="token: mean over all tokens. sequence: per sequence, then over sequences. "
        "token_sum: each sequence's token sum over data.max_response_tokens, then over "
        "sequences (Dr.GRPO).",
    )
    rollout_correction: Literal["auto", "none", "token_tis", "sequence_mis"] = Field(
        "auto",
        description="Importance weights from the rollout engine's sampling policy to the "
        "trainer's: token_tis truncates each token's ratio at rollout_correction_cap; "
        "sequence_mis weights each sequence by its ratio and drops one over the cap. auto: "
        "token_tis when off_policy_steps > 0 or the rollout engines run at another dtype than "
        "the trainer, else none. With a correction, PPO's ratio is taken to the trainer's own "
        "logprobs.",
    )
    rollout_correction_cap: float = Field(
        2.0,
        ge=1.0,
        description="Largest importance ratio kept (token_tis) or allowed (sequence_mis).",
    )
    dynamic_sampling: bool = Field(
        False,
        description="DAPO: drop prompt groups whose rewards are all equal (no signal) and draw "
        "more prompts until data.prompts_per_step groups have signal (decoupled or split).",
    )
    dynamic_sampling_max_rounds: int = Field(
        4,
        ge=1,
        description="Rounds of data.prompts_per_step prompts one step may draw; if they are "
        "not enough, the step fills its batch with dropped groups (advantage 0).",
    )
    overlong_buffer_tokens: int = Field(
        0,
        ge=0,
        description="DAPO over-long shaping: a response in its last this-many tokens before "
        "data.max_response_tokens loses up to overlong_penalty reward, linearly. 0: off.",
    )
    overlong_penalty: float = Field(
        1.0, gt=0, description="The reward a response of data.max_response_tokens loses."
    )
    mask_truncated: bool = Field(
        False,
        description="DAPO over-long filtering: responses cut at data.max_response_tokens keep "
        "their place in the group's advantages but are not trained on.",
    )
    kl_coef: float = Field(
        0.0,
        ge=0,
        description="Coefficient of the per-token KL penalty to the initial policy (k3 "
        "estimator); > 0 keeps a frozen copy of the initial policy on every trainer rank.",
    )
    distill_coef: float = Field(
        0.0, ge=0, description="Coefficient of reverse KL to the teacher; > 0 needs a teacher."
    )
    off_policy_steps: Literal[0, 1] = Field(
        0,
        description="0: synchronous. 1: generate and score step k+1's samples with step k's "
        "weights while step k trains (decoupled only); samples more than this many weight "
        "versions old are not trained on.",
    )

    routing_replay: bool = Field(
        False, description="MoE (R3): the trainer routes each token to the engine's experts."
    )
    max_staleness: int = Field(
        0,
        ge=0,
        description="k >= 1: fully asynchronous training (decoupled only). The rollout engines "
        "generate continuously, at most k batches ahead of the trainer; a weight sync "
        "interrupts what is in flight, which then continues with the new weights (each token "
        "keeps the version that produced it); samples older than k versions are not trained "
        "on. 0: off (see off_policy_steps).",
    )
    control: ControlConfig | None = Field(
        None,
        description="Opt-in closed-loop control: actions on what each step measures (the "
        "staleness bound, a sequence mask on large importance ratios, MoE routing replay), "
        "each change logged once and in the metrics (control/...). Unset: none acts.",
    )
    mismatch_guard: MismatchGuardConfig = Field(
        default_factory=MismatchGuardConfig,
        description="Stop (or warn) when a step's samples were scored by the engines far from "
        "the trainer: logprob_diff_max and mismatch_kl on-policy, the importance ratios' KL "
        "off-policy.",
    )

    @model_validator(mode="after")
    def _dependent_knobs_act(self) -> AlgorithmConfig:
        """A knob that only acts with another one on is refused without it."""
        needs = {
            "dynamic_sampling_max_rounds": ("dynamic_sampling", self.dynamic_sampling),
            "overlong_penalty": ("overlong_buffer_tokens", self.overlong_buffer_tokens > 0),
        }
        for knob, (switch, on) in needs.items():
            if knob in self.model_fields_set and not on:
                raise ValueError(
                    f"algorithm.{knob} acts only with algorithm.{switch}: turn that on or "
                    f"remove algorithm.{knob}"
                )
        self._control_can_act()
        return self

    def _control_can_act(self) -> None:
        """The control's staleness action needs the fully asynchronous schedule; its routing
        action has nothing to turn on when replay is on from the start."""
        control = self.control
        if control is None:
            return
        if control.staleness is not None and not self.max_staleness:
            raise ValueError(
                "algorithm.control.staleness acts only with algorithm.max_staleness (the fully "
                "asynchronous schedule): turn that on or remove algorithm.control.staleness"
            )
        if control.routing_replay is not None and self.routing_replay:
            raise ValueError(
                "algorithm.control.routing_replay turns routing replay on when the routing "
                "drifts, but algorithm.routing_replay replays from the first step: remove one"
            )

    @property
    def records_routing(self) -> bool:
        """Whether the rollout engines return the experts they routed each token to: for
        routing replay, or for the control that may turn it on."""
        return self.routing_replay or (
            self.control is not None and self.control.routing_replay is not None
        )


class RewardSource(Section):
    """One reward source: a Python function or the GenRM judge."""

    name: str = Field(description="Name shown in metrics (reward/NAME).")
    function: str | None = Field(
        None, description="builtin:NAME or package.module:function, sync or async, batched."
    )
    genrm: bool = Field(False, description="Score with the GenRM judge instead of a function.")
    weight: float = Field(1.0, description="Weight of this source in the summed reward.")
    fallback: float | None = Field(
        None,
        description="Reward used when this source fails for a sample (raises, returns a "
        "non-number, an unparseable judge reply); counted in reward/NAME/failed either way. "
        "Unset: the sample gets no gradient that step.",
    )
    timeout_s: float = Field(
        5.0,
        gt=0,
        description="builtin:math_verify / reasoning_gym / code_tests: the time one sample may "
        "take in its scoring worker or sandbox; over it the sample is counted in "
        "reward/NAME/timeouts and its process killed (code_tests keeps the tests passed "
        "before, the others give 0).",
    )
    code: CodeTestsConfig | None = Field(
        None, description="builtin:code_tests: its sandbox (unset: the defaults)."
    )

    @property
    def pooled(self) -> bool:
        """Whether this source scores in the worker pool (``rl/reward_pool.py``)."""
        builtin = self.function is not None and self.function.startswith("builtin:")
        return builtin and self.function[8:] in POOLED_REWARDS

    @model_validator(mode="after")
    def _exactly_one_kind(self) -> RewardSource:
        if (self.function is None) == (not self.genrm):
            raise ValueError(
                f"reward source {self.name!r} needs exactly one of function: ... or genrm: true"
            )
        fn = self.function
        if fn is not None and fn.startswith("builtin:"):
            if fn[8:] not in BUILTIN_REWARDS:
                raise ValueError(
                    f"unknown built-in reward {fn!r}; choose one of "
                    + ", ".join(f"builtin:{r}" for r in BUILTIN_REWARDS)
                )
        elif fn is not None and not _IMPORT_PATH.match(fn):
            raise ValueError(
                f"reward function {fn!r} must look like package.module:function or builtin:NAME"
            )
        if "timeout_s" in self.model_fields_set and not self.pooled:
            raise ValueError(
                f"reward source {self.name!r}: timeout_s limits builtin:math_verify, "
                "reasoning_gym and code_tests only; remove it"
            )
        if self.code is not None and fn != "builtin:code_tests":
            raise ValueError(f"reward source {self.name!r}: code is for builtin:code_tests only")
        return self


class RewardConfig(Section):
    """The reward is the weighted sum of its sources."""

    sources: tuple[RewardSource, ...] = Field(
        (RewardSource(name="answer", function="builtin:exact_numeric"),),
        description="Reward sources, summed with their weights.",
    )

    @field_validator("sources")
    @classmethod
    def _sources_named_uniquely(cls, sources: tuple[RewardSource, ...]) -> tuple[RewardSource, ...]:
        if not sources:
            raise ValueError("needs at least one reward source")
        names = [s.name for s in sources]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"reward source names must be unique; repeated: {', '.join(dupes)}")
        return sources

    @property
    def uses_genrm(self) -> bool:
        """Whether any source asks the GenRM judge."""
        return any(s.genrm for s in self.sources)


class ExportConfig(Section):
    """Hugging Face model directories of the policy (LoRA: merged), written during the run."""

    every_steps: int = Field(0, ge=0, description="Export every K steps; 0: not periodically.")
    at_end: bool = Field(True, description="Export the final policy once every step has run.")
    dtype: Literal["float32", "bfloat16"] | None = Field(None, description="Unset: trainer.dtype.")
    dir: str | None = Field(
        None,
        description="Where exports go, as step_N ({name}: the job name); unset: {logging.dir}/hf.",
    )


class CheckpointConfig(Section):
    """Trainer state + step + data position, saved every K steps."""

    dir: str | None = Field(
        None,
        description="Checkpoint directory ({name} is the job name). Unset: a checkpoint is "
        "written only when the job is stopped, into {logging.dir}/checkpoints.",
    )
    every_steps: int = Field(
        0, ge=0, description="Save every K steps; 0 saves only at the end (always when dir is set)."
    )
    keep_last: int = Field(2, ge=0, description="Checkpoints kept in dir; 0 keeps every one.")
    export_hf: ExportConfig = Field(
        default_factory=ExportConfig, description="Hugging Face exports during the run."
    )
    resume: bool = Field(
        False,
        description="Continue from the newest complete checkpoint in dir (unset: in "
        "{logging.dir}/checkpoints): trainer state, step, prompt position; with none there "
        "yet, start from the beginning.",
    )


class WandbConfig(Section):
    """Weights & Biases logging of the per-step metrics (the run is named after the job)."""

    project: str = Field(description="W&B project the run is logged to.")
    mode: Literal["online", "offline"] = Field(
        "online",
        description="'online': stream to the W&B server (needs `wandb login` or WANDB_API_KEY); "
        "'offline': keep the run under {logging.dir}/wandb for `wandb sync` later.",
    )


class LoggingConfig(Section):
    """Where the job writes its logs and metrics."""

    dir: str = Field("runs/{name}", description="Output directory; {name} is the job name.")
    level: Literal["debug", "info", "warning", "error"] = Field(
        "info", description="Log level of every rank."
    )
    tensorboard: bool = Field(
        True,
        description="Also write TensorBoard event files into dir (`tensorboard --logdir DIR`).",
    )
    wandb: WandbConfig | None = Field(
        None,
        description="Also log the per-step metrics to Weights & Biases, e.g. "
        "{project: my-project, mode: offline}; unset: off.",
    )

    notify: list[str] = Field(
        [],
        description="Apprise URLs (https://github.com/caronc/apprise/wiki: slack://, mailto://, "
        "json://host:port for a webhook, ...) told when the job is up, finished, failed (with "
        "its last line), stopped, restarted by itself (cluster.max_restarts), or a checkpoint "
        "failed. A failed notification is logged and never fails the job.",
    )

    @field_validator("notify")
    @classmethod
    def _urls_apprise_can_use(cls, urls: list[str]) -> list[str]:
        if problems := url_problems(urls):
            raise ValueError("; ".join(problems))
        return urls

    @field_validator("wandb")
    @classmethod
    def _wandb_installed(cls, wandb: WandbConfig | None) -> WandbConfig | None:
        if wandb is not None and importlib.util.find_spec("wandb") is None:
            raise ValueError(
                "logging.wandb is set but the wandb package is not installed: "
                "pip install -c requirements/pins.txt wandb (or unset logging.wandb)"
            )
        return wandb
