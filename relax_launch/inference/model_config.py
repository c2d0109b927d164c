"""Several models behind one static role (teacher, genrm): the config of each further model.

The role's own fields describe its default model, so a one-model config reads as before;
``{role}.models`` lists the others, each with its engines (its ranks, tp_size, pp_size and
SGLang arguments) and the names requests choose it by (``model_id``, ``aliases``,
``route_keys``). The planner places each model's engines after the default model's ones, on
ranks of their own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import Field, field_validator

from relax_launch.config.section import Section

# SGLang server arguments that the planner sets per engine; a user value would contradict it.
PLANNER_OWNED_ENGINE_KEYS = frozenset(
    {
        "model_path",
        "tp_size",
        "pp_size",
        "dp_size",
        "nnodes",
        "node_rank",
        "base_gpu_id",
        "gpu_id_step",
        "dist_init_addr",
        "host",
        "port",
        "nccl_port",
        "device",
    }
)


def check_engine_keys(engine: dict[str, Any]) -> dict[str, Any]:
    """``engine`` unless it sets what the planner owns."""
    owned = sorted(PLANNER_OWNED_ENGINE_KEYS.intersection(engine))
    if owned:
        raise ValueError(
            f"{', '.join(owned)} are set by the placement planner; remove them from engine "
            "(use tp_size and pp_size of the role instead)"
        )
    return engine


ROLLOUT_HAS_ONE_MODEL = (
    "rollout serves one model: the policy, whose weights the trainer syncs into every rollout "
    "engine after each step; a second model would be a second policy with no trainer. Remove "
    "rollout.models (teacher and genrm may list models)."
)


@dataclass(frozen=True)
class ServedModel:
    """One model of a role as its manager serves it: the name its engines report, its
    vocabulary (token ids outside it are refused before the engine), and for a model that
    takes images (a vision-language model; inference/images.py) its image placeholder token."""

    served_model_name: str
    vocab_size: int | None = None
    image_token_id: int | None = None


def default_model_id(model: str) -> str:
    """builtin:NAME -> NAME, a directory -> its last part."""
    return model.removeprefix("builtin:").rstrip("/").rsplit("/", 1)[-1]


class ModelNames(Section):
    """The names requests choose a model by."""

    model_id: str | None = Field(
        None,
        min_length=1,
        description="The id requests name in 'model'; default the model's name (builtin:NAME "
        "-> NAME, a directory -> its last part). The model reference is always an alias.",
    )
    aliases: tuple[str, ...] = Field((), description="More names requests may use for the model.")
    route_keys: tuple[str, ...] = Field(
        (),
        description="Values of a request's 'route_key' that select this model. The RL loop "
        "sends a sample's data source (data.data_source_key) as the teacher's route_key, and a "
        "reward source's name as the genrm's.",
    )


class RoleModelConfig(ModelNames):
    """One further model of a role, on engines of its own."""

    model: str = Field(description="Model: a Hugging Face directory or builtin:NAME.")
    ranks: int = Field(1, ge=1, description="Ranks of this model's engines, in total.")
    tp_size: int = Field(1, ge=1, description="Engine tensor-parallel size.")
    pp_size: int = Field(
        1, ge=1, description="Engine pipeline-parallel size; tp_size x pp_size ranks an engine."
    )
    engine: dict[str, Any] = Field(
        default_factory=dict,
        description="Extra SGLang server arguments, over the role's own engine arguments.",
    )

    @field_validator("engine")
    @classmethod
    def _engine_keys_not_planner_owned(cls, engine: dict[str, Any]) -> dict[str, Any]:
        return check_engine_keys(engine)

    def resolved_model_id(self) -> str:
        return self.model_id or default_model_id(self.model)


def models_problem(role: Any) -> str:
    """Why ``role`` (an ``InferenceRoleConfig`` with ``models``) cannot serve its models as
    configured; '' when it can."""
    if role.max_engines is not None:
        return (
            "models with max_engines: scaling engines in and out is built for a role of one "
            "model (its reserved ranks and engine indices); remove max_engines or models"
        )
    # a model reference is an alias only while no other model shares it (control_plane.py)
    names = {"model": (role.resolved_model_id(role.model), *role.aliases)}
    keys = {"route_keys": role.route_keys}
    for i, m in enumerate(role.models):
        names[f"models[{i}]"] = (m.resolved_model_id(), *m.aliases)
        keys[f"models[{i}].route_keys"] = m.route_keys
    return name_clashes(names, keys)


def name_clashes(models: dict[str, tuple[str, ...]], route_keys: dict[str, tuple[str, ...]]) -> str:
    """Why requests could not tell the models apart ('' when they can): ``models`` maps each
    model's field path to its id and aliases, ``route_keys`` to its route keys."""
    for kind, names in (("model ids and aliases", models), ("route_keys", route_keys)):
        owners: dict[str, list[str]] = {}
        for field, values in names.items():
            for value in dict.fromkeys(values):
                owners.setdefault(value, []).append(field)
        shared = {v: f for v, f in owners.items() if len(f) > 1}
        if shared:
            listed = "; ".join(f"{v!r} in {', '.join(f)}" for v, f in sorted(shared.items()))
            return (
                f"the role's models share {kind} ({listed}): give each model its own "
                "(model_id, aliases, route_keys)"
            )
    return ""


def model_sections(role: Any) -> tuple[Any, ...]:
    """``role``'s models as sections of their own (``InferenceRoleConfig``): the default first
    (the role without ``models``), then each of ``models`` with its engines, its own engine
    arguments over the role's (no prefill or reserved engines: those are the default model's)."""
    shared = {"prefill": None, "max_engines": None, "autoscale": None, "models": ()}
    further = (
        role.model_copy(
            update={
                **shared,
                **m.model_dump(exclude={"engine"}),
                "engine": {**role.engine, **m.engine},
            }
        )
        for m in role.models
    )
    return (role.model_copy(update={"models": ()}), *further)
