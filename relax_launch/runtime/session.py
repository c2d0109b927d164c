"""Session: rank 0's handle on the running job — engines, trainer and weight sync by command.

The controller (the RL loop, or a test) drives the whole job through this object; each method
is one typed control-channel command to the ranks that own the work. ``TrainerClient`` is the
trainer's part: its batches travel shard by shard over torch.distributed, never the store.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console

from relax_launch.placement.plan import PlacementPlan, TrainerLayout, sync_rank_offsets
from relax_launch.placement.render import roles_label
from relax_launch.runtime.console import operator_log
from relax_launch.runtime.control import Command, ControlChannel, Handler, RemoteError, Shutdown
from relax_launch.runtime.distributed import ShardChannel
from relax_launch.runtime.engine_restart import RolloutMembership, engine_alive
from relax_launch.runtime.startup import (
    FIRST_SYNC,
    SYNC_GROUPS,
    StartupClock,
    StartupMarks,
    startup_report,
    summary_line,
)
from relax_launch.runtime.stop import StopRequest
from relax_launch.runtime.workers import (
    ConnectWeights,
    EngineUrl,
    LoadTrainer,
    Logprobs,
    OffloadTrainer,
    OnloadTrainer,
    SaveTrainer,
    SendWeights,
    TrainStep,
)
from relax_launch.trainer.batch import TokenBatch
from relax_launch.trainer.losses import LossSpec
from relax_launch.trainer.offload import PARTS
from relax_launch.weights.engine_client import EngineControl, EngineRequestError
from relax_launch.weights.update_session import (
    Deadline,
    EngineTarget,
    UpdateSession,
    WeightSyncError,
)

if TYPE_CHECKING:
    from relax_launch.inference.control_plane import ControlPlane

# A rank's own deadline error names what it waited for; the channel's reply timeout, a little
# later, only that the rank did not answer.
REPLY_MARGIN_S = 10.0
# After a failed send, how long an engine may take to answer /health before it counts as dead
# (a live one is freed from the broken broadcast within a second or two).
REPAIR_HEALTH_S = 15.0


class TrainerClient:
    """Rank 0's typed proxy for the trainer ranks: each method sends one small command record to
    every trainer rank; a batch goes alongside over the ``ShardChannel``, each data-parallel rank
    receiving only its shard, and per-token results come back the same way."""

    def __init__(
        self,
        channel: ControlChannel,
        shards: ShardChannel,
        layout: TrainerLayout,
        local: dict[str, Handler],
    ) -> None:
        self.channel, self.shards, self.layout, self.local = channel, shards, layout, local

    def train_step(self, batch: TokenBatch, spec: LossSpec | None = None) -> dict[str, float]:
        """One optimizer step; the metrics of the last pipeline stage's first rank."""
        shards = batch.shards(self.layout.dp_size)
        command = TrainStep(tuple(s.shape() for s in shards), spec)
        return self._with_shards(command, shards)[0][self._last_stage_rank()]

    def logprobs(self, batch: TokenBatch) -> list[list[float]]:
        """Per-token logprobs of ``tokens[1:]`` of every sequence, in batch order."""
        shards = batch.shards(self.layout.dp_size)
        command = Logprobs(tuple(s.shape() for s in shards))
        _, results = self._with_shards(command, shards, results=True)
        rows = []
        for shard, values in zip(shards, results, strict=True):
            flat, start = values.tolist(), 0
            for tokens in shard.tokens:
                rows.append(flat[start : start + len(tokens) - 1])
                start += len(tokens) - 1
        return rows

    def save(self, directory: str) -> list[str]:
        """Every trainer shard writes its state into ``directory``; returns the files."""
        replies = self._call(SaveTrainer(directory))
        return [path for path in replies.values() if path]

    def load(self, directory: str) -> int:
        """Every trainer rank restores its shard; returns the optimizer steps restored."""
        return min(self._call(LoadTrainer(directory)).values())

    def offload(self, parts: Iterable[str] = PARTS) -> dict[str, float]:
        """Every trainer rank moves these parts of its state ("params", "grads", "optimizer") to
        host memory; returns the bytes moved (summed over ranks) and the slowest rank's seconds."""
        return _moved(self._call(OffloadTrainer(tuple(parts))))

    def onload(self, parts: Iterable[str] = PARTS) -> dict[str, float]:
        """Every trainer rank brings these offloaded parts back; same reply as ``offload``."""
        return _moved(self._call(OnloadTrainer(tuple(parts))))

    def _call(self, command: Command) -> dict[int, Any]:
        return self.channel.call(command, self.layout.ranks, self.local.get(command.route))

    def _with_shards(
        self, command: Command, shards: list[TokenBatch], results: bool = False
    ) -> tuple[dict[int, Any], list[Any]]:
        """Post ``command``, send the shards while the ranks take it, collect the replies."""
        posted = self.channel.post(command, self.layout.ranks)
        transfer = self.shards.start(shards, results)
        replies = self.channel.collect(posted, self.local.get(command.route))
        return replies, self.shards.finish(transfer)

    def _last_stage_rank(self) -> int:
        return self.layout.pp_stage_source(self.layout.pp_size - 1)


def _moved(replies: dict[int, dict[str, float]]) -> dict[str, float]:
    """Trainer ranks' offload/onload replies as one: bytes summed, seconds of the slowest."""
    return {
        "bytes": sum(r["bytes"] for r in replies.values()),
        "seconds": max(r["seconds"] for r in replies.values()),
    }


class Session:
    """Commands for the ranks of one job, issued from rank 0."""

    def __init__(
        self,
        *,
        plan: PlacementPlan,
        channel: ControlChannel,
        shards: ShardChannel,
        handlers: dict[str, Handler],
        startup_timeout_s: float,
        weight_sync_timeout_s: float,
        control_plane: ControlPlane | None = None,
        console: Console | None = None,
        startup: StartupClock | None = None,
        stop: StopRequest | None = None,
    ) -> None:
        self.plan, self.channel, self.local = plan, channel, handlers
        self.stop = stop or StopRequest(0, Path("."))  # a test's session: never asked to stop
        self.startup = startup or StartupClock()  # rank 0's own start-up phases
        self.console = console or Console()  # rank 0's operator console
        self.startup_timeout_s, self.control_plane = startup_timeout_s, control_plane
        self.weight_sync_timeout_s = weight_sync_timeout_s
        self.engine_urls: dict[str, list[str]] = {}
        self.sync_targets: list[EngineTarget] = []
        self.engine_control = EngineControl()  # kept-alive connections to the rollout engines
        self.weight_version: int | None = None
        self.membership: RolloutMembership | None = None  # rollout.fault_tolerance only
        self._sync_groups = 0  # broadcast groups formed so far (each one is named anew)
        self.trainer = TrainerClient(channel, shards, plan.trainer, handlers)

    def _call(
        self, command: Command, ranks: Iterable[int], timeout_s: float | None = None
    ) -> dict[int, Any]:
        return self.channel.call(command, ranks, self.local.get(command.route), timeout_s)

    def stop_requested(self, wait_s: float = 0.0) -> str | None:
        """Why the job should stop after a checkpoint (a signal or a STOP file), if it should;
        ``wait_s``: a failed step may be the first sign of a request still on its way."""
        return self.stop.requested(wait_s)

    @property
    def gateway_url(self) -> str | None:
        return self.control_plane.url if self.control_plane else None

    def wait_for_engines(self, roles: tuple[str, ...] | None = None) -> dict[str, list[str]]:
        """Each engine head's URL, once its server has generated a token (of ``roles``, default
        every role); the control plane takes each role's engines as they are known."""
        for role in roles or tuple(self.plan_roles()):
            if role in self.engine_urls:
                continue
            urls = []
            for engine in self.plan.engines_of(role):
                command = EngineUrl(engine.role, engine.index)
                heads = [engine.head_rank]
                urls.append(self._call(command, heads, self.startup_timeout_s)[engine.head_rank])
            self.engine_urls[role] = urls
            if self.control_plane is not None:
                self.control_plane.attach(role, urls, self.startup_timeout_s)
        return self.engine_urls

    def plan_roles(self) -> dict[str, None]:
        """The inference roles of the plan, in its order (rollout first)."""
        return dict.fromkeys(engine.role for engine in self.plan.engines)

    def connect_weight_sync(self, members: tuple[int, ...] | None = None) -> None:
        """Each pipeline stage's source rank forms its broadcast group with the rollout engines
        (``members``: these engines only, in a new group, after one died or came back)."""
        urls = self.engine_urls.get("rollout") or self.wait_for_engines()["rollout"]
        rollout = self.plan.engines_of("rollout")
        members = tuple(range(len(rollout))) if members is None else members
        # An engine with one rank holds q/k/v and gate/up fused: send them so, received in place.
        fused = all(e.tp_size == 1 and e.pp_size == 1 for e in rollout)
        offsets, world_size = sync_rank_offsets(rollout[index] for index in members)
        self.sync_targets = [
            EngineTarget(
                urls[index],
                offset,
                f"rollout engine {index} (rank {rollout[index].head_rank})",
                rollout[index].tp_size,
            )
            for index, offset in offsets
        ]
        self._sync_groups += 1
        for group in self.plan.weight_sync_groups:  # every group reaches the same engines
            command = ConnectWeights(
                pp_rank=group.pp_rank,
                targets=tuple(self.sync_targets),
                world_size=world_size,
                fused=fused,
                colocated=self.plan.mode in ("split", "defer"),
                seconds_left=self.weight_sync_timeout_s,
                generation=self._sync_groups,
            )
            self._call(command, [group.source_rank], self.weight_sync_timeout_s + REPLY_MARGIN_S)
        manager = self.control_plane.managers["rollout"] if self.control_plane else None
        if self.membership is None and manager is not None and manager.fault_tolerant:
            self.membership = RolloutMembership(self.channel.store, manager)
        if self.membership is not None:
            self.membership.synced = members

    def engine_metrics(self) -> dict[str, float]:
        """Rollout engines serving and restarts taken back (``rollout.fault_tolerance``)."""
        return self.membership.metrics() if self.membership is not None else {}

    def sync_weights(self, weight_version: int) -> list[dict[str, Any]]:
        """Push the trainer's weights to every rollout engine in routing as ``weight_version``,
        each engine whole: the rollout model is not routable from the start of the sync until
        every engine holds the new version.

        A send that fails may have written part of the engines' parameters (they receive in
        place). They stay out of routing (requests get 503 with Retry-After) while the same
        version is sent once more, in a new broadcast group: the trainer's parameters have not
        changed. Under ``rollout.fault_tolerance`` the engines that died are left out of it
        (they serve again once restarted and synced); without it a dead engine ends the job.
        If the second send fails too, the rollout model stays closed and the error names the
        engines that may hold mixed weights. Returns each pipeline stage's report; a repaired
        sync's carry ``repaired: 1``.
        """
        rollout = self.control_plane.managers.get("rollout") if self.control_plane else None
        if rollout is not None:
            rollout.weights_updating()
        try:
            reports = self._sync_whole(weight_version)
        except BaseException as exc:
            if rollout is not None:
                rollout.weights_lost(f"the sync to version {weight_version} failed: {exc}")
            raise
        if rollout is not None:
            rollout.weights_committed(weight_version)
        self.weight_version = weight_version
        return reports

    def _sync_whole(self, weight_version: int) -> list[dict[str, Any]]:
        if self.membership is not None and (members := self.membership.before_sync()):
            operator_log().warning(self.membership.describe(members, weight_version))
            self.connect_weight_sync(members)  # engines died or came back
        try:
            return self.sync_once(weight_version)
        except (WeightSyncError, EngineRequestError, RemoteError) as exc:
            failed = exc
        members = self._engines_to_repair(weight_version, failed)
        operator_log().warning(
            f"relax-launch: the sync to version {weight_version} failed ({_first_line(failed)});"
            f" rollout engines {list(members)} stay out of routing while the same version is "
            "sent again"
        )
        self.connect_weight_sync(members)
        try:
            reports = self.sync_once(weight_version)
        except (WeightSyncError, EngineRequestError, RemoteError) as again:
            labels = ", ".join(t.label for t in self.sync_targets)
            raise WeightSyncError(
                f"weight sync to version {weight_version} failed ({_first_line(failed)}) and "
                f"sending it again failed ({_first_line(again)}): {labels} may hold mixed "
                "weights and stay out of routing"
            ) from again
        return [{**report, "repaired": 1} for report in reports]

    def _engines_to_repair(self, weight_version: int, failed: BaseException) -> tuple[int, ...]:
        """The rollout engines the repairing send goes to: those of the failed sync, less the
        ones that died (fault tolerance); a dead engine without it ends the job here. An engine
        is dead when it does not answer ``/health``: a stopped process refuses at once, while a
        live one freed from the failed broadcast answers within ``REPAIR_HEALTH_S``."""
        engines = range(len(self.plan.engines_of("rollout")))
        synced = self.membership.synced if self.membership is not None else None
        members = tuple(synced if synced is not None else engines)
        urls = self.engine_urls["rollout"]
        dead = [i for i in members if not engine_alive(urls[i], REPAIR_HEALTH_S)]
        if dead and self.membership is None:
            raise WeightSyncError(
                f"weight sync to version {weight_version} failed: rollout engines {dead} died "
                f"during it ({_first_line(failed)}); with rollout.fault_tolerance=true the "
                "others would take the version and the job go on"
            ) from failed
        if dead:
            self.membership.drop(dead, f"it died during the sync to version {weight_version}")
            members = tuple(i for i in members if i not in dead)
        if not members:
            raise WeightSyncError(
                f"weight sync to version {weight_version} failed and no rollout engine is left "
                f"to take it: {_first_line(failed)}"
            ) from failed
        return members

    def sync_once(self, weight_version: int) -> list[dict[str, Any]]:
        """One send of the trainer's weights to the engines of the current broadcast groups as
        ``weight_version``, within ``weight_sync.timeout_s``: one update session per engine,
        every pipeline stage streams into it with one request per engine that sets the version
        and flushes the prefix cache (``sync_weights`` keeps the engines out of routing)."""
        replica0 = [r for r in self.plan.trainer.ranks if self.plan.trainer.coordinates(r)[1] == 0]
        deadline = Deadline(self.weight_sync_timeout_s)
        engines = UpdateSession(self.sync_targets, deadline, self.engine_control)
        began = time.monotonic()
        try:
            engines.open()
            control_s = time.monotonic() - began
            replies = self._stage_by_stage(
                lambda left: SendWeights(weight_version, left), replica0, deadline, "sending"
            )
        except BaseException:
            with contextlib.suppress(EngineRequestError, WeightSyncError):
                engines.close()  # on every engine it opened on; keep the sync's own error
            raise
        began = time.monotonic()
        engines.close()
        control_s += time.monotonic() - began
        return [{**r, "control_s": control_s} for r in replies.values() if r is not None]

    def _stage_by_stage(
        self,
        command: Callable[[float], Command],
        replica0: list[int],
        deadline: Deadline,
        what: str,
    ) -> dict[int, Any]:
        """Run a weight command (built with the seconds left) on one pipeline stage after the
        other. An engine serves one update request at a time and every stage's broadcast group
        spans every engine, so two stages sending at once could each hold an engine the other
        one waits for; in turn, the engines take the stages in the same order."""
        replies: dict[int, Any] = {}
        for stage in range(self.plan.trainer.pp_size):
            ranks = [r for r in replica0 if self.plan.trainer.coordinates(r)[2] == stage]
            left = deadline.left(what)
            replies.update(self._call(command(left), ranks, left + REPLY_MARGIN_S))
        return replies

    def train_step(self, batch: TokenBatch, spec: LossSpec | None = None) -> dict[str, float]:
        return self.trainer.train_step(batch, spec)

    def logprobs(self, batch: TokenBatch) -> list[list[float]]:
        return self.trainer.logprobs(batch)

    def save_trainer(self, directory: str) -> list[str]:
        return self.trainer.save(directory)

    def load_trainer(self, directory: str) -> int:
        return self.trainer.load(directory)

    def startup_report(self) -> dict[str, Any]:
        """Every rank's start-up phases and the critical path, as of now."""
        marks = self._call(StartupMarks(), range(self.plan.world_size))
        return startup_report(marks, {r.rank: roles_label(r) for r in self.plan.ranks})

    def shutdown(self) -> None:
        self._call(Shutdown(), range(self.plan.world_size), timeout_s=30)
        self.engine_control.close()


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


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0] if text else ''}"
