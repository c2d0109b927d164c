"""InferenceGateway: the job's HTTP front door, a FastAPI app served on rank 0 (see serve.py).

Per role (``/rollout``, ``/genrm``, ``/teacher``): ``POST /generate``, ``/v1/chat/completions``,
``/chat/completions``, ``/v1/completions``; ``GET /v1/models``, ``/engines`` (discovery, schema
2), ``/health``; token-guarded ``/admin/*`` and, on an elastic role, ``/scale_out`` and
``/scale_in`` (``scale_routes.py``). At the root: ``/health``, ``/ready``, ``/metrics``,
``/job``, ``/openapi.json`` (FastAPI's). Handlers stay thin: validate (400 before any engine),
route (``RouteResolver``), forward (``Upstream``). Every error is ``{"error": {...}}``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any

import orjson
from fastapi import FastAPI, HTTPException, Request, Response
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Message, Receive, Scope, Send

from relax_launch.inference import admin
from relax_launch.inference.config import GatewayConfig
from relax_launch.inference.disaggregation import (
    PairRequest,
    PrefillFailed,
    bootstrapped,
    with_input_logprobs,
)
from relax_launch.inference.discovery import Discovery
from relax_launch.inference.manager import InferenceManager
from relax_launch.inference.metrics import GatewayMetrics
from relax_launch.inference.openapi import error_responses, role_route_docs
from relax_launch.inference.proxy import Upstream, forwarded_headers
from relax_launch.inference.requests import (
    ChatRequest,
    CompletionRequest,
    GenerateRequest,
    JsonBodyRoute,
    vocabulary_problem,
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
from relax_launch.inference.scale_routes import ScaleRoutes

# Renders judge messages to a prompt with the GenRM model's chat template.
Renderer = Callable[[list[dict[str, Any]], dict[str, Any]], str]
JUDGE_SAMPLING = {"temperature": 0.0, "max_new_tokens": 256}
GENERATION_ERRORS = ("400", "413", "502", "503", "504")


class InferenceGateway:
    """Routes each role's requests to its engines; one instance serves every role.

    An ASGI app around the FastAPI app ``self.app``: it counts each request of a known route
    (``metrics.py``), and serves the routes with a JSON body (generation, the hot path) itself,
    by their own handler, without FastAPI's middleware stack and router (docs/gateway.md,
    "Performance").
    """

    def __init__(
        self,
        managers: dict[str, InferenceManager],
        *,
        config: GatewayConfig,
        admin_token: str | None,
        renderers: dict[str, Renderer] | None = None,
        run_dir: Path | None = None,
        request_timeout_s: float | None = None,
    ) -> None:
        self.managers, self.config, self.run_dir = managers, config, run_dir
        self.renderers = renderers or {}
        self.timeout_s = request_timeout_s or config.timeout_s()  # the job's, else auto's floor
        self.resolver, self.metrics = RouteResolver(), GatewayMetrics(managers)
        self.upstream = Upstream(self.timeout_s)
        self.app = FastAPI(
            title="relax-launch inference gateway",
            version="2",
            docs_url=None,  # Swagger UI and ReDoc load from a CDN; /openapi.json is the document
            redoc_url=None,
            lifespan=self._lifespan,
            exception_handlers={StarletteHTTPException: self._error_reply},
            redirect_slashes=False,  # "/rollout/generate/" is no route (404), not a redirect
        )
        # (method, path) -> (role, endpoint): the metrics labels of every route
        self.labels: dict[tuple[str, str], tuple[str, str]] = {}
        self.body_routes: dict[tuple[str, str], JsonBodyRoute] = {}
        self.admin = admin.AdminRoutes(managers, admin_token, config.admin_token_env)
        self.scaling = ScaleRoutes(self.admin.authorize)
        self._add_root_routes()
        for role in managers:
            self._add_role_routes(role)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        key = (scope.get("method"), scope.get("path"))
        labels = self.labels.get(key)
        if labels is None:  # lifespan, and requests no route takes (404, 405): not counted
            return await self.app(scope, receive, send)
        role, endpoint = labels
        body_route = self.body_routes.get(key)
        status = 500

        async def send_noting_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        started = time.perf_counter()
        self.metrics.started(role)
        try:
            if body_route is None:
                await self.app(scope, receive, send_noting_status)
            else:
                await self._serve(body_route, scope, receive, send_noting_status)
        finally:
            model = scope.get("state", {}).get("model", "-")
            self.metrics.finished(role, endpoint, model, status, time.perf_counter() - started)

    async def _serve(
        self, route: JsonBodyRoute, scope: Scope, receive: Receive, send: Send
    ) -> None:
        request = Request(scope, receive, send)
        try:
            response = await route.respond(request)
        except StarletteHTTPException as exc:
            response = await self._error_reply(request, exc)
        await response(scope, receive, send)

    @asynccontextmanager
    async def _lifespan(self, app: FastAPI) -> AsyncIterator[None]:
        await self.upstream.open()
        try:
            yield
        finally:
            await self.upstream.close()

    def _add(self, route: APIRoute, role: str | None) -> None:
        """``route`` in FastAPI's route table (and so in the document), and counted."""
        self.app.router.routes.append(route)
        (method,) = route.methods
        prefix = f"/{role}/" if role else "/"
        self.labels[(method, route.path)] = (role or "-", route.path.removeprefix(prefix))
        if isinstance(route, JsonBodyRoute):
            self.body_routes[(method, route.path)] = route

    def _add_root_routes(self) -> None:
        for path, endpoint, codes, ok in (
            ("/health", self._health, (), "Alive (even when no role is ready)"),
            ("/ready", self._ready, ("503",), "Every role is ready"),
            ("/metrics", self._metrics, (), "Prometheus text format"),
            ("/job", self._job, (), "The job's run directory and roles"),
        ):
            route = APIRoute(
                path,
                endpoint,
                methods=["GET"],
                name=path.strip("/"),
                responses=error_responses(*codes),
                response_description=ok,
            )
            self._add(route, None)
        self.labels[("GET", "/openapi.json")] = ("-", "openapi")  # FastAPI's own route

    def _add_role_routes(self, role: str) -> None:
        for name, endpoint in (
            ("generate", self._generate),
            ("v1/chat/completions", self._chat),
            ("chat/completions", self._chat),
            ("v1/completions", self._completion),
        ):
            bound = partial(endpoint, role)
            docs = role_route_docs(role, name, bound, *GENERATION_ERRORS)
            limit = self.config.max_body_bytes
            self._add(JsonBodyRoute(f"/{role}/{name}", bound, body_limit=limit, **docs), role)
        for name, endpoint, extra in (
            ("v1/models", self._models, {}),
            ("engines", self._engines, {"response_model": Discovery}),
            ("health", self._role_health, {}),
        ):
            bound = partial(endpoint, role)
            docs = role_route_docs(role, name, bound)
            self._add(APIRoute(f"/{role}/{name}", bound, methods=["GET"], **docs, **extra), role)
        for route in self.admin.routes(role, self.config.max_body_bytes):
            self._add(route, role)
        if self.managers[role].elastic:
            for route in self.scaling.routes(role, self.config.max_body_bytes):
                self._add(route, role)

    async def _error_reply(self, request: Request, exc: StarletteHTTPException) -> Response:
        """Every error in the gateway's envelope, Starlette's own 404 and 405 included."""
        message, path = exc.detail, request.url.path
        if exc.status_code == 404:  # only the router answers 404: no route took the path
            role = path.strip("/").split("/", 1)[0]
            message = f"no route {path}; see /openapi.json"
            if role in ("rollout", "genrm", "teacher") and role not in self.managers:
                message = f"this job has no {role} role (configured: {sorted(self.managers)})"
        elif exc.status_code == 405:
            message = f"{request.method} is not allowed on {path}"
        payload = {"error": {"message": message, "code": exc.status_code}}
        return JSONResponse(payload, exc.status_code, exc.headers)

    # ---- generation ----------------------------------------------------------------------

    async def _generate(self, role: str, request: Request, body: GenerateRequest) -> Response:
        """SGLang-native generation; on genrm, also the judge form (``messages``)."""
        if body.messages is not None:
            return await self._judge(role, request)
        return await self._forward(role, "/generate", request, body.stream, body.input_ids)

    async def _chat(self, role: str, request: Request, body: ChatRequest) -> Response:
        """OpenAI chat completions; ``stream`` for SSE."""
        return await self._forward(role, "/v1/chat/completions", request, body.stream, None)

    async def _completion(self, role: str, request: Request, body: CompletionRequest) -> Response:
        """OpenAI completions."""
        return await self._forward(role, "/v1/completions", request, body.stream, body.prompt)

    async def _forward(
        self, role: str, path: str, request: Request, stream: bool, token_ids: object
    ) -> Response:
        """To an engine of the role (or its router); ``token_ids`` are checked against the
        vocabulary first."""
        payload: dict[str, Any] = request.state.payload
        target = self._route(role, payload, request)
        routing = {k: payload[k] for k in ROUTING_FIELDS if k in payload}
        problem = vocabulary_problem(token_ids, self.managers[role].vocab_size)
        if problem is not None:
            raise HTTPException(400, problem)
        if path == "/generate":
            routing = {k: payload.pop(k) for k in ROUTING_FIELDS if k in payload}
            # byte-faithful unless a routing field has to go or a prefill half needs its address
            changed = routing or target.prefill is not None
            forward = orjson.dumps(payload) if changed else request.state.raw_body
        else:
            payload.pop("route_key", None)
            payload["model"] = target.served_model_name
            forward = orjson.dumps(payload)
        if target.prefill is not None:
            forward = orjson.dumps(bootstrapped(orjson.loads(forward), target.prefill))
        headers = forwarded_headers(request.headers.raw, target.routing_key)
        again = partial(self._route, role, routing, request)
        return await self._send(role, target, ENGINE_PATHS[path], forward, headers, again, stream)

    async def _send(
        self,
        role: str,
        target: RouteTarget,
        path: str,
        body: bytes,
        headers: dict[str, str],
        again: Callable[[], RouteTarget],
        stream: bool = False,
    ) -> Response:
        """``_send_once``, counted in flight to its engine (a scale-in waits for them); a whole
        request that failed as a scale-in stopped its engine goes where ``again`` routes."""
        manager = self.managers[role]
        while True:
            url = target.base_url + path
            try:
                with manager.requests.track(target.engine_id):
                    return await self._send_once(target, path, url, body, headers, stream)
            except HTTPException as exc:
                if exc.status_code != 502 or stream or not manager.was_retired(url):
                    raise
            target = again()

    async def _send_once(
        self, target: RouteTarget, path: str, url: str, body: bytes, headers: dict, stream: bool
    ) -> Response:
        """To the engine at ``url``, and to its prefill half alongside when it has one (a
        prefill failure answers for the pair, naming that engine)."""
        if target.prefill is None:
            if stream:
                return await self.upstream.stream(url, body, headers)
            return await self.upstream.forward(url, body, headers)
        pair = PairRequest(
            self.upstream.session, target.prefill, path, body, headers, self.timeout_s,
        )  # fmt: skip
        if stream:
            prefill = pair.prefill_until_failure()
            return await self.upstream.stream(url, body, headers, partner=prefill)
        try:
            reply, prefilled = await pair.alongside(self.upstream.forward(url, body, headers))
        except PrefillFailed as exc:
            raise HTTPException(exc.status, str(exc)) from None
        if reply.status_code != 200:
            return reply
        kept = {k: v for k, v in reply.headers.items() if k != "content-length"}
        return Response(with_input_logprobs(reply.body, prefilled, body), 200, kept)

    def _route(self, role: str, payload: dict[str, Any], request: Request) -> RouteTarget:
        try:
            target = self.resolver.resolve(
                self.managers[role].snapshot(),
                payload.get("model"),
                payload.get("route_key"),
                request.headers.get(ROUTING_KEY_HEADER),
            )
        except RoutingError as exc:
            retry = None
            if exc.status == 503:
                retry = {"retry-after": str(RETRY_AFTER_S), REFUSED_HEADER: "not-ready"}
            raise HTTPException(exc.status, str(exc), retry) from None
        request.state.model = target.model_id  # the metrics label
        return target

    async def _judge(self, role: str, request: Request) -> Response:
        """The legacy GenRM form: chat messages in, ``{"response": text}`` out."""
        payload: dict[str, Any] = request.state.payload
        render = self.renderers.get(role)
        if render is None:
            raise HTTPException(400, f"/{role}/generate takes messages only on the genrm role")
        self._route(role, payload, request)  # refuse before rendering when not ready
        kwargs = payload.get("chat_template_kwargs") or {}
        if not isinstance(kwargs, dict):
            raise HTTPException(400, "chat_template_kwargs must be an object")
        try:
            prompt = await asyncio.wait_for(
                asyncio.to_thread(render, payload["messages"], kwargs), self.timeout_s
            )
        except TimeoutError:
            why = "rendering the judge prompt passed the request deadline"
            raise HTTPException(504, why) from None
        except Exception as exc:  # noqa: BLE001 - a template that cannot take these messages
            raise HTTPException(
                400, f"the judge's chat template rejected the messages: {exc}"
            ) from None
        target = self._route(role, payload, request)  # the model may have gone to sleep meanwhile
        sampling = {**JUDGE_SAMPLING, **(payload.get("sampling_params") or {})}
        body = {"text": prompt, "sampling_params": sampling}
        if target.prefill is not None:
            body = bootstrapped(body, target.prefill)
        headers = forwarded_headers(request.headers.raw, target.routing_key)
        again = partial(self._route, role, payload, request)
        reply = await self._send(role, target, "/generate", orjson.dumps(body), headers, again)
        if reply.status_code != 200:
            return Response(reply.body, reply.status_code, media_type="application/json")
        try:
            text = orjson.loads(reply.body)["text"]
        except (orjson.JSONDecodeError, KeyError, TypeError):
            raise HTTPException(
                502, f"the judge engine's reply has no text: {reply.body[:200]!r}"
            ) from None
        return JSONResponse({"response": text.strip()})

    # ---- discovery and health ------------------------------------------------------------

    async def _models(self, role: str) -> Response:
        """The OpenAI model list: the model id and its aliases."""
        snapshot = self.managers[role].snapshot()
        ids = [*snapshot.models, *snapshot.routing.aliases]
        data = [{"id": i, "object": "model", "owned_by": "relax-launch"} for i in ids]
        return JSONResponse({"object": "list", "data": data})

    async def _engines(self, role: str) -> Response:
        """Discovery, schema 2."""
        snapshot = self.managers[role].snapshot()
        return Response(snapshot.model_dump_json(), media_type="application/json")

    async def _role_health(self, role: str) -> Response:
        """The role's models, their states and whether each is ready."""
        return JSONResponse(admin.health_of(role, self.managers[role]))

    async def _health(self) -> Response:
        """Liveness, and whether each role is ready."""
        roles = {r: admin.health_of(r, m)["ready"] for r, m in self.managers.items()}
        return JSONResponse({"alive": True, "ready": all(roles.values()), "roles": roles})

    async def _ready(self) -> Response:
        """200 when every role is ready, else 503."""
        roles = {r: admin.health_of(r, m)["ready"] for r, m in self.managers.items()}
        if roles and all(roles.values()):
            return JSONResponse({"ready": True, "roles": roles})
        retry = {"retry-after": str(RETRY_AFTER_S)}
        return JSONResponse({"ready": False, "roles": roles}, 503, retry)

    async def _job(self) -> Response:
        """Where the job writes its run directory (``relax-launch top URL`` reads it)."""
        run_dir = str(self.run_dir) if self.run_dir is not None else None
        return JSONResponse({"run_dir": run_dir, "roles": sorted(self.managers)})

    async def _metrics(self) -> Response:
        """Requests, latency and in-flight by role; model readiness and weight version."""
        return Response(self.metrics.render(), media_type=CONTENT_TYPE_LATEST)
