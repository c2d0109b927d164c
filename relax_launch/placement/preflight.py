"""Preflight: checks that need the models' own configs or the filesystem, before any process.

``plan()`` proves the layout is possible; ``preflight()`` proves the models fit that layout
(heads divisible by TP, layers by PP, rollout shaped like the trainer, teacher sharing the
student's vocabulary) and that named files exist.
"""

from __future__ import annotations

import ctypes.util
import importlib.util
from pathlib import Path
from typing import TYPE_CHECKING

from relax_launch.config.errors import ConfigError
from relax_launch.models.registry import (
    BUILTIN_MODELS,
    ModelFacts,
    builtin_name,
    model_facts,
)
from relax_launch.placement.memory_plan import check_memory, memory_plan, model_key, model_sizes
from relax_launch.placement.plan import EnginePlan, PlacementPlan
from relax_launch.rl.reasoning_gym_config import PREFIX as REASONING_GYM

if TYPE_CHECKING:
    from relax_launch.config.job import JobConfig


def preflight(job: JobConfig, plan: PlacementPlan, *, require_models: bool = True) -> list[str]:
    """Check models and files against ``plan``; returns warnings for checks it could not run.

    With ``require_models`` (the launcher), a model without a readable config.json or a missing
    dataset file is an error; without it (``relax-launch plan`` away from the cluster's
    filesystem) it is a warning.
    """
    warnings = []
    models = models_of(job)
    facts: dict[str, ModelFacts] = {}
    for role, ref in models.items():
        found = _facts_or_problem(role, ref, require_models)
        if isinstance(found, str):
            warnings.append(found)
        else:
            facts[role] = found
    _check_trainer_fits(job, facts.get("trainer"))
    warnings += _check_critic_fits(job, facts.get("trainer"), require_models)
    for key in models:
        if key != "trainer":  # every model's engines: a role's default and further models
            _check_engine_fits(job, plan, key, facts.get(key))
    _check_shared_shapes(facts)
    _check_kv_transfer(job)
    dataset_problem = _dataset_problem(job.data.dataset)
    if dataset_problem and require_models:
        raise ConfigError(dataset_problem, ("data.dataset",))
    warnings += [dataset_problem] if dataset_problem else []
    missing = [d for d in job.gateway.images.allowed_dirs if not Path(d).is_dir()]
    if missing:  # the gateway would refuse every file there
        problem = (
            f"gateway.images.allowed_dirs: {missing} are not directories here; create them or "
            "remove them from the list"
        )
        if require_models:
            raise ConfigError(problem, ("gateway.images.allowed_dirs",))
        warnings.append(problem)
    notices = (job.precision_notice(), job.off_policy_notice(), _check_memory(job, plan))
    return warnings + [notice for notice in notices if notice]


def _check_memory(job: JobConfig, plan: PlacementPlan) -> str | None:
    """Refuse a plan whose devices cannot hold their phases; a note when a model's size is
    unknown (``relax-launch plan`` away from the model files)."""
    memory = memory_plan(job, plan)
    if memory is None:
        unknown = [role for role, size in model_sizes(job).items() if size is None]
        return f"memory not planned: the size of {', '.join(unknown)}'s model is unknown"
    check_memory(job, memory)
    return None


def models_of(job: JobConfig) -> dict[str, str]:
    """The model reference of the trainer, of each inference role and of each further model of
    a role (``teacher.models[0]``), keyed as ``memory_plan.model_key`` keys engines."""
    models = {"trainer": job.trainer.model, "rollout": job.rollout_model()}
    for name, role in job.inference_roles().items():
        if name != "rollout":
            models[name] = role.model
        models.update({f"{name}.models[{i}]": m.model for i, m in enumerate(role.models)})
    return models


def _facts_or_problem(role: str, ref: str, require: bool) -> ModelFacts | str:
    field = "trainer.model" if role == "trainer" else f"{role}.model"
    name = builtin_name(ref)
    if name is not None and name not in BUILTIN_MODELS:
        raise ConfigError(
            f"{field}={ref!r} is not a builtin model; choose one of "
            + ", ".join(f"builtin:{m}" for m in BUILTIN_MODELS)
            + " or give a model directory.",
            (field,),
        )
    facts = model_facts(ref)
    if facts is None:
        message = (
            f"{field}={ref!r} has no readable config.json, so its shape checks were skipped; "
            "point it at a Hugging Face model directory."
        )
        if require:
            raise ConfigError(message, (field,))
        return message
    if not facts.has_architectures:
        raise ConfigError(
            f"{field}={ref!r}: config.json has no 'architectures' entry, which SGLang needs to "
            'pick the model class: add e.g. "architectures": ["LlamaForCausalLM"].',
            (field,),
        )
    return facts


def _check_trainer_fits(job: JobConfig, facts: ModelFacts | None) -> None:
    if facts is None:
        return
    if facts.not_trainable:
        raise ConfigError(
            f"trainer.model={job.trainer.model!r}: {facts.not_trainable}. Train a model of a "
            "supported family; teacher and genrm engines may serve any model SGLang runs.",
            ("trainer.model",),
        )
    tp, pp = job.trainer.tp_size, job.trainer.pp_size
    _check_heads(facts, tp, "trainer.tp_size")
    if facts.num_layers % pp:
        raise ConfigError(
            f"trainer.pp_size={pp} must divide the model's {facts.num_layers} layers: choose a "
            "pp_size dividing the layer count.",
            ("trainer.pp_size",),
        )
    _check_experts_fit(job, facts)


def _check_heads(facts: ModelFacts, tp: int, field: str) -> None:
    """Tensor parallelism splits the attention and the key/value heads: ``tp`` divides both."""
    if facts.num_attention_heads % tp or facts.num_key_value_heads % tp:
        raise ConfigError(
            f"{field}={tp} must divide the model's {facts.num_attention_heads} attention "
            f"heads and {facts.num_key_value_heads} key/value heads: choose a tp_size dividing "
            f"both (e.g. {_largest_common_divisor(facts, tp)}).",
            (field,),
        )


def _check_critic_fits(job: JobConfig, policy: ModelFacts | None, require: bool) -> list[str]:
    """The value model (``critic.model``, else the policy's) is dense and its tensor
    parallelism (``critic.tp_size`` on ranks of its own) divides its heads; a warning when its
    config cannot be read and ``require`` is off."""
    critic = job.critic
    if critic is None:
        return []
    facts: ModelFacts | str | None = policy
    if critic.model and critic.model != job.trainer.model:
        facts = _facts_or_problem("critic", critic.model, require)
    if facts is None or isinstance(facts, str):
        return [facts] if facts else []
    if facts.num_experts:
        raise ConfigError(
            f"critic.model={critic.model or job.trainer.model!r} is a mixture-of-experts model: "
            "the value model is dense-only for now; set critic.model to a dense model.",
            ("critic.model",),
        )
    if critic.own_ranks:
        _check_heads(facts, critic.own_layout(job.trainer)[0], "critic.tp_size")
    elif facts is not policy:  # the trainer's layout, another model
        _check_heads(facts, job.trainer.tp_size, "trainer.tp_size")
    return []


def _check_experts_fit(job: JobConfig, facts: ModelFacts) -> None:
    ep, experts = job.trainer.ep_size, facts.num_experts
    if ep > 1 and not experts:
        raise ConfigError(
            f"trainer.ep_size={ep} but {job.trainer.model!r} is a dense model (no experts): set "
            "trainer.ep_size=1, or train a mixture-of-experts model.",
            ("trainer.ep_size",),
        )
    if experts % ep:
        raise ConfigError(
            f"trainer.ep_size={ep} must divide the model's {experts} experts: choose an ep_size "
            "dividing it.",
            ("trainer.ep_size",),
        )
    if job.algorithm.records_routing and not experts:
        which = "routing_replay" if job.algorithm.routing_replay else "control.routing_replay"
        raise ConfigError(
            f"algorithm.{which} replays the experts a mixture-of-experts model routed "
            f"to; {job.trainer.model!r} is dense: turn it off.",
            (f"algorithm.{which}",),
        )
    if experts and job.trainer.lora is not None:
        raise ConfigError(
            f"trainer.lora on {job.trainer.model!r}, a mixture-of-experts model: adapters on "
            "experts are not supported yet; train every weight (remove trainer.lora).",
            ("trainer.lora",),
        )


def _check_engine_fits(
    job: JobConfig, plan: PlacementPlan, key: str, facts: ModelFacts | None
) -> None:
    """The engines of one model (``key``: a role, or one of its further models)."""
    engines = [e for e in plan.engines if model_key(e) == key]
    if facts is None or not engines:
        return
    for engine in {(e.tp_size, e.pp_size, e.disaggregation): e for e in engines}.values():
        _check_engine_shape(job, key, engine, facts)


def _check_engine_shape(job: JobConfig, role: str, engine: EnginePlan, facts: ModelFacts) -> None:
    """One engine shape of ``role`` (a disaggregated role has two: its decode and prefill
    engines, named by their own fields)."""
    tp, pp = engine.tp_size, engine.pp_size
    role = f"{role}.prefill" if engine.disaggregation == "prefill" else role
    kv = facts.num_key_value_heads
    if facts.num_attention_heads % tp or (kv % tp and tp % kv):
        raise ConfigError(
            f"{role} engine tp_size={tp} must divide the model's {facts.num_attention_heads} "
            f"attention heads, and divide or be a multiple of its {kv} key/value heads: change "
            f"{role}.tp_size.",
            (f"{role}.tp_size",),
        )
    if pp > facts.num_layers:
        raise ConfigError(
            f"{role}.pp_size={pp} exceeds the model's {facts.num_layers} layers: lower it.",
            (f"{role}.pp_size",),
        )
    if pp > 1 and facts.tied_embeddings and facts.architecture == "LlamaForCausalLM":
        raise ConfigError(
            f"{role} engines with pp_size > 1 cannot serve {models_of(job)[model_key(engine)]!r}: "
            "SGLang's Llama takes a tied head from the embedding, which its last pipeline "
            f"stage does not hold. Set {role}.pp_size=1 (and tp_size instead).",
            (f"{role}.pp_size",),
        )


def _check_shared_shapes(facts: dict[str, ModelFacts]) -> None:
    trainer, rollout = facts.get("trainer"), facts.get("rollout")
    if trainer and rollout and trainer != rollout:
        raise ConfigError(
            "rollout.model and trainer.model differ in shape (layers, hidden size, heads or "
            "vocabulary), so trained weights cannot be synced into the rollout engines: leave "
            "rollout.model unset to serve the trainer's model.",
            ("rollout.model", "trainer.model"),
        )
    teachers = {k: f for k, f in facts.items() if k.partition(".")[0] == "teacher"}
    for key, teacher in teachers.items():
        if rollout and teacher.vocab_size != rollout.vocab_size:
            raise ConfigError(
                f"{key}.model has a {teacher.vocab_size}-token vocabulary but the student has "
                f"{rollout.vocab_size}; on-policy distillation scores the student's tokens with "
                "the teacher, so both must share one tokenizer: pick a teacher of the same "
                "family.",
                (f"{key}.model",),
            )


def _check_kv_transfer(job: JobConfig) -> None:
    """Prefill/decode engines move KV caches with Mooncake's transfer engine, whose library
    loads RDMA's user-space libraries even to speak TCP."""
    fields = tuple(f"{n}.prefill" for n, r in job.inference_roles().items() if r.prefill)
    if not fields:
        return
    missing = []
    if importlib.util.find_spec("mooncake") is None:
        wheel = "-non-cuda" if job.cluster.device == "cpu" else ""
        missing.append(f"the Python package mooncake-transfer-engine{wheel} (scripts/bootstrap.sh)")
    if ctypes.util.find_library("ibverbs") is None or ctypes.util.find_library("rdmacm") is None:
        missing.append("libibverbs1 and librdmacm1 (sudo bash scripts/install_kv_transfer_libs.sh)")
    if missing:
        raise ConfigError(
            f"{', '.join(fields)} moves KV caches with Mooncake's transfer engine, which needs "
            f"{' and '.join(missing)} on every node: install them, or remove {fields[0]}.",
            fields,
        )


def _dataset_problem(dataset: str) -> str | None:
    generated = dataset.startswith(("builtin:", REASONING_GYM))  # made from the seed
    if generated or Path(dataset).expanduser().exists():
        return None
    return (
        f"data.dataset={dataset!r} does not exist: give an existing .jsonl or .parquet file, a "
        "dataset directory, a builtin:NAME or a reasoning_gym:TASK dataset."
    )


def _largest_common_divisor(facts: ModelFacts, below: int) -> int:
    return max(
        d
        for d in range(1, below + 1)
        if facts.num_attention_heads % d == 0 and facts.num_key_value_heads % d == 0
    )


def check_runnable(job: JobConfig, plan: PlacementPlan) -> None:
    """What the planner accepts but the runtime cannot start yet (``relax-launch plan`` still
    shows such a plan; ``run``, ``sbatch`` and every rank refuse it before starting anything).

    An engine spanning nodes runs (one SGLang process per node), in ``decoupled`` placement and
    without ``fault_tolerance`` on its role: a restart brings back one node's process, not the
    engine, and colocated phases move memory on one node's process only."""
    wide = [e for e in plan.engines if len(e.nodes) > 1]
    if not wide:
        return
    named = ", ".join(f"{e.role} engine {e.index} (nodes {list(e.nodes)})" for e in wide)
    fields = tuple(dict.fromkeys(f"{e.role}.tp_size" for e in wide))
    if plan.mode != "decoupled":
        raise ConfigError(
            f"{named} would span nodes in placement.mode {plan.mode}: an engine wider than a "
            "node runs in decoupled placement only; give each engine at most "
            "cluster.nproc_per_node ranks (tp_size x pp_size), or use decoupled.",
            ("placement.mode", *fields),
        )
    tolerant = list(dict.fromkeys(e.role for e in wide if job.fault_tolerant(e.role)))
    if tolerant:
        switches = [f"{role}.fault_tolerance" for role in tolerant]
        raise ConfigError(
            f"{named} would span nodes with {' and '.join(switches)} on: a dead node process "
            f"cannot be restarted alone; set {'=false and '.join(switches)}=false or fit each "
            "such engine inside a node.",
            (*switches, *fields),
        )
