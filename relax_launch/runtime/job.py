"""run_rank: the lifecycle of one rank of a relax-launch torchrun job.

init torch.distributed -> agree on the plan -> build every process group -> build this rank's
role workers (trainer, engine heads) -> rank 0 runs the controller program, the others serve its
commands (trainer batches arrive beside them, over the shard channel) -> stop every worker ->
leave the process group.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from relax_launch import platform
from relax_launch.config.job import JobConfig
from relax_launch.console import operator_log
from relax_launch.models.build import ensure_model
from relax_launch.placement.plan import PlacementPlan
from relax_launch.placement.render import roles_label
from relax_launch.rl.interfaces import JobStopped
from relax_launch.runtime.control import ControlChannel
from relax_launch.runtime.critic_turns import critic_mode
from relax_launch.runtime.critic_worker import build_critic_worker
from relax_launch.runtime.distributed import (
    ShardChannel,
    check_same_plan,
    check_shared_directory,
    init_distributed,
)
from relax_launch.runtime.engine_restart import EngineRestarts
from relax_launch.runtime.engines import (
    cpu_threads,
    join_spanning_engines,
    launch_engines,
    policy_adapter,
)
from relax_launch.runtime.groups import build_trainer_groups
from relax_launch.runtime.job_end import (
    end_completed,
    end_in_failure,
    end_stopped,
    end_stopped_after_steps,
)
from relax_launch.runtime.network import configure_network, node_address
from relax_launch.runtime.parity_probe import probe_for
from relax_launch.runtime.rank_output import route_rank_output
from relax_launch.runtime.session import Session
from relax_launch.runtime.staggered_start import start_in_waves
from relax_launch.runtime.startup import StartupClock, StartupMarks
from relax_launch.runtime.stop import StopRequest
from relax_launch.runtime.watchdog import JobWatchdog, describe_rank, store_lost
from relax_launch.runtime.weight_sync import AdapterServing
from relax_launch.runtime.workers import TrainerWorker
from relax_launch.trainer.lora import peft_config
from relax_launch.trainer.model import DTYPES
from relax_launch.trainer.trainer import Trainer

if TYPE_CHECKING:
    from relax_launch.inference.control_plane import ControlPlane

log = logging.getLogger(__name__)

Program = Callable[[Session], Any]


def role_labels(plan: PlacementPlan) -> dict[int, str]:
    return {r.rank: roles_label(plan, r) for r in plan.ranks}


def build_workers(
    job: JobConfig,
    plan: PlacementPlan,
    rank: int,
    trainer: tuple[Any, ShardChannel],
    critic: tuple[Any, ShardChannel | None],
    workers: list[Any],
    clock: StartupClock,
    store: Any,
) -> None:
    """Add this rank's trainer share or share of a critic on ranks of its own, if it has one,
    to ``workers`` (its engines; the caller closes them all), then wait for each engine's first
    token (``trainer``, ``critic``: each one's groups and shard channel). A staggered start
    brings the engines up, role by role, and parks them before the trainer builds."""
    engines = list(workers)  # so far, only engines
    if job.starts_staggered:
        start_in_waves(job, plan, rank, store, engines, clock)
    roles = {a.role for a in plan.ranks[rank].assignments}
    if "trainer" in roles:
        workers.append(trainer_worker(job, plan, rank, *trainer))
        if job.critic is not None and plan.critic is None:  # it shares the trainer's ranks
            workers.append(build_critic_worker(job, *trainer))
        clock.mark("trainer built")
    if "critic" in roles:  # PPO's value model on ranks of its own
        platform.use_threads(job.cluster.device, cpu_threads(job, plan, rank, "critic"))
        workers.append(build_critic_worker(job, *critic, order=store))  # its steps' tickets
        clock.mark("critic built")
    for engine in (e for e in engines if e.running and not job.starts_staggered):
        engine.wait_ready(job.cluster.startup_timeout_s)
        clock.mark(f"{engine.engine.role} engine {engine.engine.index} ready")


def trainer_worker(
    job: JobConfig, plan: PlacementPlan, rank: int, pgc: Any, shards: ShardChannel
) -> Any:
    """This rank's share of the Megatron trainer, built from the policy's HF checkpoint."""
    device = job.cluster.device
    platform.use_threads(device, cpu_threads(job, plan, rank, "trainer"))
    trainer = Trainer(
        section=job.trainer,
        model_dir=ensure_model(job.trainer.model),
        pgc=pgc,
        device=device,
        reference=job.algorithm.kl_coef > 0,
    )
    return TrainerWorker(
        trainer=trainer,
        shards=shards,
        device=device,
        host=node_address(plan),
        colocated=plan.mode != "decoupled",
    )


def build_control_plane(job: JobConfig, plan: PlacementPlan) -> ControlPlane | None:
    """Rank 0's gateway and role managers (None when the job has no inference role)."""
    from relax_launch.inference.control_plane import (  # rank 0: FastAPI
        ControlPlane,
        ModelSpec,
        RoleSpec,
    )

    specs = []
    for role, section in job.inference_roles().items():
        model = job.rollout_model() if role == "rollout" else section.model
        engines = plan.engines_of(role)
        parked = job.starts_staggered  # its engines come up released (staggered_start.py)
        more = tuple(  # its further models, each with the engines the plan gave it
            ModelSpec(s, ensure_model(s.model), tuple(e.index for e in engines if e.model == k))
            for k, s in enumerate(section.model_sections()[1:], 1)
        )
        spec = RoleSpec(role, model, ensure_model(model), section, engines[0].phase, parked, more)
        specs.append(spec)
    if not specs:
        return None
    return ControlPlane(
        specs,
        gateway=job.gateway,
        admin_token=os.environ.get(job.gateway.admin_token_env) or None,
        log_dir=job.log_dir,
        request_timeout_s=job.request_timeout_s(),  # auto: sized by the step's batch
        restart_wait_s=job.cluster.startup_timeout_s,  # a restart's own bound (fault_tolerance)
    )


def start_control_plane(job: JobConfig, plan: PlacementPlan) -> ControlPlane | None:
    """Rank 0's gateway, alive (not ready) while the engines start."""
    control_plane = build_control_plane(job, plan)
    if control_plane is not None:
        control_plane.start()
        operator_log().info(
            f"relax-launch: gateway {control_plane.url} is up; starting engines and the trainer "
            "(it serves once the first weights are synced)"
        )
    return control_plane


def close_all(workers: list[Any]) -> None:
    for worker in reversed(workers):
        worker.close()


def start_watchdog(
    job: JobConfig, plan: PlacementPlan, rank: int, store: Any, stop: StopRequest, workers: list
) -> JobWatchdog:
    """This rank's watchdog, watching the engine servers it launched; from now on a stop signal
    asks rank 0 to stop the job after a checkpoint."""
    watchdog = JobWatchdog(
        store, plan, rank, stop, liveness_timeout_s=job.cluster.liveness_timeout_s
    )
    for engine in workers:
        restarts = None
        if job.fault_tolerant(engine.engine.role):  # its head restarts it; rank 0 routes
            restarts = EngineRestarts(store, engine, job.cluster.startup_timeout_s)
        watchdog.watch_engine(engine.engine.label, lambda engine=engine: engine.process, restarts)
        watchdog.closers.append(engine.close)
    if rank == 0:
        watchdog.on_end = lambda reason, stopped: (end_stopped if stopped else end_in_failure)(
            job, reason
        )
    watchdog.start()
    stop.failure = watchdog.recorded_abort
    stop.graceful = True
    return watchdog


def report_failure(
    job: JobConfig, plan: PlacementPlan, watchdog: JobWatchdog, exc: BaseException
) -> None:
    """This rank failed: the job's cause is the first one recorded, which may be another rank's
    (this failure its consequence), else this one."""
    watchdog.quiet()
    rank = watchdog.rank
    cause = watchdog.recorded_abort(wait_s=2 * watchdog.interval_s)
    if cause is None and rank != 0 and not watchdog.store_answers():
        cause = store_lost(plan, rank, exc)  # the store, and the cause, went with node 0
    if cause is None:
        what = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        cause = watchdog.abort(f"{describe_rank(plan, rank)} failed: {type(exc).__name__}: {what}")
    if rank == 0 and watchdog.claim_end():
        end_in_failure(job, cause)
    elif rank != 0:
        log.error("relax-launch: the job is ending: %s", cause)


def build_rank(
    job: JobConfig,
    plan: PlacementPlan,
    rank: int,
    workers: list[Any],
    clock: StartupClock,
    store: Any,
) -> tuple[dict[str, Any], ShardChannel, ShardChannel | None]:
    """Trainer groups (and a critic's on ranks of its own), Megatron's set-up and this rank's
    workers (into ``workers``); returns the handlers of every command this rank answers, and
    the trainer's and the critic's shard channels."""
    backend = platform.dist_backend(job.cluster.device)
    pgc = build_trainer_groups(plan.trainer, backend)
    # every rank creates the critic's groups too, after the trainer's: the same order on all
    critic_pgc = build_trainer_groups(plan.critic, backend) if plan.critic is not None else None
    mine = pgc if pgc is not None else critic_pgc  # the trainer's or the critic's, not both
    if rank == 0 or mine is not None:
        tp_rank = mine.tp.rank() if mine is not None else 0
        platform.prepare_megatron(job.cluster.device, job.trainer.seed, tp_rank)
    device = platform.torch_device(job.cluster.device, plan.ranks[rank].local_rank)
    peers = pgc.shard_peers if pgc else None
    # the vision tower computes in the trainer's dtype: images travel in it (``ShardChannel``)
    shards = ShardChannel(plan.trainer, rank, device, peers, DTYPES[job.trainer.dtype])
    critic_shards = None
    if plan.critic is not None:
        peers = critic_pgc.shard_peers if critic_pgc else None
        critic_shards = ShardChannel(plan.critic, rank, device, peers)
    build_workers(
        job, plan, rank, (pgc, shards), (critic_pgc, critic_shards), workers, clock, store
    )
    handlers = {k: v for w in workers for k, v in w.handlers().items()}
    handlers[StartupMarks.op] = lambda command: clock.marks
    return handlers, shards, critic_shards


def adapter_serving(job: JobConfig) -> AdapterServing | None:
    """Where a LoRA policy served as an adapter is published each sync (``adapters/`` in the
    run directory, which the engines read), and its PEFT config."""
    lora = policy_adapter(job)
    if lora is None:
        return None
    base = str(ensure_model(job.trainer.model))
    return AdapterServing(job.log_dir / "adapters", peft_config(lora, base))


def run_controller(
    job: JobConfig,
    plan: PlacementPlan,
    program: Program,
    channel: ControlChannel,
    shards: tuple[ShardChannel, ShardChannel | None],
    handlers: dict[str, Any],
    control_plane: ControlPlane | None,
    console: Any,
    stop: StopRequest,
    clock: StartupClock,
    watchdog: JobWatchdog,
) -> Any:
    """Rank 0: run ``program`` on a session of the job, then stop every rank."""
    session = Session(
        plan=plan,
        channel=channel,
        shards=shards,
        handlers=handlers,
        startup_timeout_s=job.cluster.startup_timeout_s,
        weight_sync_timeout_s=job.weight_sync.timeout_s,
        control_plane=control_plane,
        console=console,
        startup=clock,
        stop=stop,
        adapters=adapter_serving(job),
        autoscale={r: s for r, s in job.inference_roles().items() if s.autoscale is not None},
        spare_autoscale=job.cluster.spare_autoscale,
        critic=critic_mode(job, plan),
    )
    adapters = session.weights.adapters is not None
    session.weights.probe = probe_for(job, plan, session.trainer.logprobs, adapters=adapters)
    try:
        result = program(session)
    except JobStopped as stopped:
        shut_down(session, watchdog)
        end_stopped_after_steps(job, stopped)
        raise
    except BaseException:
        # A failure may be a dead node's first sign (its engines stop answering): shut down in
        # order only if every rank still beats, else the watchdog names the dead and ends us.
        if not watchdog.others_alive():
            watchdog.end_for_recorded_cause()  # as its thread would: this failure followed it
        shut_down(session, watchdog)
        raise
    shut_down(session, watchdog)
    end_completed(job)
    return result


def shut_down(session: Session, watchdog: JobWatchdog) -> None:
    """Stop every rank in order, unless the watchdogs are already ending them."""
    if watchdog.recorded_abort() is None:
        watchdog.announce_shutdown()  # ranks and servers now leave on purpose
        session.shutdown()


def run_rank(job: JobConfig, plan: PlacementPlan, program: Program) -> Any:
    """Run this rank's part of the job; on rank 0 returns what ``program(session)`` returned."""
    rank = int(os.environ["RANK"])
    clock = StartupClock()
    clock.mark("imports and config")
    console = route_rank_output(job.log_dir, rank, job.logging.level, role_labels(plan)[rank])
    stop = StopRequest(rank, job.log_dir)
    stop.install()  # before the engines: a stop during start-up leaves through the finally below
    configure_network(plan)
    # Engines start first: their load is the longest part of start-up, and needs no group.
    workers: list[Any] = launch_engines(job, plan, rank, clock)
    channel = control_plane = store = watchdog = None
    try:
        store = init_distributed(job.cluster.device, job.cluster.collective_timeout_s)
        join_spanning_engines(job, plan, rank, store, workers, clock)
        watchdog = start_watchdog(job, plan, rank, store, stop, workers)
        check_same_plan(store, plan, rank, job.cluster.collective_timeout_s)
        check_shared_directory(  # where checkpoints go, even if only a stop writes one
            store, job.checkpoint_dir, plan, rank, job.cluster.collective_timeout_s
        )
        watchdog.joined()  # every rank has published its first heartbeat and its PID
        clock.mark("process group")
        if rank == 0:
            control_plane = start_control_plane(job, plan)
        handlers, shards, critic_shards = build_rank(job, plan, rank, workers, clock, store)
        channel = ControlChannel(
            store, rank=rank, roles=role_labels(plan), timeout_s=job.cluster.collective_timeout_s
        )
        if rank != 0:
            return channel.serve(handlers)
        return run_controller(
            job,
            plan,
            program,
            channel,
            (shards, critic_shards),
            handlers,
            control_plane,
            console,
            stop,
            clock,
            watchdog,
        )
    except JobStopped:
        raise
    except BaseException as exc:
        if watchdog is not None:
            report_failure(job, plan, watchdog, exc)
        raise
    finally:
        if watchdog is not None:
            watchdog.close()
        if control_plane is not None:
            control_plane.close()
        close_all(workers)
        if channel is not None:
            channel.close()
        if store is not None:
            dist.destroy_process_group()
