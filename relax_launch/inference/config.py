"""Config sections owned by inference: the three inference roles and the gateway."""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from relax_launch.config.section import Section
from relax_launch.inference.image_config import ImageLimits
from relax_launch.inference.model_config import (
    ROLLOUT_HAS_ONE_MODEL,
    ModelNames,
    RoleModelConfig,
    check_engine_keys,
    default_model_id,
    model_sections,
    models_problem,
)
from relax_launch.rl.environment_config import EnvironmentConfig

RoutingPolicy = Literal["round_robin", "affinity"]
# gateway.request_timeout_s=auto: a request may queue behind every token of the step's batch on
# its engine; an engine is assumed to get through at least AUTO_TOKENS_PER_S of them (prompt
# and response; a GPU engine batch-decodes several times that), and never less than the old
# CPU-sized AUTO_FLOOR_S, so a toy job keeps its bound.
AUTO_TOKENS_PER_S = 500.0
AUTO_FLOOR_S = 300.0


class EngineShape(Section):
    """What ``ranks``, ``tp_size`` and ``pp_size`` make: engines of tp_size x pp_size ranks."""

    @property
    def ranks_per_engine(self) -> int:
        """Ranks of one engine: tp_size x pp_size."""
        return self.tp_size * self.pp_size

    @property
    def num_engines(self) -> int:
        """Engines of this shape (ranks / ranks_per_engine, when it divides)."""
        return self.ranks // self.ranks_per_engine

    @property
    def reserved_engines(self) -> int:
        """Engines beyond the planned ones whose ranks wait for a scale-out (none here)."""
        return 0


class PrefillConfig(EngineShape):
    """The prefill engines of a disaggregated role (SGLang's prefill/decode disaggregation)."""

    ranks: int = Field(1, ge=1, description="Ranks of the prefill engines, in total.")
    tp_size: int = Field(1, ge=1, description="Prefill engine tensor-parallel size.")
    pp_size: int = Field(
        1, ge=1, description="Prefill engine pipeline-parallel size; tp_size x pp_size ranks each."
    )


class AutoscaleBounds(Section):
    """The engines an autoscaler keeps a role between."""

    min_engines: int | None = Field(
        None, ge=1, description="Fewest engines; default the planned count (ranks / engine size)."
    )
    max_engines: int | None = Field(
        None, ge=1, description="Most engines; default the role's max_engines."
    )


class AutoscaleConfig(AutoscaleBounds):
    """Scale a teacher or genrm role's engines with its load: the engines' own queues (SGLang's
    ``/metrics``) and the requests the gateway and the controller have in flight to them."""

    target_queue_per_engine: float = Field(
        4.0,
        gt=0,
        description="Requests per engine (waiting or running) the autoscaler aims at: it wants "
        "ceil(load / target) engines, load being the engines' queued and running requests or, "
        "when larger, the requests in flight to them.",
    )
    scale_up_window_s: float = Field(
        10.0, ge=0, description="Scale out once it has wanted more engines for this long."
    )
    scale_down_window_s: float = Field(
        60.0, ge=0, description="Scale in once it has wanted fewer engines for this long."
    )
    cooldown_s: float = Field(
        30.0, ge=0, description="No decision for this long after any scale operation ended."
    )
    interval_s: float = Field(1.0, gt=0, description="How often the load is read.")


class RolloutAutoscaleConfig(AutoscaleBounds):
    """Scale the rollout engines with the rollout phases' demand across steps, decided once per
    finished phase (``runtime/autoscale_policy.py``): never from the idleness of a train phase,
    and a scale-out still waiting for its weight sync asks nothing more."""

    target_phase_s: float | None = Field(
        None,
        gt=0,
        description="Seconds a rollout phase should take: it wants ceil(engines x phase seconds "
        "/ target_phase_s) engines, the count that would have generated the phase in this time "
        "(throughput taken as proportional to the engines). Unset: target_queue_per_engine "
        "sizes it. The fully asynchronous schedule sizes by keeping the trainer fed instead: "
        "ceil(engines x seconds the engines were busy / seconds the trainer did not wait).",
    )
    target_queue_per_engine: float = Field(
        4.0,
        gt=0,
        description="Without target_phase_s: requests per engine at a rollout phase's start "
        "(prompts x n_samples_per_prompt) it aims at, ceil(requests / target) engines.",
    )
    scale_up_phases: int = Field(
        1,
        ge=1,
        description="Scale out once this many rollout phases in a row wanted more engines (to "
        "the fewest any of them wanted).",
    )
    scale_down_phases: int = Field(
        3,
        ge=1,
        description="Scale in once this many rollout phases in a row wanted fewer engines (to "
        "the most any of them wanted).",
    )
    scale_in_margin: float = Field(
        0.2,
        ge=0,
        lt=1,
        description="A phase wants fewer engines only if they would have met the target with "
        "this share to spare (0.2: at most 80% of target_phase_s, or of target_queue_per_engine), "
        "so a demand at a count's edge does not scale in and straight out again.",
    )


class InferenceRoleConfig(EngineShape, ModelNames):
    """One inference role: its model, its ranks, and how they group into SGLang engines."""

    model: str | None = Field(None, description="Model: a Hugging Face directory or builtin:NAME.")
    ranks: int = Field(1, description="Ranks this role uses, in total over all its engines.")
    tp_size: int = Field(1, ge=1, description="Engine tensor-parallel size.")
    pp_size: int = Field(
        1,
        ge=1,
        description="Engine pipeline-parallel size; an engine spans tp_size x pp_size ranks.",
    )
    engine: dict[str, Any] = Field(
        default_factory=dict,
        description="Extra SGLang server arguments, e.g. {max_total_tokens: 4096}. Placement "
        "fields (tp_size, port, base_gpu_id, ...) belong to the planner and are rejected.",
    )
    prefill: PrefillConfig | None = Field(
        None,
        description="Prefill/decode disaggregation: these ranks run prefill engines and the "
        "role's own ranks/tp_size/pp_size its decode engines; each request is prefilled on one, "
        "its KV cache moved (Mooncake, TCP on the CPU) and decoded on the other. Decode engine i "
        "pairs with prefill engine i mod (prefill engines), which must divide the decode "
        "engines. placement.mode=decoupled only.",
    )
    max_engines: int | None = Field(
        None,
        ge=1,
        description="Elastic replicas: the planner reserves ranks for up to this many engines "
        "(at least the planned ranks / engine size); the extra ones start on demand "
        "(POST /{role}/scale_out, or autoscale) and stop again (scale_in). A reserved rank "
        "waits without a server until asked. placement.mode=decoupled only.",
    )
    autoscale: AutoscaleConfig | None = Field(
        None,
        description="Scale the engines between autoscale.min_engines and max_engines with the "
        "load; every decision goes to autoscaler.jsonl in the run directory. Needs max_engines.",
    )
    models: tuple[RoleModelConfig, ...] = Field(
        (),
        description="Further models of this role besides model (the default one, which a "
        "request naming no model or route_key gets), each on engines of its own, placed after "
        "the default model's: a request's 'model' (id or alias) or 'route_key' chooses one. "
        "teacher and genrm only (rollout serves the one policy the trainer syncs).",
    )

    @field_validator("ranks")
    @classmethod
    def _ranks_positive(cls, ranks: int) -> int:
        if ranks < 1:
            raise ValueError(
                f"must be at least 1 (got {ranks}); to run without this role, remove its section"
            )
        return ranks

    @field_validator("engine")
    @classmethod
    def _engine_keys_not_planner_owned(cls, engine: dict[str, Any]) -> dict[str, Any]:
        return check_engine_keys(engine)

    @model_validator(mode="before")
    @classmethod
    def _one_way_to_size_an_engine(cls, data: Any) -> Any:
        if isinstance(data, dict) and "ranks_per_engine" in data:
            raise ValueError(
                "ranks_per_engine is not a field: an engine spans tp_size x pp_size ranks; "
                f"state tp_size (and pp_size) instead, e.g. tp_size: {data['ranks_per_engine']}"
            )
        return data

    def resolved_model_id(self, model: str) -> str:
        """The id clients use for ``model`` (this role's model reference)."""
        return self.model_id or default_model_id(model)

    def model_sections(self) -> tuple[InferenceRoleConfig, ...]:
        """The role's models as sections of their own, the default first
        (``model_config.model_sections``)."""
        return model_sections(self)

    @model_validator(mode="after")
    def _models_fit(self) -> InferenceRoleConfig:
        problem = models_problem(self) if self.models and self.model is not None else ""
        if problem:
            raise ValueError(problem)
        return self

    @model_validator(mode="after")
    def _elastic_bounds(self) -> InferenceRoleConfig:
        if self.max_engines is not None and self.max_engines < self.num_engines:
            raise ValueError(
                f"max_engines={self.max_engines} is below the {self.num_engines} planned engines "
                "(ranks / (tp_size x pp_size)): raise it, or lower ranks"
            )
        if self.autoscale is None:
            return self
        if self.max_engines is None:
            raise ValueError("autoscale needs max_engines (the engines it may scale out to)")
        low, high = self.autoscale_bounds
        if not self.num_engines <= low <= high <= self.max_engines:
            raise ValueError(
                f"autoscale wants {low} to {high} engines, outside the {self.num_engines} planned "
                f"to max_engines={self.max_engines}: keep {self.num_engines} <= "
                f"autoscale.min_engines <= autoscale.max_engines <= {self.max_engines}"
            )
        return self

    @property
    def autoscale_bounds(self) -> tuple[int, int]:
        """(fewest, most) engines the autoscaler keeps."""
        scale = self.autoscale
        low = scale.min_engines if scale and scale.min_engines else self.num_engines
        high = scale.max_engines if scale and scale.max_engines else self.max_engines
        return low, high or self.num_engines

    @property
    def reserved_engines(self) -> int:
        """Engines beyond the planned ones whose ranks wait for a scale-out."""
        return (self.max_engines or self.num_engines) - self.num_engines

    @property
    def total_ranks(self) -> int:
        """Every rank of the role: its engines', the reserved ones' (max_engines), with
        prefill/decode disaggregation the prefill half's, and those of its further models."""
        reserved = self.reserved_engines * self.ranks_per_engine
        prefill = self.prefill.ranks if self.prefill is not None else 0
        return self.ranks + reserved + prefill + sum(m.ranks for m in self.models)


class RolloutConfig(InferenceRoleConfig):
    """The policy served by SGLang; takes the trainer's weights after every step."""

    model: str | None = Field(
        None, description="Rollout model; default trainer.model (it must match the trainer's)."
    )
    function: str | None = Field(
        None,
        pattern=r"^(builtin:calculator|[A-Za-z_][\w.]*:[A-Za-z_]\w*)$",
        description="Agentic rollouts: an async function (builtin:calculator or "
        "package.module:function) given each prompt and an OpenAI-compatible client of these "
        "engines; it may run several turns and call tools, and returns the conversation. Only "
        "the engine's tokens are trained. Unset: one response per sample.",
    )
    environment: EnvironmentConfig | None = Field(
        None, description="An environment module: its prompts, conversations and rubric."
    )
    multi_turn: Literal["continue_tokens", "per_turn", "strict"] = Field(
        "continue_tokens",
        description="How a conversation of rollout.function is trained when the chat template "
        "renders earlier turns otherwise as it goes on (Qwen3 drops earlier <think> blocks): "
        "continue_tokens, one sample that continues the engine's own tokens (the context the "
        "engine saw); per_turn, one training row per turn, each generated from the template's "
        "rendering of the conversation (the context at inference), all with the "
        "conversation's reward; strict, one sample, rejected (agent/rejected) when the "
        "template rewrites earlier turns. per_turn is not taken with algorithm.max_staleness, "
        "a teacher, advantage_estimator=gae or a vision-language trainer.model.",
    )
    fault_tolerance: bool = Field(
        False,
        description="An engine whose server dies is taken out of routing, its lost generations "
        "are sent to the other engines (rollout/prompts_regenerated counts them; with "
        "max_staleness an interrupted generation keeps the tokens it already got back), and "
        "its rank restarts it (at most 3 times per engine); it serves again after the next "
        "weight sync. With prefill engines the pair of a dead half leaves routing until that "
        "half is back. Off: a dead engine ends the job. Needs placement.mode=decoupled, two or "
        "more rollout engines (with prefill engines, two or more of each), and with prefill "
        "engines rollout_route_mode=direct.",
    )
    autoscale: RolloutAutoscaleConfig | None = Field(
        None,
        description="Scale the engines between autoscale.min_engines and max_engines with the "
        "rollout phases' demand across steps; every decision goes to autoscaler.jsonl in the "
        "run directory. Needs max_engines.",
    )

    @field_validator("models")
    @classmethod
    def _one_policy(cls, models: tuple[RoleModelConfig, ...]) -> tuple[RoleModelConfig, ...]:
        if models:
            raise ValueError(ROLLOUT_HAS_ONE_MODEL)
        return models


class StaticRoleConfig(InferenceRoleConfig):
    """A static model (teacher, genrm): serves its starting weights; never joins weight sync."""

    model: str = Field(description="Model: a Hugging Face directory or builtin:NAME.")
    fault_tolerance: bool = Field(
        False,
        description="An engine whose server dies is restarted by its rank (at most 3 times per "
        "engine), loads its model again and serves again as soon as it is ready (no weight "
        "sync: it serves its starting weights); the requests it lost go to another engine, and "
        "while none is left they wait for one to come back (at most cluster.startup_timeout_s, "
        "announced on the console). One engine is enough. Off: a dead engine ends the job. "
        "Needs placement.mode=decoupled and no prefill engines.",
    )


class TeacherConfig(StaticRoleConfig):
    """The teacher of on-policy distillation: scores the student's tokens with logprobs."""


class GenRMConfig(StaticRoleConfig):
    """The LLM judge whose parsed score is a reward source."""


class GatewayConfig(Section):
    """The HTTP gateway thread on rank 0."""

    host: str = Field("127.0.0.1", description="Bind address; loopback by default.")
    port: int = Field(0, ge=0, le=65535, description="Bind port; 0 picks a free one and logs it.")
    admin_token_env: str = Field(
        "RELAX_ADMIN_TOKEN", description="Environment variable holding the admin bearer token."
    )
    max_body_bytes: int = Field(16 * 2**20, ge=1024, description="Largest request body accepted.")
    request_timeout_s: float | Literal["auto"] = Field(
        "auto",
        description="One engine request's bound, seconds, its time queued on the engine "
        "included (then 504). 'auto': the step's batch queued on one rollout engine at 500 "
        "tokens/s, i.e. ceil(data.prompts_per_step x algorithm.n_samples_per_prompt / rollout "
        "engines) x (data.max_prompt_tokens + data.max_response_tokens) / 500, at least 300 s. "
        "A step's rollout waits 3 times this bound (generation, teacher scoring, judging).",
    )
    routing_policy: RoutingPolicy = Field(
        "round_robin",
        description="Engine choice, every role and route mode: 'round_robin' takes the engines "
        "in turn and ignores any x-smg-routing-key header; 'affinity' sends each "
        "x-smg-routing-key value to one engine and answers 400 to a request without it.",
    )
    rollout_route_mode: Literal["direct", "router"] = Field(
        "direct",
        description="Rollout traffic straight to engines, or through sglang-router (started with "
        "routing_policy: its round_robin, or its manual policy keyed by x-smg-routing-key); its "
        "workers follow the engines in routing (scaled out or in, restarted).",
    )
    images: ImageLimits = Field(
        default_factory=ImageLimits,
        description="Images in chat requests and image_data (vision-language models only): "
        "data: URLs, local files under allowed_dirs, size and count limits (docs/gateway.md).",
    )

    @field_validator("request_timeout_s")
    @classmethod
    def _timeout_positive(cls, timeout: float | str) -> float | str:
        if timeout != "auto" and timeout <= 0:
            raise ValueError(f"{timeout} s ends every request at once: set seconds > 0, or auto")
        return timeout

    def timeout_s(self, queued_tokens_per_engine: int = 0) -> float:
        """request_timeout_s in seconds: the stated number, or for ``auto`` the time an engine
        at AUTO_TOKENS_PER_S takes for the tokens queued on it (at least AUTO_FLOOR_S; a gateway
        built without a job, which knows no batch, gets the floor)."""
        if self.request_timeout_s != "auto":
            return self.request_timeout_s
        return max(AUTO_FLOOR_S, float(math.ceil(queued_tokens_per_engine / AUTO_TOKENS_PER_S)))
