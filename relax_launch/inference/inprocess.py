"""The controller's way to the engines, in process: no HTTP hop through its own gateway.

``EngineClients`` holds, for the whole job, one event loop on its own thread, one pooled
kept-alive HTTP session and one ``EngineClient`` per role. An ``EngineClient`` reads discovery
straight from the role's ``InferenceManager``, picks the engine with ``RouteResolver`` (the
gateway's rule: same model choice, same affinity engine, same 503 before readiness) and answers
as the gateway would (a 503 refusal, tried once more after ``RETRY_AFTER_S``; 400 for a token
outside the vocabulary; 502/504 for an engine that fails or stalls), each as ``InferenceError``,
except for images: the controller's go as they are (its prompts' were read before start, those
user code made were held to gateway.images by the agent client: ``controller_images_problem``).
The gateway stays the door for external clients;
what the controller sends is counted as ``relax_controller_*`` (on the gateway's /metrics when
given its registry), not as ``relax_gateway_*``.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Coroutine
from concurrent.futures import CancelledError, Future
from typing import Any, TypeVar

import aiohttp
from prometheus_client import CollectorRegistry

from relax_launch import http
from relax_launch.inference.client import InferenceError, Prepared, engine_request
from relax_launch.inference.disaggregation import PrefillUnreachable
from relax_launch.inference.generation_routes import JUDGE_SAMPLING, Renderer, renderer_for
from relax_launch.inference.health import HealthProbe
from relax_launch.inference.images import (
    ImagePolicy,
    ImageRefused,
    controller_images_problem,
    has_images,
    image_urls,
    text_placeholders_problem,
)
from relax_launch.inference.manager import InferenceManager
from relax_launch.inference.metrics import ControllerMetrics
from relax_launch.inference.outage import EngineOutage
from relax_launch.inference.requests import vocabulary_problem
from relax_launch.inference.routing import (
    ENGINE_PATHS,
    RETRY_AFTER_S,
    ROUTING_FIELDS,
    RouteResolver,
    RoutingError,
    select_model,
)

T = TypeVar("T")
log = logging.getLogger("relax_launch.inference")
# SGLang's HTTP server drops a connection idle for 5 s: reuse one only well before that, so a
# request never meets a connection the engine is closing (a generation is never sent twice).
KEEPALIVE_S = 4.0
MAX_CONNECTIONS = 2048  # as many concurrent requests as the gateway's pool takes
RUN_MARGIN_S = 30.0  # run()'s default bound, beyond one request's deadline and one retry


class EngineUnreachable(InferenceError):
    """The engine at ``url`` could not be reached or dropped the request (HTTP 502)."""

    def __init__(self, url: str, message: str) -> None:
        super().__init__(502, message)
        self.url = url


class RequestsCancelled(RuntimeError):
    """``EngineClients.cancel_all`` dropped this wait (the job is stopping)."""


class EngineClient:
    """One role's engines for the controller; every method runs on the job's event loop."""

    def __init__(
        self,
        manager: InferenceManager,
        *,
        resolver: RouteResolver,
        timeout_s: float,
        metrics: ControllerMetrics,
        renderers: dict[str, Renderer] | None = None,
        probe: HealthProbe | None = None,
        images: ImagePolicy | None = None,
    ) -> None:
        self.manager, self.role = manager, manager.role
        # gateway.images, for the images user code makes (the agent client applies it)
        self.images = images or ImagePolicy()
        self.session: aiohttp.ClientSession | None = None  # the job's session, once started
        self.resolver, self.timeout_s, self.metrics = resolver, timeout_s, metrics
        self.renderers = renderers or {}  # the genrm role's judge form (chat messages in)
        self.probe = probe or HealthProbe()  # when an engine that dropped a request is gone
        self.outage = EngineOutage(manager)  # every engine restarting: requests wait for one
        # engine id -> its probe in progress: the requests it dropped all wait on one
        self._probes: dict[str, asyncio.Future[str | None]] = {}

    async def request(self, path: str, payload: dict, *, affinity_key: str | None = None) -> Any:
        """POST ``payload`` to the engine the gateway would choose; returns the parsed reply."""
        started, model, status = time.perf_counter(), "-", 500
        self.metrics.in_flight.labels(self.role).inc()
        try:
            try:  # refused (400) before any engine
                self._images(payload)
            except (RoutingError, ImageRefused) as exc:
                raise InferenceError(exc.status, str(exc)) from None
            if path == "/generate" and payload.get("messages") is not None:
                reply, model = await self._judge(payload, affinity_key)
            else:
                prepared = await self._routed(path, payload, affinity_key)
                model = prepared.model_id
                ids = payload.get("input_ids") or payload.get("prompt")
                problem = vocabulary_problem(ids, self.manager.vocab_of(model))
                if problem is not None:
                    raise InferenceError(400, problem)
                reply = (await self._post_or_reroute(prepared, path, payload, affinity_key)).json()
            status = 200
            return reply
        except InferenceError as error:
            status = error.status
            raise
        except asyncio.CancelledError:
            status = 499  # the caller gave up (a bounded wait passed, or the job is closing)
            raise
        finally:
            self.metrics.in_flight.labels(self.role).dec()
            seconds = time.perf_counter() - started
            self.metrics.finished(self.role, path.lstrip("/"), model, status, seconds)

    def _images(self, payload: dict) -> None:
        """``controller_images_problem`` of ``payload``, whose images go as they are."""
        if has_images(payload):
            snapshot, route_key = self.manager.snapshot(), payload.get("route_key")
            model = select_model(snapshot, payload.get("model"), route_key)
            controller_images_problem(payload, model, self.manager.image_token_of(model))

    def _route(self, path: str, payload: dict, affinity_key: str | None) -> Prepared:
        if path not in ENGINE_PATHS:
            raise ValueError(f"the engine client serves {sorted(ENGINE_PATHS)}, not {path!r}")
        model, route_key = payload.get("model"), payload.get("route_key")
        try:
            target = self.resolver.resolve(self.manager.snapshot(), model, route_key, affinity_key)
        except RoutingError as exc:  # the gateway's answer: 400, or 503 while not ready
            raise InferenceError(exc.status, str(exc)) from None
        return engine_request(target, path, payload)

    async def _routed(self, path: str, payload: dict, affinity_key: str | None) -> Prepared:
        try:
            return self._route(path, payload, affinity_key)
        except InferenceError as error:
            if error.status != 503:
                raise
        # refused as not ready, before any engine saw it: once more, as through the gateway,
        # or once an engine serves again when every one is restarting
        await (self.outage.wait() if self.outage.waits else asyncio.sleep(RETRY_AFTER_S))
        return self._route(path, payload, affinity_key)

    async def _post(self, prepared: Prepared) -> http.Reply:
        """One POST, never replayed; the gateway's 504 and 502 for a stalled or lost engine.
        Counted in flight to its engine while it runs (a scale-in waits for them)."""
        try:
            with self.manager.requests.track(prepared.engine_id):
                reply = await prepared.post(self.session, self.timeout_s)
        except TimeoutError:
            raise InferenceError(
                504, f"upstream {prepared.url} did not answer within {self.timeout_s:.0f} s"
            ) from None
        except http.TransportError as exc:
            # a pair's prefill half that is gone is that engine's failure, not the decode half's
            url = exc.url if isinstance(exc, PrefillUnreachable) else prepared.url
            raise EngineUnreachable(
                url, f"upstream {url} unavailable: {type(exc).__name__}: {exc}"
            ) from None
        if not reply.ok:
            raise InferenceError.of(reply)
        return reply

    async def _post_or_reroute(
        self, prepared: Prepared, path: str, payload: dict, affinity_key: str | None
    ) -> http.Reply:
        """``_post``; on a fault-tolerant role, an engine that cannot be reached and is gone
        (``_engine_died``) leaves routing and the request goes to another engine (what it was
        generating died with it); with none left, it waits for one (``EngineOutage``) or gets
        503. So does a request that was still on an engine a scale-in stopped."""
        while True:
            try:
                return await self._post(prepared)
            except EngineUnreachable as error:
                if self.manager.was_retired(error.url):
                    log.info("%s: %s was scaled in; sent elsewhere", self.role, error.url)
                elif not self.manager.fault_tolerant or not await self._engine_died(error):
                    raise
            self.manager.requests.regenerating()  # generated again from its start
            self.metrics.regenerated.labels(self.role).inc()
            prepared = await self._routed(path, payload, affinity_key)

    async def _engine_died(self, error: EngineUnreachable) -> bool:
        """Whether the engine behind ``error`` is gone (then it is out of routing now): its
        port refuses connections, or it failed ``self.probe``'s probes (``health.py``)."""
        engine = next((e for e in self.manager.engines if error.url.startswith(e.url + "/")), None)
        if engine is None:
            return False
        if engine.engine_id in self.manager.lost:
            return True
        probe = self._probes.get(engine.engine_id)
        if probe is None:
            probe = self._probes[engine.engine_id] = asyncio.ensure_future(
                self.probe.gone(self.session, engine.url)
            )
            probe.add_done_callback(lambda _: self._probes.pop(engine.engine_id, None))
        gone = await asyncio.shield(probe)  # one request cancelled does not end the probe
        if gone is not None and engine.engine_id not in self.manager.lost:
            log.warning(
                "%s engine %s is gone (%s; %s): routing around it until it answers",
                self.role,
                engine.engine_id,
                error.message,
                gone,
            )
            self.manager.engine_lost(engine.engine_id, f"{error.message}; {gone}")
            self.metrics.engines_lost.labels(self.role).inc()
        return gone is not None

    async def _judge(self, payload: dict, affinity_key: str | None) -> tuple[dict, str]:
        """The gateway's judge form: chat messages in, ``{"response": text}`` out."""
        if self.role not in self.renderers:
            raise InferenceError(
                400, f"/{self.role}/generate takes messages only on the genrm role"
            )
        chosen = await self._routed("/generate", payload, affinity_key)  # refuse before rendering
        render = renderer_for(self.renderers, self.role, chosen.model_id)
        kwargs = payload.get("chat_template_kwargs") or {}
        try:
            prompt = await asyncio.wait_for(
                asyncio.to_thread(render, payload["messages"], kwargs), self.timeout_s
            )
        except TimeoutError:
            raise InferenceError(
                504, "rendering the judge prompt passed the request deadline"
            ) from None
        except Exception as exc:  # noqa: BLE001 - a template that cannot take these messages
            raise InferenceError(
                400, f"the judge's chat template rejected the messages: {exc}"
            ) from None
        sampling = {**JUDGE_SAMPLING, **(payload.get("sampling_params") or {})}
        routing = {k: payload[k] for k in ROUTING_FIELDS if k in payload}
        judged = {**routing, "text": prompt, "sampling_params": sampling}
        if image_urls(payload["messages"]):  # checked; in the order the template shows them
            judged["image_data"] = image_urls(payload["messages"])
            try:
                text_placeholders_problem(prompt, judged["image_data"])
            except ImageRefused as exc:
                raise InferenceError(exc.status, str(exc)) from None
        routed = self._route("/generate", judged, affinity_key)  # it may sleep meanwhile
        reply = await self._post_or_reroute(routed, "/generate", judged, affinity_key)
        try:
            text = reply.json()["text"]
        except (ValueError, KeyError, TypeError):
            raise InferenceError(
                502, f"the judge engine's reply has no text: {reply.body[:200]!r}"
            ) from None
        return {"response": text.strip()}, routed.model_id


class EngineClients:
    """The job's event loop (a daemon thread), HTTP session and one ``EngineClient`` per role.

    Any thread (the RL loop, its background rollout) runs a coroutine on the loop with ``run``.
    """

    def __init__(
        self,
        managers: dict[str, InferenceManager],
        *,
        timeout_s: float,
        renderers: dict[str, Renderer] | None = None,
        registry: CollectorRegistry | None = None,
        probe: HealthProbe | None = None,
        images: ImagePolicy | None = None,
    ) -> None:
        self.timeout_s, self.metrics = timeout_s, ControllerMetrics(registry)
        self.runner: http.Portal | None = None
        self.cancelled: str | None = None  # why every wait was dropped (cancel_all)
        self._waits: set[Any] = set()  # the futures run() waits on
        self._waits_lock = threading.Lock()
        self.session: aiohttp.ClientSession | None = None
        resolver = RouteResolver()  # one set of round-robin cursors for the controller
        self.clients = {
            role: EngineClient(
                manager,
                resolver=resolver,
                timeout_s=timeout_s,
                metrics=self.metrics,
                renderers=renderers,
                probe=probe,
                images=images,
            )
            for role, manager in managers.items()
        }

    def client(self, role: str) -> EngineClient:
        if role not in self.clients:
            raise KeyError(f"this job has no {role} role (configured: {sorted(self.clients)})")
        return self.clients[role]

    def start(self) -> None:
        """Start the loop and open the session every role's client shares."""
        self.runner = http.Portal("relax-engine-clients")
        # SGLang's HTTP server drops a connection idle for 5 s: reuse one only well before that
        self.session = self.runner.session(limit=MAX_CONNECTIONS, keepalive_s=KEEPALIVE_S)
        for client in self.clients.values():
            client.session = self.session

    @property
    def running(self) -> bool:
        return self.runner is not None and self.runner.running

    def start_soon(self, coro: Coroutine[Any, Any, T]) -> Future[T]:
        """Start ``coro`` on the job's loop (a task that runs on its own, e.g. the continuous
        rollout's producer); cancel the returned future to cancel it."""
        if self.runner is None:
            raise RuntimeError("the controller's engine clients were not started")
        return self.runner.submit(coro)

    def run(self, coro: Coroutine[Any, Any, T], what: str, timeout_s: float | None = None) -> T:
        """``coro``'s result, run on the job's loop; called from any other thread. Waits at
        most ``timeout_s`` (default: one request's deadline, one retry and a margin), then
        cancels it and says what it waited for."""
        if not self.running or threading.current_thread() is self.runner.thread:
            coro.close()
            raise RuntimeError(
                "the controller's engine clients are not running (not started, or closed), or "
                "run() was called on their own event loop"
            )
        # a request may also wait for a restarted engine (EngineOutage) before it is sent
        restart_s = max(c.outage.bound_s for c in self.clients.values()) if self.clients else 0
        limit = self.timeout_s + restart_s + RETRY_AFTER_S + RUN_MARGIN_S
        limit = limit if timeout_s is None else timeout_s
        with self._waits_lock:
            if self.cancelled is not None:
                coro.close()
                raise RequestsCancelled(f"{what}: not sent ({self.cancelled})")
            future = self.runner.submit(coro)
            self._waits.add(future)
        try:
            return future.result(limit)
        except TimeoutError:
            future.cancel()
            raise TimeoutError(
                f"{what} did not finish within {limit:.0f} s though each request has "
                f"{self.timeout_s:.0f} s (gateway.request_timeout_s); in flight: "
                f"{self.in_flight()}; the controller's event loop may be blocked"
            ) from None
        except CancelledError:
            raise RequestsCancelled(f"{what}: cancelled ({self.cancelled})") from None
        finally:
            with self._waits_lock:
                self._waits.discard(future)

    def cancel_all(self, why: str) -> None:
        """Cancel every request in flight (closing its connection tells the engine to abort it)
        and refuse new ones: each waiting ``run`` raises ``RequestsCancelled`` naming ``why``."""
        with self._waits_lock:
            self.cancelled = why
            waits = list(self._waits)
        for future in waits:
            future.cancel()

    def in_flight(self) -> dict[str, int]:
        return {
            sample.labels["role"]: int(sample.value)
            for metric in self.metrics.in_flight.collect()
            for sample in metric.samples
        }

    def close(self, timeout_s: float = 10.0) -> None:
        """Cancel what still runs (a background rollout nobody waits for), close the session,
        stop the loop; bounded by ``timeout_s`` per stage."""
        if not self.running:
            return
        session = self.session
        self.runner.close(timeout_s, then=session.close() if session is not None else None)
