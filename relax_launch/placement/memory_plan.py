"""The memory plan: per device (one per rank) and per phase, what each role placed there holds,
and whether it fits — refused before any process starts when it does not.

Phases: a decoupled rank has one (``resident``). A colocated rank (split, defer) starts (a
``start-up`` phase when its roles start side by side; staggered, each role starts alone as in
its own phase, ``runtime/staggered_start.py``), then goes through
``sync`` (the trainer's parameters and the rollout engine's weights, the trainer's gradients and
optimizer offloaded), each inference phase (the phase's engines hold weights, KV cache and
workspace; the trainer and the other engines hold only their runtime) and ``train`` (the
trainer holds everything; the engines have released weights, KV cache and CUDA graphs).

An engine's KV pool is what SGLang makes of ``mem_fraction_static`` (f): it sizes the pool as
f x capacity minus what the device holds when it starts (its weights and the other roles'
residents), keeping the rest for its workspace. On GPUs a colocated engine takes f from this
plan unless its config gives one; a decoupled engine's default is SGLang's own.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

from relax_launch.config.errors import ConfigError
from relax_launch.models.sizes import ModelSize, model_size
from relax_launch.placement.critic_memory import (
    critic_assignment_of,
    critic_ranks,
    critic_state,
    critic_terms,
    named_terms,
    state_of,
    trainer_state,
    wanted_mode,
    with_critic_phases,
)
from relax_launch.placement.device_memory import GB, device_capacity
from relax_launch.placement.memory import (
    RUNTIME_BYTES,
    Term,
    engine_weight_bytes,
    kv_bytes_per_token,
    sglang_reserve_bytes,
    trainer_terms,
)
from relax_launch.placement.memory_fixes import consumers, fields, fixes
from relax_launch.placement.vision_memory import vision_engine_terms, vision_trainer_terms

if TYPE_CHECKING:
    from relax_launch.config.job import JobConfig
    from relax_launch.placement.plan import EnginePlan, PlacementPlan, RoleAssignment

# what a trainer holds only during a step
STEP_TERMS = ("activations", "logits", "vision activations", "pixel values")
ROUNDING = 1.001  # SGLang rounds its default mem_fraction_static to 3 decimals
COLOCATED_MARGIN = 0.03  # of capacity, kept free by a planned mem_fraction_static


@dataclass(frozen=True)
class Holder:
    """One role on one device in one phase: what it holds there, and in what state."""

    role: str  # "trainer" or an engine's label
    state: str  # "active", "offloaded", "released", "weights", ...
    terms: tuple[Term, ...]

    @property
    def device_bytes(self) -> float:
        return sum(t.bytes for t in self.terms if not t.host)


@dataclass(frozen=True)
class DevicePhase:
    rank: int
    node: int
    phase: str
    holders: tuple[Holder, ...]

    @property
    def total(self) -> float:
        return sum(h.device_bytes for h in self.holders)


@dataclass(frozen=True)
class EngineMemory:
    """What the plan decided for one engine: f, and the KV pool it gives."""

    label: str
    fraction: float | None  # mem_fraction_static (None on the CPU: max_total_tokens sizes it)
    fraction_source: str
    kv_tokens: int


@dataclass(frozen=True)
class MemoryPlan:
    device: str
    capacity: float  # bytes of one device
    capacity_source: str
    devices: tuple[DevicePhase, ...]
    engines: tuple[EngineMemory, ...]
    notes: tuple[str, ...] = field(default=())
    critic_mode: str | None = None  # where the value model's state is in the trainer's turn

    def peak(self, rank: int) -> DevicePhase:
        return max((d for d in self.devices if d.rank == rank), key=lambda d: d.total)

    def fraction_of(self, label: str) -> float | None:
        return next((e.fraction for e in self.engines if e.label == label), None)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)


def model_sizes(job: JobConfig) -> dict[str, ModelSize | None]:
    """Each model's size, by what serves it: trainer, a role (its default model), or a role's
    further model (``teacher.models[0]``: each model's engines hold their own weights)."""
    sizes = {"trainer": model_size(job.trainer.model), "rollout": model_size(job.rollout_model())}
    for name, role in job.inference_roles().items():
        if name != "rollout":
            sizes[name] = model_size(role.model)
        for i, extra in enumerate(role.models):
            sizes[f"{name}.models[{i}]"] = model_size(extra.model)
    if job.critic is not None:
        sizes["critic"] = model_size(job.critic.model or job.trainer.model)
    return sizes


def model_key(engine: EnginePlan) -> str:
    """The key of ``model_sizes`` for the model ``engine`` serves."""
    return engine.role if engine.model == 0 else f"{engine.role}.models[{engine.model - 1}]"


def engine_settings(job: JobConfig, engine: EnginePlan) -> dict:
    """The SGLang arguments of the model ``engine`` serves."""
    return job.inference_roles()[engine.role].model_sections()[engine.model].engine


def memory_plan(job: JobConfig, plan: PlacementPlan) -> MemoryPlan | None:
    """The plan's memory per device and phase; None when a model's size is unknown."""
    sizes = model_sizes(job)
    if any(s is None for s in sizes.values()):
        return None
    capacity, source = device_capacity(job)
    mode = wanted_mode(job, plan)
    if mode == "auto":  # the critic stays beside the policy if the devices hold both
        kept = _build(job, plan, sizes, (capacity, source), "keep")
        fits = all(d.total <= capacity * ROUNDING for d in kept.devices)
        return kept if fits else _build(job, plan, sizes, (capacity, source), "swap")
    return _build(job, plan, sizes, (capacity, source), mode)


def _build(
    job: JobConfig, plan: PlacementPlan, sizes: dict, capacity: tuple, critic: str | None
) -> MemoryPlan:
    builder = _Builder(job, plan, sizes, capacity[0], critic)
    devices = [d for rank in plan.ranks for d in builder.device(rank)]
    return MemoryPlan(
        device=job.cluster.device,
        capacity=capacity[0],
        capacity_source=capacity[1],
        devices=tuple(devices),
        engines=tuple(builder.engines.values()),
        notes=tuple(builder.notes),
        critic_mode=critic,
    )


def planned_fraction(job: JobConfig, plan: PlacementPlan, engine: EnginePlan) -> float | None:
    """The ``mem_fraction_static`` this plan gives a colocated GPU engine whose config sets
    none; None where SGLang's own default or the config's value stands."""
    settings = engine_settings(job, engine)
    if "mem_fraction_static" in settings or plan.mode == "decoupled":
        return None
    if job.cluster.device != "cuda":
        return None
    memory = memory_plan(job, plan)
    return memory.fraction_of(engine.label) if memory else None


def phases_of(plan: PlacementPlan) -> tuple[str, ...]:
    if plan.mode == "decoupled":
        return ("resident",)
    return ("sync", *plan.phase_order)


class _Builder:
    """Fills the plan one device at a time; engines' KV pools as their phases leave room."""

    def __init__(
        self, job: JobConfig, plan: PlacementPlan, sizes: dict, capacity: float, critic: str | None
    ) -> None:
        self.job, self.plan, self.sizes, self.capacity = job, plan, sizes, capacity
        self.critic = critic  # the value model's mode (placement/critic_memory.py), if any
        self.cuda = job.cluster.device == "cuda"
        self.engines: dict[str, EngineMemory] = {}
        self.notes: list[str] = []
        # the trainer's terms by pipeline stage, the critic's by ("critic", stage)
        self._trainer_cache: dict[int | tuple[str, int], list[Term]] = {}

    def device(self, rank: object) -> list[DevicePhase]:
        trainer = next((a for a in rank.assignments if a.role == "trainer"), None)
        critic = critic_assignment_of(self.plan, rank)  # its own rank, or a trainer rank
        engines = [
            self.plan.engines_of(a.role)[a.engine_index]
            for a in rank.assignments
            if a.engine_index is not None
        ]
        if any(e.pool for e in engines):  # one pool role's engine at a time holds the rank
            pool = [(f"pool: {e.role}", (self._active_engine(e, []),)) for e in engines]
            return [DevicePhase(rank.rank, rank.node, *phase) for phase in pool]
        out = []
        for phase in with_critic_phases(phases_of(self.plan), self.critic):
            others = []
            if trainer is not None:
                others.append(self._trainer(trainer.pp_rank, phase))
            if critic is not None and self.critic is not None:
                others.append(self._critic(critic, phase))
            waiting = [e for e in engines if not self._active(e, phase)]
            others += [self._idle_engine(e, phase) for e in waiting]
            active = [e for e in engines if self._active(e, phase)]
            holders = others + [self._active_engine(e, others) for e in active]
            out.append(DevicePhase(rank.rank, rank.node, phase, tuple(holders)))
        if self.plan.mode != "decoupled" and not self.job.starts_staggered:
            out.insert(0, self._side_by_side_start(rank, trainer, engines))
        return out

    def _side_by_side_start(self, rank: object, trainer: object, engines: list) -> DevicePhase:
        """Start-up without staggering: every engine loads beside the trainer being built (its
        model state; no batch yet), each sizing its KV cache from what the others left."""
        holders = []
        if trainer is not None:
            built = self._trainer(trainer.pp_rank, "train")
            state = [t for t in built.terms if t.name not in STEP_TERMS]
            holders.append(Holder("trainer", "built", tuple(state)))
            if self.critic is not None:
                holders.append(self._critic(trainer, "start-up"))
        for engine in engines:
            if not engine.reserved:
                holders.append(self._active_engine(engine, list(holders)))
        return DevicePhase(rank.rank, rank.node, "start-up", tuple(holders))

    def _active(self, engine: EnginePlan, phase: str) -> bool:
        return phase == "resident" or (phase == engine.phase and not engine.reserved)

    def _runtime(self, kind: str) -> Term:
        return Term("runtime", RUNTIME_BYTES[(self.job.cluster.device, kind)], "process, context")

    def _ranks(self) -> dict[str, int]:
        t, layout = self.job.trainer, self.plan.trainer
        ranks = {"tp": t.tp_size, "pp": t.pp_size, "dp": layout.dp_size}
        return ranks | {"cp": t.cp_size, "ep": t.ep_size}

    def _trainer(self, pp_rank: int, phase: str) -> Holder:
        if pp_rank not in self._trainer_cache:
            size, t = self.sizes["trainer"], self.job.trainer
            terms = trainer_terms(self.job, size, pp_rank, self._ranks())
            if size.vision is not None and pp_rank == 0:
                trained = not t.freeze_vision and t.lora is None
                terms += vision_trainer_terms(self.job, size, trained, self._ranks()["dp"])
            self._trainer_cache[pp_rank] = terms
        terms = [self._runtime("trainer"), *self._trainer_cache[pp_rank]]
        beside_critic = trainer_state(self.critic, phase)  # the critic's own phases
        if beside_critic == "state":
            return Holder("trainer", "state only", state_of(terms))
        if beside_critic == "parameters":
            return Holder("trainer", "parameters only", named_terms(terms, "runtime", "parameters"))
        if phase in ("resident", "train"):
            return Holder("trainer", "active", tuple(terms))
        if phase == "sync":  # the parameters send the weights; the rest is on the host
            kept = [t for t in terms if t.name in ("runtime", "parameters")]
            return Holder("trainer", "parameters only", tuple(kept))
        return Holder("trainer", "offloaded", (terms[0],))

    def _critic(self, assignment: RoleAssignment, phase: str) -> Holder:
        """The value model on a trainer rank, or alone on one of its own, with its process
        (``placement/critic_memory.py``)."""
        key, own = ("critic", assignment.pp_rank), assignment.role == "critic"
        if key not in self._trainer_cache:
            size, ranks = self.sizes["critic"], critic_ranks(self.plan, self._ranks())
            self._trainer_cache[key] = critic_terms(self.job, size, key[1], ranks)
        state, names = critic_state(self.critic, phase, own)
        terms = [self._runtime("trainer")] * own + self._trainer_cache[key]
        return Holder(
            "critic", state, tuple(terms) if names is None else named_terms(terms, *names)
        )

    def _idle_engine(self, engine: EnginePlan, phase: str) -> Holder:
        terms = [self._runtime("engine")]
        if phase == "sync" and engine.role == "rollout":
            size, dtype = self.sizes["rollout"], self.job.engine_dtype("rollout")
            weights = engine_weight_bytes(size, engine, dtype)
            terms.append(Term("weights", weights, f"{dtype}, / TP {engine.tp_size}"))
            return Holder(engine.label, "weights", tuple(terms))
        return Holder(engine.label, "released", tuple(terms))

    def _active_engine(self, engine: EnginePlan, others: list[Holder]) -> Holder:
        size = self.sizes[model_key(engine)]
        settings = engine_settings(self.job, engine)
        dtype = settings.get("dtype", self.job.engine_dtype(engine.role))
        weights = engine_weight_bytes(size, engine, dtype)
        per_token = kv_bytes_per_token(size, engine, dtype)
        terms = [
            self._runtime("engine"),
            Term("weights", weights, f"{dtype}, / TP {engine.tp_size} x PP {engine.pp_size}"),
        ]
        if not self.cuda:  # the CPU engine's pool is max_total_tokens (required there)
            tokens = int(settings.get("max_total_tokens", 0))
            self._record(engine, None, "cpu: max_total_tokens", tokens)
            terms.append(Term("KV cache", tokens * per_token, f"{tokens} tokens"))
            terms += vision_engine_terms(size.vision, None, "cpu", self.capacity)[1]
            return Holder(engine.label, "active", tuple(terms))
        reserve = sglang_reserve_bytes(self.capacity, engine, settings)
        resident = sum(h.device_bytes for h in others) + terms[0].bytes
        fraction, source = self._fraction(engine, settings, reserve)
        fraction, vision = vision_engine_terms(size.vision, fraction, source, self.capacity)
        cache = sum(t.bytes for t in vision if t.name == "multimodal cache")  # from KV's budget
        pool = fraction * self.capacity - weights - resident - cache
        tokens = max(int(pool // per_token), 0)
        if "max_total_tokens" in settings:
            tokens = min(tokens, int(settings["max_total_tokens"]))
        self._record(engine, fraction, source, tokens)
        terms += [
            Term("KV cache", tokens * per_token, f"{tokens} tokens, f={fraction:.3f} ({source})"),
            Term("workspace", reserve, "SGLang's reserve: a prefill chunk, CUDA graphs"),
            *vision,
        ]
        return Holder(engine.label, "active", tuple(terms))

    def _fraction(self, engine: EnginePlan, settings: dict, reserve: float) -> tuple[float, str]:
        if "mem_fraction_static" in settings:
            return float(settings["mem_fraction_static"]), "config"
        if self.plan.mode == "decoupled":
            return round((self.capacity - reserve) / self.capacity, 3), "SGLang's default"
        free = 1 - reserve / self.capacity - COLOCATED_MARGIN
        return math.floor(free * 1000) / 1000, "planned"

    def _record(self, engine: EnginePlan, fraction: float | None, source: str, tokens: int):
        known = self.engines.get(engine.label)
        if known is None or tokens < known.kv_tokens:  # the tightest of its devices
            self.engines[engine.label] = EngineMemory(engine.label, fraction, source, tokens)


def check_memory(job: JobConfig, memory: MemoryPlan) -> None:
    """Refuse a plan whose devices do not hold what its phases put there, or whose engines'
    KV pools cannot hold one sequence, naming the device, the phase, the largest consumers and
    what to change."""
    for phase in memory.devices:
        if phase.total > memory.capacity * ROUNDING:
            raise ConfigError(_overflow(job, memory, phase), fields(job, phase))
    needed = job.data.max_prompt_tokens + job.data.max_response_tokens
    for engine in memory.engines:
        if engine.kv_tokens < needed:
            role = engine.label.split()[0]
            raise ConfigError(
                f"{engine.label}: its KV cache holds {engine.kv_tokens} tokens, less than one "
                f"sequence ({needed}: data.max_prompt_tokens + max_response_tokens), on "
                f"{memory.capacity / GB:.0f} GB devices ({memory.capacity_source}): raise "
                f"{role}.tp_size, lower what shares its devices, or "
                + (
                    "raise max_total_tokens."
                    if engine.fraction is None
                    else f"raise {role}.engine.mem_fraction_static (now {engine.fraction:.3f})."
                ),
                (f"{role}.tp_size",),
            )


def _overflow(job: JobConfig, memory: MemoryPlan, phase: DevicePhase) -> str:
    largest = ", ".join(f"{role} {t.name} {t.bytes / GB:.1f} GB" for role, t in consumers(phase))
    return (
        f"rank {phase.rank} (node {phase.node}) needs {phase.total / GB:.1f} GB in phase "
        f"'{phase.phase}' but a device has {memory.capacity / GB:.1f} GB "
        f"({memory.capacity_source}); largest: {largest}. {fixes(job, phase)} "
        "(relax-launch plan CONFIG shows every device's phases)."
    )
