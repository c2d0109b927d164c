"""Rank 0's side of weight sync: which rollout engines take the weights, in which broadcast
groups, and a sync that never leaves an engine half-updated in routing.

Each pipeline stage's source rank forms a group with the engines (``connect``); ``sync`` opens
an update session on every engine, has every stage stream its weights into it, and closes it
(``sync_once``). A send that fails is repaired: the engines stay out of routing while the same
version is sent once more in a new group, without the engines that died
(``rollout.fault_tolerance``); see ``docs/architecture.md``, "Never half-updated".

A LoRA policy served as an adapter (``AdapterServing``) forms no group: each sync publishes the
adapter and every engine loads it (``weights/adapter_sync.py``), under the same routing rules.
"""

from __future__ import annotations

import contextlib
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from relax_launch.console import operator_log
from relax_launch.deadline import Deadline
from relax_launch.inference.engine import EngineControl, EngineRequestError
from relax_launch.inference.manager import InferenceManager
from relax_launch.inference.policy_adapter import adapter_name
from relax_launch.placement.plan import (
    EnginePlan,
    PlacementPlan,
    shared_tp_size,
    sync_rank_offsets,
)
from relax_launch.runtime.control import REPLY_MARGIN_S, Command, RemoteError
from relax_launch.runtime.engine_restart import PROBE_S, RolloutMembership, engine_alive
from relax_launch.runtime.parity_probe import ParityProbe, probe_targets
from relax_launch.runtime.rank_commands import ConnectWeights, ExportAdapter, SendWeights
from relax_launch.runtime.router_restarts import RouterRestarts
from relax_launch.weights.adapter_sync import (
    load_everywhere,
    publish,
    remove_older,
    unload_everywhere,
)
from relax_launch.weights.update_session import (
    EngineTarget,
    UpdateSession,
    WeightSyncError,
    sync_deadline,
)

# runs a command on ranks (rank 0's own share in process), within a timeout
Call = Callable[[Command, list[int], float], dict[int, Any]]


@dataclass(frozen=True)
class AdapterServing:
    """The rollout engines serve the LoRA policy as an adapter: each version is published under
    ``directory`` (which the engines read) with PEFT's ``config``."""

    directory: Path
    config: dict[str, Any]


class WeightSync:
    """The rollout engines' weights, as rank 0 drives them (see the module docstring)."""

    def __init__(
        self,
        plan: PlacementPlan,
        call: Call,
        urls: Callable[[], list[str]],
        rollout: InferenceManager | None,
        store: Any,
        timeout_s: float,
        adapters: AdapterServing | None = None,
    ) -> None:
        self.plan, self._call, self.urls, self.rollout = plan, call, urls, rollout
        self.store, self.timeout_s, self.adapters = store, timeout_s, adapters
        self.sync_targets: list[EngineTarget] = []
        self.halves: list[str | None] = []  # each target's disaggregated half (None: whole)
        self.probe: ParityProbe | None = None  # weight_sync.parity_probe, set by the runtime
        self.engine_control = EngineControl()  # kept-alive connections to the rollout engines
        self.weight_version: int | None = None
        self.uncommitted: int | None = None  # a colocated sync's version, before its probe
        self.membership: RolloutMembership | None = None  # rollout.fault_tolerance only
        self.router_restarts: RouterRestarts | None = None  # the same, behind sglang-router
        self._sync_groups = 0  # broadcast groups formed so far (each one is named anew)
        # held by a sync from start to commit: a scale-in stops no rollout engine meanwhile
        self.lock = threading.Lock()

    def connect(self, members: tuple[int, ...] | None = None) -> None:
        """Each pipeline stage's source rank forms its broadcast group with the rollout engines
        (``members``: these engines only, in a new group, after one died or came back)."""
        urls = self._urls()
        rollout = self.plan.engines_of("rollout")
        members = tuple(e.index for e in rollout if not e.reserved) if members is None else members
        engine_tp_size = self._engine_tp_size([rollout[index] for index in members])
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
        self.halves = [rollout[index].disaggregation for index, _ in offsets]
        self._sync_groups += 1
        groups = self.plan.weight_sync_groups if self.adapters is None else ()
        for group in groups:  # every group reaches the same engines
            command = ConnectWeights(
                pp_rank=group.pp_rank,
                ep_rank=group.ep_rank,
                targets=tuple(self.sync_targets),
                world_size=world_size,
                engine_tp_size=engine_tp_size,
                colocated=self.plan.mode in ("split", "defer"),
                seconds_left=self.timeout_s,
                generation=self._sync_groups,
            )
            self._call(command, [group.source_rank], self.timeout_s + REPLY_MARGIN_S)
        manager = self.rollout
        changing = manager is not None and (manager.fault_tolerant or manager.elastic)
        if self.membership is None and changing:
            self.membership = RolloutMembership(self.store, manager)
            self.router_restarts = RouterRestarts.started(self.store, manager)
        if self.membership is not None:
            self.membership.synced = members

    def _engine_tp_size(self, engines: list[EnginePlan]) -> int:
        """How the trainer sends to ``engines``: in the engines' fused layout, each TP rank its
        own slice received in place, where they share a TP size (returned); as whole
        checkpoint tensors that every rank's ``load_weights`` cuts (0) where their TP sizes
        differ, or where colocated buckets, which every rank reads whole, reach engines of
        several TP ranks."""
        tp_size = shared_tp_size(engines)
        if tp_size is None:
            sizes = sorted({e.tp_size for e in engines})
            operator_log().warning(
                f"relax-launch: rollout engines of TP sizes {sizes} take the weights as whole "
                "tensors, each rank through load_weights (in place needs one TP size)"
            )
        colocated = self.plan.mode in ("split", "defer")
        return 0 if tp_size is None or (colocated and tp_size > 1) else tp_size

    def _urls(self) -> dict[int, str]:
        """Each rollout engine's URL by plan index: the planned ones', and the scaled-out
        ones' as the manager knows them."""
        urls = dict(enumerate(self.urls()))
        if self.rollout is not None:
            urls |= {e.index: e.url for e in self.rollout.engines if e.index is not None}
        return urls

    def metrics(self) -> dict[str, float]:
        """Rollout engines serving and restarts taken back (``rollout.fault_tolerance``), and
        the last parity probe's gap and seconds."""
        metrics = self.membership.metrics() if self.membership is not None else {}
        return metrics | (self.probe.last if self.probe is not None else {})

    def sync(self, weight_version: int) -> list[dict[str, Any]]:
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
        with self.lock:
            rollout = self.rollout
            if rollout is not None:
                rollout.weights_updating()
            try:
                reports = self._sync_whole(weight_version)
                if self.probe is not None:  # before the commit: a failing engine never serves
                    engines = rollout.engines if rollout is not None else []
                    targets = probe_targets(self.sync_targets, self.halves, engines)
                    self.probe.after_sync(weight_version, targets, reports, self.engine_control)
            except BaseException as exc:
                if rollout is not None:
                    rollout.weights_lost(f"the sync to version {weight_version} failed: {exc}")
                raise
            if rollout is not None and self.probe is not None and self.probe.colocated:
                self.uncommitted = weight_version  # routable once its probe passes
            elif rollout is not None:
                rollout.weights_committed(weight_version)
            self.weight_version = weight_version
            return reports

    def check_parity(self) -> None:
        """A colocated sync's engines score the probe once their KV cache is back
        (``runtime/parity_probe.py``), and only then is the version committed (routable): a
        gap beyond the tolerance closes the rollout model as a failed sync does, and is
        raised."""
        if self.probe is None:
            return
        with self.lock:
            try:
                self.probe.check_engines(self.engine_control)
            except BaseException as exc:
                if self.rollout is not None:
                    self.rollout.weights_lost(str(exc).splitlines()[0])
                raise
            version, self.uncommitted = self.uncommitted, None
            if version is not None and self.rollout is not None:
                self.rollout.weights_committed(version)

    def _sync_whole(self, weight_version: int) -> list[dict[str, Any]]:
        if self.membership is not None and (members := self.membership.before_sync()):
            operator_log().warning(self.membership.describe(members, weight_version))
            self.connect(members)  # engines died or came back
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
        self.connect(members)
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
        live one answers within SGLang's own bound for ``/health`` (``PROBE_S``: it sleeps 1 s, then
        waits up to 20 s for its scheduler, which a long prefill may hold)."""
        engines = [e.index for e in self.plan.engines_of("rollout") if not e.reserved]
        synced = self.membership.synced if self.membership is not None else None
        urls = self._urls()  # an engine a scale-out took back is gone from them: not sent to
        members = tuple(i for i in (synced if synced is not None else engines) if i in urls)
        dead = [i for i in members if not engine_alive(urls[i], PROBE_S)]
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
        deadline = sync_deadline(self.timeout_s)
        if self.adapters is not None:
            trainer = self.plan.trainer
            replica0 = [
                r for r in trainer.ranks if trainer.coordinates(r)[1] == trainer.cp_rank(r) == 0
            ]
            return [self._load_adapter(weight_version, replica0, deadline)]
        engines = UpdateSession(self.sync_targets, deadline, self.engine_control)
        began = time.monotonic()
        try:
            engines.open()
            control_s = time.monotonic() - began
            replies = self._send_stage_by_stage(weight_version, deadline)
        except BaseException:
            with contextlib.suppress(EngineRequestError, WeightSyncError):
                engines.close()  # on every engine it opened on; keep the sync's own error
            raise
        began = time.monotonic()
        engines.close()
        control_s += time.monotonic() - began
        return [{**r, "control_s": control_s} for r in replies.values() if r is not None]

    def _load_adapter(
        self, weight_version: int, replica0: list[int], deadline: Deadline
    ) -> dict[str, Any]:
        """The adapter sync: the stages write their adapters, rank 0 publishes them as one PEFT
        adapter, every engine loads it as the new version, then drops the one before."""
        began = time.monotonic()
        target = self.adapters.directory / adapter_name(weight_version)
        shutil.rmtree(target, ignore_errors=True)
        target.mkdir(parents=True)
        left = deadline.left("exporting the adapters")
        replies = self._call(ExportAdapter(str(target)), replica0, left + REPLY_MARGIN_S)
        files = [file for reply in replies.values() for file in (reply or {}).values()]
        nbytes = publish(target, files, self.adapters.config)
        exported = time.monotonic()
        left = deadline.left("loading the adapter")
        load_everywhere(self.engine_control, self.sync_targets, target, weight_version, left)
        loaded = time.monotonic()
        if self.weight_version is not None and self.weight_version != weight_version:
            left = deadline.left("unloading the previous adapter")
            unload_everywhere(self.engine_control, self.sync_targets, self.weight_version, left)
        remove_older(self.adapters.directory, target)
        return {
            "weight_version": weight_version,
            "transport": "adapter",
            "num_tensors": len(files),
            "num_bytes": nbytes,
            "seconds": time.monotonic() - began,
            "export_s": exported - began,
            "transfer_s": 0.0,
            "engine_s": loaded - exported,
            "control_s": time.monotonic() - loaded,
            "receivers": (),
        }

    def _send_stage_by_stage(self, weight_version: int, deadline: Deadline) -> dict[int, Any]:
        """Each pipeline stage's source ranks send their weights (with expert parallelism, each
        EP rank its experts), one group after the other (each with the seconds left). An engine
        serves one update request at a time and every group spans every engine, so two groups
        sending at once could each hold an engine the other one waits for; in turn, the engines
        take the groups in the same order."""
        replies: dict[int, Any] = {}
        trainer = self.plan.trainer
        for group in self.plan.weight_sync_groups:
            ranks = [
                r
                for r in trainer.ranks
                if trainer.exports(r)
                and trainer.coordinates(r)[2] == group.pp_rank
                and trainer.ep_rank(r) == group.ep_rank
            ]
            left = deadline.left("sending")
            replies.update(
                self._call(SendWeights(weight_version, left), ranks, left + REPLY_MARGIN_S)
            )
        return replies

    def close(self) -> None:
        if self.router_restarts is not None:
            self.router_restarts.close()
        self.engine_control.close()


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0] if text else ''}"
