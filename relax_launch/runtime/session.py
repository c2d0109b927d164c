"""Session: rank 0's handle on the running job, the RL program's ``rl.interfaces.Job``: its
engines, trainer and weight sync, each method one typed control-channel command to the ranks
that own the work (``TrainerClient`` for the trainer's, ``WeightSync`` for the weights')."""

from __future__ import annotations

from collections.abc import Iterable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console

from relax_launch.console import operator_log
from relax_launch.inference.config import InferenceRoleConfig
from relax_launch.inference.disaggregation import EngineHalf
from relax_launch.inference.engine import EngineUnreachable
from relax_launch.placement.plan import PlacementPlan
from relax_launch.placement.render import roles_label
from relax_launch.rl.interfaces import RolloutWork
from relax_launch.runtime.autoscaler import Autoscaler, PhaseAutoscaler, autoscaler_for
from relax_launch.runtime.colocation import build_coordinator
from relax_launch.runtime.control import Command, ControlChannel, Handler, Shutdown
from relax_launch.runtime.critic_turns import CriticMode, CriticTurns
from relax_launch.runtime.critic_worker import CriticClient, order_ticket
from relax_launch.runtime.distributed import ShardChannel
from relax_launch.runtime.lifecycle import LifecycleCoordinator
from relax_launch.runtime.pool_autoscaler import PoolAutoscaler
from relax_launch.runtime.rank_commands import EngineUrl
from relax_launch.runtime.scaling import EngineScaler
from relax_launch.runtime.startup import (
    FIRST_SYNC,
    SYNC_GROUPS,
    StartupClock,
    StartupMarks,
    startup_report,
    summary_line,
    write_report,
)
from relax_launch.runtime.static_membership import StaticMembership
from relax_launch.runtime.stop import StopRequest
from relax_launch.runtime.trainer_client import TrainerClient
from relax_launch.runtime.weight_sync import AdapterServing, WeightSync
from relax_launch.trainer.batch import TokenBatch
from relax_launch.trainer.losses import LossSpec

if TYPE_CHECKING:
    from relax_launch.inference.control_plane import ControlPlane
    from relax_launch.inference.inprocess import EngineClients
    from relax_launch.placement.config import SpareAutoscaleConfig


class Session:
    """Commands for the ranks of one job, issued from rank 0. ``shards``: the trainer's shard
    channel, and the critic's on ranks of its own (None: it has none)."""

    def __init__(
        self,
        *,
        plan: PlacementPlan,
        channel: ControlChannel,
        shards: tuple[ShardChannel, ShardChannel | None],
        handlers: dict[str, Handler],
        startup_timeout_s: float,
        weight_sync_timeout_s: float,
        control_plane: ControlPlane | None = None,
        console: Console | None = None,
        startup: StartupClock | None = None,
        stop: StopRequest | None = None,
        adapters: AdapterServing | None = None,
        autoscale: dict[str, InferenceRoleConfig] | None = None,
        critic: CriticMode | None = None,
        spare_autoscale: SpareAutoscaleConfig | None = None,
    ) -> None:
        self.plan, self.channel, self.local = plan, channel, handlers
        self.stop = stop or StopRequest(0, Path("."))  # a test's session: never asked to stop
        self.startup = startup or StartupClock()  # rank 0's own start-up phases
        self.console = console or Console()  # rank 0's operator console
        self.startup_timeout_s, self.control_plane = startup_timeout_s, control_plane
        self.engine_urls: dict[str, list[str]] = {}
        self.trainer = TrainerClient(channel, shards[0], plan.trainer, handlers)
        self.critic, self.critic_overlaps = self._critic_client(critic, shards[1] or shards[0])
        self.critic_turns = CriticTurns(self.trainer, self.critic, critic) if critic else None
        rollout = control_plane.managers.get("rollout") if control_plane else None
        self.weights = WeightSync(
            plan,
            self._call,
            lambda: self.engine_urls.get("rollout") or self.wait_for_engines()["rollout"],
            rollout,
            channel.store,
            weight_sync_timeout_s,
            adapters,
        )
        self.scaler, self.autoscalers = self._elastic(autoscale or {}, spare_autoscale)
        managers = control_plane.managers if control_plane else {}
        self.static_roles = StaticMembership.started(channel.store, managers)  # fault_tolerance

    def _critic_client(
        self, mode: CriticMode | None, shards: ShardChannel
    ) -> tuple[CriticClient | None, bool]:
        """The value model's client (None: no critic) and whether it trains while the policy
        does: on its own grid and shard channel (critic.ranks=own), else on the trainer's."""
        if mode is None:
            return None, False
        grid = self.plan.critic or self.plan.trainer
        return CriticClient(self.channel, shards, grid, self.local), self.plan.critic is not None

    def _elastic(
        self, autoscale: dict[str, InferenceRoleConfig], spare: SpareAutoscaleConfig | None
    ) -> tuple[EngineScaler | None, list[Autoscaler | PoolAutoscaler]]:
        """Rank 0's scaler of the roles with reserved engines, and their autoscalers (the
        shared spare pool's among them)."""
        plane = self.control_plane
        if plane is None or not any(e.reserved for e in self.plan.engines):
            return None, []
        scaler = EngineScaler(
            plan=self.plan,
            managers=plane.managers,
            call=self._call,
            startup_timeout_s=self.startup_timeout_s,
            drain_timeout_s=plane.request_timeout_s,  # no request runs longer
            sync_lock=self.weights.lock,
            log_dir=plane.log_dir,
        )
        plane.scaled_by(scaler)
        log = plane.log_dir / "autoscaler.jsonl"
        autoscalers: list[Autoscaler | PoolAutoscaler] = [
            autoscaler_for(role, section, scaler, plane.managers[role], log)
            for role, section in autoscale.items()
        ]
        if spare is not None:
            autoscalers.append(PoolAutoscaler(spare, scaler, plane.managers, log))
        for autoscaler in autoscalers:
            autoscaler.start()
        return scaler, autoscalers

    def _call(
        self, command: Command, ranks: Iterable[int], timeout_s: float | None = None
    ) -> dict[int, Any]:
        return self.channel.call(command, ranks, self.local.get(command.route), timeout_s)

    @property
    def gateway_url(self) -> str | None:
        return self.control_plane.url if self.control_plane else None

    @property
    def engines(self) -> EngineClients:
        """The controller's in-process clients of every role's engines."""
        return self.control_plane.engines

    def wait_for_engines(self, roles: tuple[str, ...] | None = None) -> dict[str, list[str]]:
        """Each engine head's URL, once its server has generated a token (of ``roles``, default
        every role); the control plane takes each role's engines as they are known."""
        for role in roles or tuple(self.plan_roles()):
            if role in self.engine_urls:
                continue
            urls = []
            planned = [e for e in self.plan.engines_of(role) if not e.reserved]
            for engine in planned:
                command = EngineUrl(engine.role, engine.index)
                heads = [engine.head_rank]
                urls.append(self._call(command, heads, self.startup_timeout_s)[engine.head_rank])
            self.engine_urls[role] = urls
            if self.control_plane is not None:
                halves = [
                    EngineHalf(e.disaggregation, getattr(self.plan.prefill_of(e), "index", None))
                    for e in planned
                ]
                self.control_plane.attach(role, urls, self.startup_timeout_s, halves)
        return self.engine_urls

    def plan_roles(self) -> dict[str, None]:
        """The inference roles of the plan, in its order (rollout first)."""
        return dict.fromkeys(engine.role for engine in self.plan.engines)

    def bring_up(self, weight_version: int = 0, log_dir: Path | None = None) -> dict[str, Any]:
        """Start-up every job shares (``bring_up``); its report goes into ``log_dir``."""
        summary = bring_up(self, weight_version)
        if log_dir is not None:
            write_report(summary["startup"], log_dir)
        return summary

    def connect_weight_sync(self, members: tuple[int, ...] | None = None) -> None:
        self.weights.connect(members)

    def sync_weights(self, weight_version: int) -> list[dict[str, Any]]:
        return self.weights.sync(weight_version)

    def check_parity(self) -> None:
        self.weights.check_parity()

    def engine_metrics(self) -> dict[str, float]:
        """Rollout membership, elastic roles' engines and autoscaler decisions, and the
        engines of fault-tolerant teacher and genrm roles."""
        metrics = self.weights.metrics()
        if self.static_roles is not None:
            metrics |= self.static_roles.metrics()
        if self.scaler is not None:
            metrics |= self.scaler.metrics()
        for autoscaler in self.autoscalers:
            metrics |= autoscaler.metrics()
        return metrics

    def rollout_phase(self, requests: int) -> AbstractContextManager[RolloutWork]:
        """Around one rollout phase: the rollout autoscaler decides when it ends."""
        for autoscaler in self.autoscalers:
            if isinstance(autoscaler, PhaseAutoscaler | PoolAutoscaler):
                return autoscaler.phase(requests)
        return nullcontext(RolloutWork(requests))

    def abort_rollout(self) -> None:
        """Abort what the rollout engines generate now (each returns its tokens so far). Under
        ``rollout.fault_tolerance`` an engine that cannot be reached is passed over: it died
        (or is starting again), and what it was generating is sent elsewhere by the controller."""
        manager = self.control_plane.managers["rollout"]
        for engine in manager.engines:
            if engine.engine_id in manager.lost:  # its requests were sent elsewhere already
                continue
            try:
                engine.call("abort_request", {"abort_all": True})
            except EngineUnreachable:
                if not manager.fault_tolerant:
                    raise

    def coordinator(self, operation_timeout_s: float, log_path: Path) -> LifecycleCoordinator:
        """The coordinator the roles of a colocated job take turns under (``colocation.py``)."""
        plane = self.control_plane
        return build_coordinator(self.plan, self.trainer, plane, operation_timeout_s, log_path)

    def train_step(self, batch: TokenBatch, spec: LossSpec | None = None) -> dict[str, float]:
        return self.trainer.train_step(batch, spec)

    def logprobs(self, batch: TokenBatch) -> list[list[float]]:
        return self.trainer.logprobs(batch)

    def save_trainer(self, directory: str) -> list[str]:
        """The policy's shards, and the value model's beside them (a job with a critic)."""
        files, turns = self.trainer.save(directory), self.critic_turns
        if turns is None:
            return files
        return files + turns.checkpoint(lambda: turns.critic.save(directory))

    def export_trainer(self, directory: str, dtype: str) -> dict[str, str]:
        return self.trainer.export_hf(directory, dtype)

    def load_trainer(self, directory: str) -> int:
        """The policy's optimizer steps restored (and the value model's state, with a critic)."""
        if (turns := self.critic_turns) is not None:
            turns.checkpoint(lambda: turns.critic.load(directory))
        return self.trainer.load(directory)

    def critic_values(self, batch: TokenBatch) -> list[list[float]]:
        """The value model's per-token values of ``batch`` (a job with a critic)."""
        return self._critic().values(batch)

    def train_critic(self, batch: TokenBatch, value_clip: float | None) -> dict[str, float]:
        """One value-model step on ``batch`` (returns and old values in it: critic_batch)."""
        return self._critic().train(batch, value_clip)

    def start_critic(self, batches: list[TokenBatch], value_clip: float | None) -> Any:
        """Post one value-model step per batch to the critic's own ranks, which train them while
        rank 0 goes on (``finish_critic`` collects them)."""
        return self._critic().start_training(batches, value_clip)

    def finish_critic(self, started: Any) -> list[dict[str, float]]:
        return self._critic().finish_training(started)

    def order_ticket(self) -> int:
        """The next ticket of the job's event counter, which the critic's ranks draw from too
        (``critic_worker.order_ticket``)."""
        return order_ticket(self.channel.store)

    def _critic(self) -> CriticClient:
        if self.critic is None:
            raise RuntimeError("this job has no critic section: its trainer holds no value model")
        return self.critic

    def startup_report(self) -> dict[str, Any]:
        """Every rank's start-up phases and the critical path, as of now."""
        marks = self._call(StartupMarks(), range(self.plan.world_size))
        return startup_report(marks, {r.rank: roles_label(self.plan, r) for r in self.plan.ranks})

    def shutdown(self) -> None:
        if self.static_roles is not None:
            self.static_roles.close()
        for autoscaler in self.autoscalers:
            autoscaler.close()
        if self.scaler is not None:  # a scale operation's rank is busy until it ends
            self.scaler.close()
        self._call(Shutdown(), range(self.plan.world_size), timeout_s=30)
        self.weights.close()


def bring_up(session: Session, weight_version: int = 0) -> dict[str, Any]:
    """Start-up every job shares: engines ready, weight-sync groups formed, the trainer's weights
    on the rollout engines as ``weight_version`` (the step a resumed run continues from). The
    summary holds where start-up time went (``runtime/startup.py``)."""
    reports = []
    if "rollout" in session.plan_roles():  # synced while the other roles' engines still load
        session.wait_for_engines(("rollout",))
        session.connect_weight_sync()
        session.startup.mark(SYNC_GROUPS)
        reports = session.sync_weights(weight_version)
        session.startup.mark(FIRST_SYNC)
    urls = session.wait_for_engines()
    startup = session.startup_report()
    summary = {"engines": urls, "gateway": session.gateway_url, "weight_sync": reports}
    summary["startup"] = startup
    engines = ", ".join(f"{role} x{len(u)}" for role, u in urls.items())
    line = f"relax-launch: job is up: engines {engines or 'none'}"
    if session.gateway_url:
        line += f"; gateway {session.gateway_url}"
    if reports:
        seconds = max(r["seconds"] for r in reports)
        line += f"; weights v{weight_version} synced ({reports[0]['transport']}, {seconds:.2f} s)"
    operator_log().info(f"{line}; {summary_line(startup)}")
    return summary
