"""plan(): config + world shape -> PlacementPlan, rejecting every impossible layout first.

Pure arithmetic: no torch, no process group, no filesystem. Every rejection is a ConfigError
naming the config fields at fault and what to change.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

from relax_launch.config.errors import ConfigError
from relax_launch.models.registry import model_facts
from relax_launch.placement.critic_ranks import critic_assignment, critic_layout, critic_rank_count
from relax_launch.placement.plan import (
    EnginePlan,
    PlacementPlan,
    RankPlan,
    RoleAssignment,
    TrainerLayout,
    WeightSyncGroup,
    sync_rank_offsets,
)
from relax_launch.placement.spans import check_engine_span
from relax_launch.placement.spare_pool import check_pool, place_pool, pooled_ranks

if TYPE_CHECKING:
    from relax_launch.config.job import JobConfig
    from relax_launch.inference.config import InferenceRoleConfig

# Inference roles in the order they take rank slices (decoupled, split) and phases (defer).
SLICE_ORDER = ("rollout", "genrm", "teacher")
DEFER_PHASE_ORDER = ("rollout", "teacher", "genrm")


def plan(
    job: JobConfig,
    *,
    nnodes: int | None = None,
    nproc_per_node: int | None = None,
    world_size: int | None = None,
) -> PlacementPlan:
    """Place every role of ``job`` on ``nnodes x nproc_per_node`` ranks (default: job.cluster).

    ``world_size``, when given (torchrun's WORLD_SIZE), must equal nnodes x nproc_per_node.
    """
    nnodes = nnodes or job.cluster.nnodes
    per_node = nproc_per_node or job.cluster.nproc_per_node
    world = nnodes * per_node
    if world_size is not None and world_size != world:
        raise ConfigError(
            f"the launcher started {world_size} ranks but cluster.nnodes x cluster.nproc_per_node"
            f" = {nnodes} x {per_node} = {world}: make torchrun's --nnodes/--nproc-per-node match"
            " the config (or override cluster.nnodes / cluster.nproc_per_node).",
            ("cluster.nnodes", "cluster.nproc_per_node"),
        )
    starts = _role_starts(job, world)
    trainer = _trainer_layout(job, world, per_node)
    critic = critic_layout(job, per_node)  # the value model's own ranks, if it has them
    engines = _engines(job, starts, per_node)
    _check_batch(job, trainer)
    return PlacementPlan(
        mode=job.placement.mode,
        nnodes=nnodes,
        nproc_per_node=per_node,
        ranks=_rank_plans(world, per_node, trainer, engines, critic),
        engines=engines,
        trainer=trainer,
        phase_order=_phase_order(job),
        weight_sync_groups=_weight_sync_groups(trainer, engines),
        config_digest=hashlib.sha256(job.model_dump_json().encode()).hexdigest()[:16],
        critic=critic,
    )


def _role_starts(job: JobConfig, world: int) -> dict[str, int]:
    """First global rank of each inference role, after checking the rank budget."""
    roles = job.inference_roles()
    mode = job.placement.mode
    budget = " + ".join(
        f"{n}.ranks={roles[n].ranks}" if pooled_ranks(job, n) else _ranks_field(n, roles[n])
        for n in SLICE_ORDER
        if n in roles
    )
    if mode == "defer":
        too_big = [n for n in SLICE_ORDER if n in roles and roles[n].total_ranks > world]
        if too_big:
            raise ConfigError(
                f"placement.mode=defer runs each role on ranks 0.. of the {world}-rank world, but "
                + ", ".join(f"{n}.ranks={roles[n].ranks}" for n in too_big)
                + f" exceed it: lower them to at most {world} or add ranks to the cluster.",
                tuple(f"{n}.ranks" for n in too_big),
            )
        return {n: 0 for n in roles}
    check_pool(job)
    critic = critic_rank_count(job)  # the value model's own ranks follow the trainer's
    offset = job.trainer.ranks + critic if mode == "decoupled" else 0
    starts = {}
    for name in SLICE_ORDER:
        if name in roles:
            starts[name] = offset
            offset += roles[name].total_ranks - pooled_ranks(job, name)
    if job.cluster.spare_ranks:  # the shared spare pool's, after every role's
        starts["spare"] = offset
        offset += job.cluster.spare_ranks
        budget += f" + cluster.spare_ranks={job.cluster.spare_ranks}"
    fields = tuple(f"{n}.ranks" for n in roles)
    if mode == "split" and offset > world:
        raise ConfigError(
            f"placement.mode=split gives inference roles disjoint slices of the {world} trainer "
            f"ranks, but {budget} = {offset}: same-phase co-residency is unsupported. Lower them "
            "to fit, or use placement.mode=defer to run the roles in separate phases.",
            fields,
        )
    if mode == "decoupled" and offset != world:
        verb = "leaves" if offset < world else "needs"
        gap = abs(world - offset)
        raise ConfigError(
            f"placement.mode=decoupled needs every rank owned by exactly one role, but "
            f"trainer.ranks={job.trainer.ranks} + "
            + (f"critic.tp_size x critic.dp_size={critic} + " if critic else "")
            + f"{budget} = {offset} for a {world}-rank world "
            f"({verb} {gap} rank{'s' * (gap != 1)}{' idle' if offset < world else ' more'}): "
            "change the roles' ranks or cluster.nnodes / cluster.nproc_per_node to match.",
            ("trainer.ranks", *(("critic.tp_size", "critic.dp_size") if critic else ()), *fields),
        )
    return starts


def _ranks_field(name: str, role: InferenceRoleConfig) -> str:
    """``rollout.ranks=2``; with prefill engines ``(rollout.ranks=1 + rollout.prefill.ranks=1)``;
    with further models ``(teacher.ranks=1 + teacher.models[0].ranks=1)``."""
    if role.models:
        models = (f"{name}.models[{i}].ranks={m.ranks}" for i, m in enumerate(role.models))
        return f"({' + '.join((_ranks_field(name, role.model_sections()[0]), *models))})"
    if role.reserved_engines:
        reserved = role.reserved_engines * role.ranks_per_engine
        return f"({name}.ranks={role.ranks} + {reserved} reserved for {name}.max_engines)"
    if role.prefill is None:
        return f"{name}.ranks={role.ranks}"
    return f"({name}.ranks={role.ranks} + {name}.prefill.ranks={role.prefill.ranks})"


def _trainer_layout(job: JobConfig, world: int, per_node: int) -> TrainerLayout:
    cfg = job.trainer
    num = cfg.ranks if job.placement.mode == "decoupled" else world
    if num % (cfg.tp_size * cfg.cp_size * cfg.pp_size):
        raise ConfigError(
            f"trainer tp_size x cp_size x pp_size = {cfg.tp_size} x {cfg.cp_size} x "
            f"{cfg.pp_size} does not divide the {num} trainer ranks: choose sizes whose product "
            f"divides {num}.",
            ("trainer.tp_size", "trainer.cp_size", "trainer.pp_size"),
        )
    if cfg.tp_size > per_node or per_node % cfg.tp_size:
        raise ConfigError(
            f"trainer.tp_size={cfg.tp_size} would make a tensor-parallel group cross a node "
            f"boundary ({per_node} ranks per node): use a tp_size that divides "
            f"cluster.nproc_per_node={per_node}, and pp_size or data parallelism across nodes.",
            ("trainer.tp_size", "cluster.nproc_per_node"),
        )
    dp_size = num // (cfg.tp_size * cfg.cp_size * cfg.pp_size)
    if dp_size % cfg.ep_size:
        raise ConfigError(
            f"trainer.ep_size={cfg.ep_size} must divide the trainer's data-parallel size "
            f"{dp_size} ({num} ranks / tp_size {cfg.tp_size} / pp_size {cfg.pp_size}): experts "
            "are split over data-parallel ranks. Choose an ep_size dividing it, or more ranks.",
            ("trainer.ep_size", "trainer.ranks"),
        )
    phase = "resident" if job.placement.mode == "decoupled" else "train"
    facts = model_facts(cfg.model)
    return TrainerLayout(
        ranks=tuple(range(num)),
        tp_size=cfg.tp_size,
        pp_size=cfg.pp_size,
        dp_size=dp_size,
        phase=phase,
        ep_size=cfg.ep_size,
        num_experts=facts.num_experts if facts is not None else 0,
        cp_size=cfg.cp_size,
    )


def _engines(job: JobConfig, starts: dict[str, int], per_node: int) -> tuple[EnginePlan, ...]:
    """Every engine, role by role; a disaggregated role's decode engines first (indices 0..),
    then its prefill engines, on the ranks after them."""
    engines: list[EnginePlan] = []
    for name in SLICE_ORDER:
        role = job.inference_roles().get(name)
        if role is None:
            continue
        prefill = role.prefill
        halves = [(name, role, "decode" if prefill is not None else None)]
        if prefill is not None:
            halves.append((f"{name}.prefill", prefill, "prefill"))
        for field, shape, _ in halves:
            if shape.ranks % shape.ranks_per_engine:
                width = shape.ranks_per_engine
                raise ConfigError(
                    f"{field}.ranks={shape.ranks} is not a multiple of one engine's {width} "
                    f"ranks ({field}.tp_size x {field}.pp_size): set {field}.ranks to a "
                    f"multiple of {width} (engines are whole).",
                    (f"{field}.ranks", f"{field}.tp_size"),
                )
        if prefill is not None:
            _check_pairs(name, role.num_engines, prefill.num_engines)
        first = starts[name]
        for field, shape, disaggregation in halves:
            width = shape.ranks_per_engine
            own = shape.reserved_engines if not pooled_ranks(job, name) else 0
            for n in range(shape.num_engines + own):
                check_engine_span(field, len(engines_of(engines, name)), first, width, per_node)
                ranks = tuple(range(first, first + width))
                engines.append(
                    EnginePlan(
                        role=name,
                        index=len(engines_of(engines, name)),
                        ranks=ranks,
                        tp_size=shape.tp_size,
                        pp_size=shape.pp_size,
                        phase=_inference_phase(job.placement.mode, name),
                        nodes=tuple(sorted({r // per_node for r in ranks})),
                        disaggregation=disaggregation,
                        reserved=n >= shape.num_engines,
                    )
                )
                first += width
        _place_models(engines, job, name, first, per_node)
    if "spare" in starts:
        place_pool(engines, job, starts["spare"], per_node, _inference_phase("decoupled", ""))
    return tuple(engines)


def _place_models(
    engines: list[EnginePlan], job: JobConfig, name: str, first: int, per_node: int
) -> None:
    """The engines of the role's further models (``{name}.models``), from rank ``first`` on,
    one model after another."""
    for number, section in enumerate(job.inference_roles()[name].model_sections()[1:], 1):
        field, width = f"{name}.models[{number - 1}]", section.ranks_per_engine
        if section.ranks % width:
            raise ConfigError(
                f"{field}.ranks={section.ranks} is not a multiple of one engine's {width} ranks "
                f"({field}.tp_size x {field}.pp_size): set {field}.ranks to a multiple of "
                f"{width} (engines are whole).",
                (f"{field}.ranks", f"{field}.tp_size"),
            )
        for _ in range(section.num_engines):
            index = len(engines_of(engines, name))
            check_engine_span(field, index, first, width, per_node)
            ranks = tuple(range(first, first + width))
            engines.append(
                EnginePlan(
                    role=name,
                    index=index,
                    ranks=ranks,
                    tp_size=section.tp_size,
                    pp_size=section.pp_size,
                    phase=_inference_phase(job.placement.mode, name),
                    nodes=tuple(sorted({r // per_node for r in ranks})),
                    model=number,
                )
            )
            first += width


def engines_of(engines: list[EnginePlan], role: str) -> list[EnginePlan]:
    return [e for e in engines if e.role == role]


def _check_pairs(name: str, decode_engines: int, prefill_engines: int) -> None:
    if prefill_engines and decode_engines and decode_engines % prefill_engines == 0:
        return
    raise ConfigError(
        f"{name} has {decode_engines} decode engines ({name}.ranks / ({name}.tp_size x "
        f"{name}.pp_size)) and {prefill_engines} prefill engines: decode engine i pairs with "
        f"prefill engine i mod {prefill_engines or 1}, so the prefill engines must divide the "
        f"decode engines. Change {name}.ranks or {name}.prefill.ranks.",
        (f"{name}.ranks", f"{name}.prefill.ranks"),
    )


def _check_batch(job: JobConfig, trainer: TrainerLayout) -> None:
    samples = job.data.prompts_per_step * job.algorithm.n_samples_per_prompt
    micro = job.trainer.sequences_per_micro_batch
    per_step = trainer.dp_size * micro
    if samples % per_step:
        raise ConfigError(
            f"a step's {samples} samples (data.prompts_per_step x algorithm.n_samples_per_prompt)"
            f" do not split into micro-batches over {trainer.dp_size} data-parallel trainer "
            f"ranks x trainer.micro_batch_size={micro}: make the sample "
            f"count a multiple of {per_step}.",
            ("data.prompts_per_step", "algorithm.n_samples_per_prompt", "trainer.micro_batch_size"),
        )


def _inference_phase(mode: str, role: str) -> str:
    return {"decoupled": "resident", "split": "inference"}.get(mode, role)


def _phase_order(job: JobConfig) -> tuple[str, ...]:
    mode = job.placement.mode
    if mode == "decoupled":
        return ("resident",)
    if mode == "split":
        return ("inference", "train")
    roles = job.inference_roles()
    return (*(r for r in DEFER_PHASE_ORDER if r in roles), "train")


def _rank_plans(
    world: int,
    per_node: int,
    trainer: TrainerLayout,
    engines: tuple[EnginePlan, ...],
    critic: TrainerLayout | None,
) -> tuple[RankPlan, ...]:
    assignments: list[list[RoleAssignment]] = [[] for _ in range(world)]
    for rank in critic.ranks if critic is not None else ():
        assignments[rank].append(critic_assignment(critic, rank))
    for rank in trainer.ranks:
        tp, dp, pp = trainer.coordinates(rank)
        ep = trainer.ep_rank(rank) if trainer.ep_size > 1 else None
        cp = trainer.cp_rank(rank) if trainer.cp_size > 1 else None
        assignments[rank].append(
            RoleAssignment(
                role="trainer",
                phase=trainer.phase,
                tp_rank=tp,
                pp_rank=pp,
                dp_rank=dp,
                ep_rank=ep,
                cp_rank=cp,
            )
        )
    for engine in engines:
        for engine_rank, rank in enumerate(engine.ranks):
            assignments[rank].append(
                RoleAssignment(
                    role=engine.role,
                    phase=engine.phase,
                    engine_index=engine.index,
                    engine_rank=engine_rank,
                    is_head=engine_rank == 0,
                )
            )
    return tuple(
        RankPlan(rank=r, node=r // per_node, local_rank=r % per_node, assignments=tuple(a))
        for r, a in enumerate(assignments)
    )


def _weight_sync_groups(
    trainer: TrainerLayout, engines: tuple[EnginePlan, ...]
) -> tuple[WeightSyncGroup, ...]:
    offsets, world_size = sync_rank_offsets(
        e for e in engines if e.role == "rollout" and not e.reserved
    )
    return tuple(
        WeightSyncGroup(
            pp_rank=pp,
            source_rank=trainer.pp_stage_source(pp, ep),
            engine_rank_offsets=offsets,
            world_size=world_size,
            ep_rank=ep,
        )
        for pp in range(trainer.pp_size)
        for ep in range(trainer.ep_size)
    )
