"""The SGLang server processes a rank starts: which, with what threads, and where the node
processes of an engine spanning nodes meet.

An engine inside one node is one server process, started by its head rank before the rank joins
the process group (its load is the longest part of start-up and needs no group). An engine that
spans nodes is one process per node, started by the engine's first rank on that node with
``node_rank`` = the node's index among the engine's nodes: the head picks the rendezvous address
on its node (``dist_init_addr``) and starts at once; once the job's store is up it publishes the
address, and the other nodes' processes start with it.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any

from relax_launch import platform
from relax_launch.config.job import JobConfig
from relax_launch.inference.process import free_port
from relax_launch.models.build import ensure_model
from relax_launch.placement.memory_plan import planned_fraction
from relax_launch.placement.plan import EnginePlan, PlacementPlan
from relax_launch.runtime.network import node_address
from relax_launch.runtime.startup import StartupClock
from relax_launch.runtime.workers import EngineWorker
from relax_launch.trainer.config import LoraConfig

log = logging.getLogger(__name__)


def node_processes(plan: PlacementPlan, rank: int) -> list[tuple[EnginePlan, int]]:
    """(engine, node rank) of every SGLang process ``rank`` starts."""
    started = []
    for a in plan.ranks[rank].assignments:
        if a.engine_index is None:
            continue
        engine = plan.engines_of(a.role)[a.engine_index]
        heads = plan.engine_node_heads(engine)
        if rank in heads:
            started.append((engine, heads.index(rank)))
    return started


def launch_engines(
    job: JobConfig, plan: PlacementPlan, rank: int, clock: StartupClock
) -> list[EngineWorker]:
    """Start the servers of the engines this rank heads; they load while the rank joins the
    process group and builds the trainer (``build_workers`` waits for them). A staggered start
    only makes them here (``runtime/staggered_start.py`` launches them)."""
    engines: list[EngineWorker] = []
    try:
        for engine, node_rank in node_processes(plan, rank):
            if node_rank == 0:
                meet = _rendezvous(plan) if len(engine.nodes) > 1 else None
                engines.append(engine_worker(job, plan, rank, engine, node_rank, meet))
                # a reserved engine starts on a scale-out; staggered ones in their wave
                if not engine.reserved and not job.starts_staggered:
                    engines[-1].launch()
                    clock.mark(f"{engine.role} engine {engine.index} launched")
    except BaseException:
        for worker in reversed(engines):
            worker.close()
        raise
    return engines


def join_spanning_engines(
    job: JobConfig,
    plan: PlacementPlan,
    rank: int,
    store: Any,
    workers: list[Any],
    clock: StartupClock,
) -> None:
    """With the job's store up: publish the rendezvous of the spanning engines this rank heads,
    then start this rank's other-node processes (into ``workers``) at their heads' addresses."""
    for worker in workers:
        if worker.rendezvous is not None:
            store.set(_rendezvous_key(worker.engine), worker.rendezvous)
    timeout_s = job.cluster.collective_timeout_s
    for engine, node_rank in node_processes(plan, rank):
        if node_rank == 0:
            continue
        key = _rendezvous_key(engine)
        try:
            store.wait([key], timedelta(seconds=timeout_s))
        except RuntimeError as exc:  # the store's timeout
            raise TimeoutError(
                f"{engine.role} engine {engine.index}: its head (rank {engine.head_rank}) did not "
                f"publish where its node processes meet within {timeout_s:.0f} s "
                f"(cluster.collective_timeout_s): {exc}"
            ) from None
        rendezvous = store.get(key).decode()
        workers.append(engine_worker(job, plan, rank, engine, node_rank, rendezvous))
        workers[-1].launch()
        clock.mark(f"{engine.role} engine {engine.index} node {node_rank} launched")
        log.info(
            "%s engine %s: node %d process meets at %s",
            engine.role,
            engine.index,
            node_rank,
            rendezvous,
        )


def engine_worker(
    job: JobConfig,
    plan: PlacementPlan,
    rank: int,
    engine: EnginePlan,
    node_rank: int,
    rendezvous: str | None,
) -> EngineWorker:
    """This rank's process of ``engine`` (its server not started yet)."""
    section = job.inference_roles()[engine.role]
    if engine.model:  # a further model of its role: its own model and engine arguments
        section = section.model_sections()[engine.model]
    model = job.rollout_model() if engine.role == "rollout" else section.model
    if engine.role == "rollout" and job.algorithm.records_routing:  # the experts it routed to
        flags = {**section.engine, "enable_return_routed_experts": True}
        section = section.model_copy(update={"engine": flags})
    # its throughput on /v1/loads and /metrics (``inference/engine_load.py``, relax-launch top)
    section = section.model_copy(update={"engine": {"enable_metrics": True, **section.engine}})
    fraction = planned_fraction(job, plan, engine)  # a colocated GPU engine's share, planned
    if fraction is not None:
        flags = {**section.engine, "mem_fraction_static": fraction}
        section = section.model_copy(update={"engine": flags})
    return EngineWorker(
        engine=engine,
        section=section,
        dtype=section.engine.get("dtype", job.engine_dtype(engine.role)),  # its model's own
        log_level=job.logging.level,
        model_dir=ensure_model(model),
        device=job.cluster.device,
        local_rank=plan.ranks[rank].local_rank,
        log_dir=job.log_dir,
        host=node_address(plan),
        threads=cpu_threads(job, plan, rank, engine.role),
        colocated=plan.mode != "decoupled",
        node_rank=node_rank,
        rendezvous=rendezvous,
        policy_adapter=policy_adapter(job) if engine.role == "rollout" else None,
    )


def policy_adapter(job: JobConfig) -> LoraConfig | None:
    """The LoRA policy, when the rollout engines serve it as an adapter."""
    lora = job.trainer.lora
    return lora if lora is not None and lora.engines == "adapter" else None


def cpu_threads(job: JobConfig, plan: PlacementPlan, rank: int, role: str) -> int:
    """Threads for this rank's ``role`` process on the CPU: its node's cores, shared with what
    computes at the same time (``PlacementPlan.cpu_threads``)."""
    node, cores = plan.ranks[rank].node, platform.node_cores()
    return plan.cpu_threads(node, role, cores, job.rollout_overlaps_training)


def _rendezvous(plan: PlacementPlan) -> str:
    """An address on this node where an engine's node processes meet (SGLang's
    ``dist_init_addr``); only engines spanning nodes use it."""
    host = node_address(plan)
    return f"{host}:{free_port(host)}"


def _rendezvous_key(engine: EnginePlan) -> str:
    return f"engines/{engine.role}/{engine.index}/rendezvous"
