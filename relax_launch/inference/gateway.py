"""InferenceGateway: the job's HTTP front door, an ASGI app served on rank 0 (see serve.py).

Per role prefix (``/rollout``, ``/genrm``, ``/teacher``): ``POST /generate``,
``/v1/chat/completions``, ``/chat/completions``, ``/v1/completions``; ``GET /v1/models``,
``/engines`` (discovery, schema 2), ``/health``; token-guarded ``/admin/*``. At the root:
``/health`` (liveness), ``/ready``, ``/metrics``, ``/openapi.json``. Handlers stay thin:
validate (400 before any engine), route (``RouteResolver``), forward (``Upstream``).
"""

from __future__ import annotations

import asyncio
import hmac
import time
from collections.abc import Callable
from typing import Any

import orjson

from relax_launch.inference import openapi
from relax_launch.inference.asgi import (
    HttpError,
    Receive,
    Send,
    header,
    parse_object,
    read_body,
    send_bytes,
    send_error,
    send_json,
)
from relax_launch.inference.config import GatewayConfig
from relax_launch.inference.manager import InferenceManager, LifecycleError
from relax_launch.inference.metrics import GatewayMetrics
from relax_launch.inference.proxy import Upstream, forwarded_headers
from relax_launch.inference.requests import (
    ChatRequest,
    CompletionRequest,
    GenerateRequest,
    MemoryTags,
    validate,
)
from relax_launch.inference.routing import (
    ENGINE_PATHS,
    REFUSED_HEADER,
    RETRY_AFTER_S,
    ROUTING_FIELDS,
    ROUTING_KEY_HEADER,
    RouteResolver,
    RouteTarget,
    RoutingError,
)

# Renders judge messages to a prompt with the GenRM model's chat template.
Renderer = Callable[[list[dict[str, Any]], dict[str, Any]], str]
SCHEMAS = {
    "generate": GenerateRequest,
    "v1/chat/completions": ChatRequest,
    "chat/completions": ChatRequest,
    "v1/completions": CompletionRequest,
}
JUDGE_SAMPLING = {"temperature": 0.0, "max_new_tokens": 256}


class InferenceGateway:
    """Routes each role's requests to its engines; one instance serves every role."""

    def __init__(
        self,
        managers: dict[str, InferenceManager],
        *,
        config: GatewayConfig,
        admin_token: str | None,
        renderers: dict[str, Renderer] | None = None,
    ) -> None:
        self.managers, self.config, self.admin_token = managers, config, admin_token
        self.renderers = renderers or {}
        self.resolver, self.metrics = RouteResolver(), GatewayMetrics()
        self.upstream = Upstream(config.request_timeout_s)
        self.routes = self._route_table()

    def _route_table(self) -> dict[tuple[str, str], tuple[Callable, str | None, str]]:
        table: dict[tuple[str, str], tuple[Callable, str | None, str]] = {
            ("GET", "/health"): (self._health, None, "health"),
            ("GET", "/ready"): (self._ready, None, "ready"),
            ("GET", "/metrics"): (self._metrics, None, "metrics"),
            ("GET", "/openapi.json"): (self._openapi, None, "openapi"),
        }
        for role in self.managers:
            for name in SCHEMAS:
                table[("POST", f"/{role}/{name}")] = (self._generation, role, name)
            for name, handler in (
                ("v1/models", self._models),
                ("engines", self._engines),
                ("health", self._role_health),
                ("admin/engines", self._admin_engines),
            ):
                table[("GET", f"/{role}/{name}")] = (handler, role, name)
            for op in ("drain", "offload", "onload"):
                table[("POST", f"/{role}/admin/{op}")] = (
                    self._admin_operation,
                    role,
                    f"admin/{op}",
                )
        return table

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            return await self._lifespan(receive, send)
        if scope["type"] != "http":
            return
        route = self.routes.get((scope["method"], scope["path"]))
        if route is None:
            return await send_error(send, self._not_found(scope))
        handler, role, endpoint = route
        started, model = time.perf_counter(), "-"
        self.metrics.started(role or "-")
        status = 500
        try:
            status, model = await handler(role, endpoint, scope, receive, send)
        except HttpError as error:
            status = error.status
            await send_error(send, error)
        finally:
            seconds = time.perf_counter() - started
            self.metrics.finished(role or "-", endpoint, model, status, seconds)

    def _not_found(self, scope: dict[str, Any]) -> HttpError:
        path = scope["path"]
        if any(p == path for _, p in self.routes):
            return HttpError(405, f"{scope['method']} is not allowed on {path}")
        role = path.strip("/").split("/", 1)[0]
        if role in ("rollout", "genrm", "teacher") and role not in self.managers:
            return HttpError(
                404, f"this job has no {role} role (configured: {sorted(self.managers)})"
            )
        return HttpError(404, f"no route {path}; see /openapi.json")

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await self.upstream.open()
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.upstream.close()
                await send({"type": "lifespan.shutdown.complete"})
                return

    # ---- generation ----------------------------------------------------------------------

    async def _generation(self, role: str, endpoint: str, scope, receive, send) -> tuple[int, str]:
        body = await read_body(scope, receive, self.config.max_body_bytes)
        payload = parse_object(body)
        request = validate(SCHEMAS[endpoint], payload)
        if endpoint == "generate" and request.messages is not None:
            return await self._judge(role, payload, scope, send)
        target = self._route(role, payload, scope)
        _check_token_ids(request, self.managers[role].vocab_size)
        if endpoint == "generate":
            routing = {k: payload.pop(k) for k in ROUTING_FIELDS if k in payload}
            forward = orjson.dumps(payload) if routing else body  # byte-faithful otherwise
        else:
            payload.pop("route_key", None)
            payload["model"] = target.served_model_name
            forward = orjson.dumps(payload)
        url = target.base_url + ENGINE_PATHS["/" + endpoint]
        headers = forwarded_headers(scope["headers"], target.routing_key)
        if request.stream:
            status = await self.upstream.stream(send, receive, url, forward, headers)
        else:
            status = await self.upstream.forward(send, url, forward, headers)
        return status, target.model_id

    def _route(self, role: str, payload: dict[str, Any], scope: dict[str, Any]) -> RouteTarget:
        affinity = header(scope, ROUTING_KEY_HEADER.encode())
        try:
            return self.resolver.resolve(
                self.managers[role].snapshot(),
                payload.get("model"),
                payload.get("route_key"),
                affinity,
            )
        except RoutingError as exc:
            retry = []
            if exc.status == 503:
                retry = [("retry-after", str(RETRY_AFTER_S)), (REFUSED_HEADER, "not-ready")]
            raise HttpError(exc.status, str(exc), retry) from None

    async def _judge(self, role: str, payload: dict[str, Any], scope, send) -> tuple[int, str]:
        """The legacy GenRM form: chat messages in, ``{"response": text}`` out."""
        render = self.renderers.get(role)
        if render is None:
            raise HttpError(400, f"/{role}/generate takes messages only on the genrm role")
        self._route(role, payload, scope)  # refuse before rendering when not ready
        kwargs = payload.get("chat_template_kwargs") or {}
        if not isinstance(kwargs, dict):
            raise HttpError(400, "chat_template_kwargs must be an object")
        try:
            prompt = await asyncio.wait_for(
                asyncio.to_thread(render, payload["messages"], kwargs),
                self.config.request_timeout_s,
            )
        except TimeoutError:
            raise HttpError(504, "rendering the judge prompt passed the request deadline") from None
        except Exception as exc:  # noqa: BLE001 - a template that cannot take these messages
            raise HttpError(
                400, f"the judge's chat template rejected the messages: {exc}"
            ) from None
        target = self._route(role, payload, scope)  # the model may have gone to sleep meanwhile
        sampling = {**JUDGE_SAMPLING, **(payload.get("sampling_params") or {})}
        body = orjson.dumps({"text": prompt, "sampling_params": sampling})
        reply = _Captured()
        status = await self.upstream.forward(
            reply,
            target.base_url + "/generate",
            body,
            forwarded_headers(scope["headers"], target.routing_key),
        )
        if status != 200:
            await send_bytes(send, status, reply.body, "application/json")
            return status, target.model_id
        try:
            text = orjson.loads(reply.body)["text"]
        except (orjson.JSONDecodeError, KeyError, TypeError):
            raise HttpError(
                502, f"the judge engine's reply has no text: {reply.body[:200]!r}"
            ) from None
        await send_json(send, 200, {"response": text.strip()})
        return 200, target.model_id

    # ---- discovery and health ------------------------------------------------------------

    async def _models(self, role: str, endpoint: str, scope, receive, send) -> tuple[int, str]:
        snapshot = self.managers[role].snapshot()
        ids = [*snapshot.models, *snapshot.routing.aliases]
        data = [{"id": i, "object": "model", "owned_by": "relax-launch"} for i in ids]
        await send_json(send, 200, {"object": "list", "data": data})
        return 200, "-"

    async def _engines(self, role: str, endpoint: str, scope, receive, send) -> tuple[int, str]:
        snapshot = self.managers[role].snapshot()
        await send_bytes(send, 200, snapshot.model_dump_json().encode(), "application/json")
        return 200, "-"

    async def _role_health(self, role: str, endpoint: str, scope, receive, send) -> tuple[int, str]:
        await send_json(send, 200, self._health_of(role))
        return 200, "-"

    def _health_of(self, role: str) -> dict[str, Any]:
        snapshot = self.managers[role].snapshot()
        models = {
            m: {"state": r.state.value, "ready": r.state.value == "READY"}
            for m, r in snapshot.models.items()
        }
        return {
            "schema_version": 2,
            "role": role,
            "gateway_alive": True,
            "registry_available": True,
            "ready": all(m["ready"] for m in models.values()),
            "models": models,
        }

    async def _health(self, role, endpoint, scope, receive, send) -> tuple[int, str]:
        roles = {r: self._health_of(r)["ready"] for r in self.managers}
        await send_json(send, 200, {"alive": True, "ready": all(roles.values()), "roles": roles})
        return 200, "-"

    async def _ready(self, role, endpoint, scope, receive, send) -> tuple[int, str]:
        roles = {r: self._health_of(r)["ready"] for r in self.managers}
        status = 200 if roles and all(roles.values()) else 503
        retry = [] if status == 200 else [("retry-after", str(RETRY_AFTER_S))]
        await send_json(send, status, {"ready": status == 200, "roles": roles}, retry)
        return status, "-"

    async def _metrics(self, role, endpoint, scope, receive, send) -> tuple[int, str]:
        text = self.metrics.render(self.managers).encode()
        await send_bytes(send, 200, text, "text/plain; version=0.0.4")
        return 200, "-"

    async def _openapi(self, role, endpoint, scope, receive, send) -> tuple[int, str]:
        await send_json(send, 200, openapi.document(sorted(self.managers)))
        return 200, "-"

    # ---- admin -----------------------------------------------------------------------------

    def _authorize(self, scope: dict[str, Any]) -> None:
        if self.admin_token is None:
            raise HttpError(
                401,
                f"admin routes are disabled: set ${self.config.admin_token_env} for the job",
                [("www-authenticate", "Bearer")],
            )
        given = header(scope, b"authorization") or ""
        if not hmac.compare_digest(given.encode(), f"Bearer {self.admin_token}".encode()):
            raise HttpError(
                401,
                "admin routes need 'Authorization: Bearer <token>'",
                [("www-authenticate", "Bearer")],
            )

    async def _admin_operation(
        self, role: str, endpoint: str, scope, receive, send
    ) -> tuple[int, str]:
        self._authorize(scope)
        body = await read_body(scope, receive, self.config.max_body_bytes)
        manager, op = self.managers[role], endpoint.removeprefix("admin/")
        if op == "drain":
            action = manager.drain
        else:
            tags = validate(MemoryTags, parse_object(body) if body else {}).tags
            action = lambda: getattr(manager, op)(tags)  # noqa: E731
        try:
            await asyncio.to_thread(action)
        except LifecycleError as exc:
            raise HttpError(409, str(exc)) from None
        await send_json(send, 200, {"role": role, "operation": op, **self._health_of(role)})
        return 200, "-"

    async def _admin_engines(
        self, role: str, endpoint: str, scope, receive, send
    ) -> tuple[int, str]:
        self._authorize(scope)
        manager = self.managers[role]
        engines = [
            {
                "engine_id": e.engine_id,
                "url": e.url,
                "loaded": sorted(e.loaded),
                "generation": e.generation,
                "recent_operations": list(e.history),
            }
            for e in manager.engines
        ]
        await send_json(send, 200, {"role": role, "state": manager.state.value, "engines": engines})
        return 200, "-"


def _check_token_ids(request: Any, vocab_size: int | None) -> None:
    """An out-of-vocabulary id would crash the engine's embedding lookup: refuse it here."""
    ids = getattr(request, "input_ids", None) or getattr(request, "prompt", None)
    if vocab_size is None or not isinstance(ids, list) or not ids or isinstance(ids[0], str):
        return
    rows = ids if isinstance(ids[0], list) else [ids]
    bad = next((t for row in rows for t in row if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise HttpError(400, f"token id {bad} is outside the vocabulary [0, {vocab_size})")


class _Captured:
    """An ASGI ``send`` that keeps the reply instead of sending it (for the judge adapter)."""

    def __init__(self) -> None:
        self.body = b""

    async def __call__(self, message: dict[str, Any]) -> None:
        self.body += message.get("body", b"")
