"""InferenceManager: the one lifecycle for every role's engines, and its discovery snapshots.

States: STARTING -> READY; drain -> DRAINING; offload -> SLEEPING; onload -> ONLOADING -> READY;
any failed transition -> FAILED (admission closed until an onload succeeds); shutdown -> DEAD.
Operations are idempotent and serialised; snapshots are read without waiting for them. A
rollout model is published READY only once its weights are valid (after the first weight sync,
and again after a sync that follows an offload of its weights) and never while a sync is in
flight, nor after one failed for good (its engines may hold parts of two versions).
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterable

from relax_launch.deadline import Deadline
from relax_launch.inference.discovery import (
    Discovery,
    ModelRecord,
    RouteMode,
    RoutingSpec,
    State,
    WeightSource,
)
from relax_launch.inference.engine import MEMORY_TAGS, EngineHandle, EngineRequestError
from relax_launch.inference.model_config import ServedModel
from relax_launch.inference.model_records import engine_record
from relax_launch.inference.request_counts import RequestCounts
from relax_launch.inference.router_workers import RouterWorkers


class LifecycleError(RuntimeError):
    """A lifecycle operation failed; the model stays unavailable until a successful onload."""


class InferenceManager:
    """One role's models: their engines, each tagged with its model, one lifecycle for them
    all, readiness and discovery. ``models``: each model's served name and vocabulary (token
    ids outside it are refused before an engine), its default model (``model_id``) first; the
    control plane adds a role's further models (``{role}.models``) before engines attach."""

    router: RouterWorkers | None = None  # route mode router: its workers follow routing

    def __init__(
        self,
        *,
        role: str,
        model_id: str,
        served_model_name: str,
        weight_source: WeightSource,
        routing: RoutingSpec,
        phase: str = "serving",
        drain_timeout_s: float = 60.0,
        vocab_size: int | None = None,
        fault_tolerant: bool = False,
        restart_wait_s: float = 0.0,
        elastic: bool = False,
    ) -> None:
        self.role, self.model_id = role, model_id  # its default model's id
        self.models = {model_id: ServedModel(served_model_name, vocab_size)}  # (see the class)
        self.weight_source, self.routing, self.phase = weight_source, routing, phase
        self.drain_timeout_s = drain_timeout_s
        # an engine that stops answering is routed around; with none left, wait for a restart
        self.fault_tolerant, self.restart_wait_s = fault_tolerant, restart_wait_s
        self.lost: dict[str, str] = {}  # engine id -> why it is out of routing
        # elastic replicas (max_engines): engines come and go while the job runs
        self.elastic = elastic
        self.joining: set[str] = set()  # scaled-out rollout engines waiting for a weight sync
        self.retired: set[str] = set()  # scaled-in engines finishing what they were sent
        self.retired_urls: set[str] = set()  # where retired engines served: failures reroute
        self.requests = RequestCounts()  # per engine: in flight (a scale-in waits) and answered
        self.registry_epoch = f"{role}-{uuid.uuid4().hex[:12]}"
        self.engines: list[EngineHandle] = []
        self.router_url: str | None = None
        self.state = State.STARTING
        self.weights_valid = weight_source is WeightSource.STATIC
        self.weight_version: str | None = None
        self.updating = False
        self.weights_lost_why = ""  # why the last sync left the weights unfit to serve
        self._operation = threading.RLock()  # serialises transitions
        self._fields = threading.Lock()  # guards what snapshots read
        self._revision, self._published = 0, None
        self._on_shutdown: list[Callable[[], None]] = []

    # ---- start-up and weights ------------------------------------------------------------

    def attach(
        self,
        engines: list[EngineHandle],
        router_url: str | None = None,
        on_shutdown: Iterable[Callable[[], None]] = (),
        router: RouterWorkers | None = None,
    ) -> None:
        """The engines are up and serving (each generated a token); ``router``: the worker
        list of the router at ``router_url``, kept to the engines in routing."""
        with self._operation, self._fields:
            self.engines, self.router_url, self.router = list(engines), router_url, router
            self._on_shutdown = list(on_shutdown)
            self.state = State.READY

    def weights_updating(self) -> None:
        """A weight sync starts: rollout stops being routable until it commits."""
        with self._fields:
            self.updating = True

    def weights_committed(self, version: int) -> None:
        """A sync committed ``version``; confirm every engine serves it, then open."""
        served = {}
        for engine in self.serving():
            try:
                served[engine.engine_id] = engine.weight_version()
            except EngineRequestError as exc:
                if not self.fault_tolerant:
                    self._fail(f"reading weight_version after sync {version}: {exc}")
                self.engine_lost(engine.engine_id, f"gone after sync {version}: {exc}")
        stale = {k: v for k, v in served.items() if v != str(version)}
        if stale:
            self._fail(f"engines {stale} do not serve weight_version {version} after the sync")
        if self.router is not None:  # a scaled-out or restarted engine joins it now, not before
            for engine in self.router.match(self.serving):
                self.engine_lost(engine.engine_id, f"sglang-router did not take {engine.url}")
        with self._fields:
            self.updating, self.weights_valid, self.weight_version = False, True, str(version)
            self.weights_lost_why = ""

    def weights_lost(self, why: str) -> None:
        """A sync failed for good: the engines may hold parts of two versions, so the model is
        not routable until a later sync commits (its weight version stays the last whole one)."""
        with self._fields:
            self.updating, self.weights_valid, self.weights_lost_why = False, False, why

    # ---- engines that die and come back (fault_tolerant) ---------------------------------

    def serving(self) -> list[EngineHandle]:
        """The engines in routing: all of them but the lost, joining and retired ones."""
        out = self.lost.keys() | self.joining | self.retired
        return [e for e in self.engines if e.engine_id not in out]

    def engine_lost(self, engine_id: str, why: str) -> None:
        """Take an engine out of routing (its server died) until ``engine_back``."""
        with self._fields:
            self.lost.setdefault(engine_id, why)
        self._unroute(engine_id)

    def engine_back(self, engine_id: str) -> None:
        """A lost engine was restarted and takes part in the weight sync about to run: it is
        routed again once that sync commits (the model is not routable while it runs)."""
        with self._fields:
            self.lost.pop(engine_id, None)
            for engine in self.engines:
                if engine.engine_id == engine_id:
                    engine.generation += 1

    # ---- elastic replicas (max_engines) ----------------------------------------------------

    def add_engine(self, engine: EngineHandle, joining: bool = False) -> None:
        """A scaled-out engine, routable now, or (``joining``: a rollout engine) once the next
        weight sync has committed on it (``RolloutMembership`` brings it into that sync)."""
        self.requests.restart(engine.engine_id)  # a new server behind the id
        with self._fields:
            self.engines = sorted([*self.engines, engine], key=lambda e: e.index or 0)
            if joining:
                self.joining.add(engine.engine_id)

    def admit(self, engine_id: str) -> None:
        """A joining engine takes part in the weight sync about to run: routed once it commits."""
        with self._fields:
            self.joining.discard(engine_id)

    def retire(self, engine_id: str) -> None:
        """Out of routing for good: a scale-in lets what it was sent finish first."""
        with self._fields:
            self.retired.add(engine_id)
        self._unroute(engine_id)

    def remove_engine(self, engine_id: str) -> None:
        """The engine's server was stopped (or never served): forget it; a request that fails
        at its address is sent elsewhere (``was_retired``)."""
        self._unroute(engine_id)
        with self._fields:
            for engine in self.engines:
                if engine.engine_id == engine_id:
                    self.retired_urls.add(engine.url)
            self.engines = [e for e in self.engines if e.engine_id != engine_id]
            self.lost.pop(engine_id, None)
            self.joining.discard(engine_id)
            self.retired.discard(engine_id)

    def _unroute(self, engine_id: str) -> None:
        """Route mode router: out of the router's workers too, before this returns."""
        for engine in self.engines if self.router is not None else ():
            if engine.engine_id == engine_id:
                self.router.remove(engine.url)

    def was_retired(self, url: str) -> bool:
        """Whether ``url`` (an engine path) is at an engine a scale-in took out of routing."""
        with self._fields:
            retired = {e.url for e in self.engines if e.engine_id in self.retired}
            return any(url.startswith(base + "/") for base in retired | self.retired_urls)

    # ---- lifecycle -----------------------------------------------------------------------

    def drain(self) -> None:
        """Pause generation, abort what runs, flush until idle (bounded by drain_timeout_s)."""
        with self._operation:
            if self.state in (State.DRAINING, State.SLEEPING):
                return
            self._run("drain", State.DRAINING, self._drain_engines, State.DRAINING)

    def offload(self, tags: Iterable[str] = MEMORY_TAGS) -> None:
        """Drain, then release ``tags``; a failed drain never releases memory."""
        tags = _tags(tags)
        with self._operation:
            if self.state is State.SLEEPING and not any(e.loaded & tags for e in self.engines):
                return

            drained = self.state is State.DRAINING

            def action() -> None:
                if not drained:
                    self._drain_engines()
                if "weights" in tags and self.weight_source is not WeightSource.STATIC:
                    # Trainer-fed weights are not backed up: they come back as zeros and stay
                    # invalid until the next sync commits (set first: a release may fail midway).
                    with self._fields:
                        self.weights_valid = False
                for engine in self.engines:
                    held = sorted(engine.loaded & tags)
                    if held:
                        engine.call("release_memory_occupation", {"tags": held})
                        engine.loaded -= set(held)

            self._run("offload", State.DRAINING, action, State.SLEEPING)

    def onload(self, tags: Iterable[str] = MEMORY_TAGS) -> None:
        """Resume only the missing ``tags``; reopen generation once every tag is back."""
        tags = _tags(tags)
        with self._operation:
            if self.state is State.DEAD:
                raise LifecycleError(f"{self.role} is shut down; it cannot be onloaded")
            if self.state is State.READY and all(e.complete for e in self.engines):
                return

            def action() -> None:
                for engine in self.engines:
                    missing = sorted(tags - engine.loaded)
                    if missing:
                        engine.call("resume_memory_occupation", {"tags": missing})
                        engine.loaded |= set(missing)
                if all(e.complete for e in self.engines):
                    for engine in self.engines:
                        engine.call("continue_generation", {})

            complete = all((e.loaded | tags) >= set(MEMORY_TAGS) for e in self.engines)
            self._run(
                "onload", State.ONLOADING, action, State.READY if complete else State.ONLOADING
            )

    def shutdown(self) -> None:
        """Close admission for good and stop the engines this manager was given stoppers for."""
        with self._operation:
            if self.state is State.DEAD:
                return
            with self._fields:
                self.state = State.DEAD
            for stop in self._on_shutdown:
                stop()

    def _run(self, op: str, pending: State, action: Callable[[], None], done: State) -> None:
        with self._fields:
            self.state = pending
        try:
            action()
        except Exception as exc:  # noqa: BLE001 - any failure must close admission
            self._fail(f"{op} failed: {exc}")
        with self._fields:
            self.state = done

    def _fail(self, why: str) -> None:
        with self._fields:
            self.state = State.FAILED
        raise LifecycleError(
            f"{self.role} model {self.model_id!r}: {why}; admission stays closed until an "
            "onload succeeds"
        )

    def _drain_engines(self) -> None:
        deadline = Deadline(self.drain_timeout_s)
        for engine in self.engines:
            engine.call("pause_generation", {"mode": "abort"})
        for engine in self.engines:
            while True:
                engine.call("abort_request", {"abort_all": True})
                try:
                    engine.call("flush_cache", {})  # succeeds only once the engine is idle
                    break
                except EngineRequestError:
                    if deadline.passed:
                        raise TimeoutError(
                            f"engine {engine.engine_id} still busy after "
                            f"{self.drain_timeout_s:.0f} s; memory was not released"
                        ) from None
                    time.sleep(0.1)

    # ---- discovery -----------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        return self._model_state() is State.READY

    def _model_state(self) -> State:
        if self.state is State.READY and (not self.weights_valid or self.updating):
            return State.ONLOADING
        return self.state

    def snapshot(self) -> Discovery:
        """The current discovery document; ``topology_revision`` moves only on change.

        Built again only when something it shows changed (the gateway asks on every request).
        """
        with self._fields:
            key = (
                self._model_state(),
                self.weight_version,
                self.router_url,
                tuple((e.engine_id, e.url, e.complete, e.generation) for e in self.serving()),
            )
            if self._published is None or key != self._published[0]:
                self._revision += 1
                self._published = (key, self._build(key[0]))
            return self._published[1]

    def model_of(self, engine: EngineHandle) -> str:
        """The id of the model ``engine`` serves."""
        return engine.model_id or self.model_id

    @property
    def served_model_name(self) -> str:
        """The name the default model's engines report."""
        return self.models[self.model_id].served_model_name

    def vocab_of(self, model_id: str) -> int | None:
        """The vocabulary of ``model_id`` (a model this role serves)."""
        return self.models[model_id].vocab_size

    def image_token_of(self, model_id: str) -> int | None:
        """The image placeholder token of ``model_id`` (a model this role serves); None when
        it takes no images."""
        return self.models[model_id].image_token_id

    def _build(self, state: State) -> Discovery:
        serving = {e.engine_id: e for e in self.serving()}
        return Discovery(
            role=self.role,
            registry_epoch=self.registry_epoch,
            topology_revision=self._revision,
            phase=self.phase,
            routing=self.routing,
            models={m: self._model_record(m, state, serving) for m in self.models},
        )

    def _model_record(
        self, model_id: str, state: State, serving: dict[str, EngineHandle]
    ) -> ModelRecord:
        """One model's state and engines. Every model shares the role's lifecycle; one whose
        engines are all out of routing (lost, scaled in) has none to offer."""
        engines = tuple(
            engine_record(e, state, serving)
            for e in serving.values()
            if e.half != "prefill" and self.model_of(e) == model_id
        )
        return ModelRecord(
            state=state,
            route_mode=RouteMode.ROUTER if self.router_url else RouteMode.DIRECT,
            router_url=self.router_url,
            weight_source=self.weight_source,
            weight_version=self.weight_version,
            served_model_name=self.models[model_id].served_model_name,
            engines=engines,
        )


def _tags(tags: Iterable[str]) -> set[str]:
    tags = set(tags)
    unknown = sorted(tags - set(MEMORY_TAGS))
    if unknown or not tags:
        raise ValueError(f"memory tags must be a non-empty subset of {MEMORY_TAGS}, not {unknown}")
    return tags
