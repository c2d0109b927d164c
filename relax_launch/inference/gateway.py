"""InferenceGateway: the job's HTTP front door, a FastAPI app served on rank 0 (see serve.py).

Per role (``/rollout``, ``/genrm``, ``/teacher``): ``POST /generate``, ``/v1/chat/completions``,
``/chat/completions``, ``/v1/completions``; ``GET /v1/models``, ``/engines`` (discovery, schema
2), ``/health``; token-guarded ``/admin/*`` and, on an elastic role, ``/scale_out`` and
``/scale_in`` (``scale_routes.py``). At the root: ``/health``, ``/ready``, ``/metrics``,
``/job``, ``/engines`` (every role's discovery and the spare pool), ``/openapi.json``
(FastAPI's). The generation routes' handlers are ``generation_routes.py``'s. Every error is
``{"error": {...}}``.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Message, Receive, Scope, Send

from relax_launch.inference import admin
from relax_launch.inference.config import GatewayConfig
from relax_launch.inference.discovery import Discovery, PoolRecord
from relax_launch.inference.generation_routes import GENERATION_ERRORS, GenerationRoutes, Renderer
from relax_launch.inference.images import ImagePolicy
from relax_launch.inference.manager import InferenceManager
from relax_launch.inference.metrics import GatewayMetrics
from relax_launch.inference.openapi import error_responses, role_route_docs
from relax_launch.inference.requests import JsonBodyRoute
from relax_launch.inference.routing import RETRY_AFTER_S
from relax_launch.inference.scale_routes import ScaleRoutes

JSON = "application/json"


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
        timeout_s = request_timeout_s or config.timeout_s()  # the job's, else auto's floor
        images = ImagePolicy(config.images)
        self.generation = GenerationRoutes(managers, renderers or {}, timeout_s, images)
        self.metrics = GatewayMetrics(managers)
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
        self.pool: Callable[[], PoolRecord | None] | None = None  # set with the scaler
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
        await self.generation.upstream.open()
        try:
            yield
        finally:
            await self.generation.upstream.close()

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
            ("/engines", self._all_engines, (), "Every role's discovery and the spare pool"),
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
            ("generate", self.generation.generate),
            ("v1/chat/completions", self.generation.chat),
            ("chat/completions", self.generation.chat),
            ("v1/completions", self.generation.completion),
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

    # ---- discovery and health ------------------------------------------------------------

    async def _models(self, role: str) -> Response:
        """The OpenAI model list: the model id and its aliases."""
        snapshot = self.managers[role].snapshot()
        ids = [*snapshot.models, *snapshot.routing.aliases]
        data = [{"id": i, "object": "model", "owned_by": "relax-launch"} for i in ids]
        return JSONResponse({"object": "list", "data": data})

    async def _engines(self, role: str) -> Response:
        """Discovery, schema 2; on a role that may start engines on the shared spare pool, the
        pool's ranks and which role's engine holds them."""
        pool = self.pool() if self.pool is not None else None
        return Response(self._discovery(role, pool).model_dump_json(), media_type=JSON)

    async def _all_engines(self) -> Response:
        """Every role's discovery, and the shared spare pool (null: the job has none)."""
        pool = self.pool() if self.pool is not None else None
        roles = {r: self._discovery(r, pool).model_dump(mode="json") for r in self.managers}
        shared = pool.model_dump(mode="json") if pool is not None else None
        return JSONResponse({"roles": roles, "pool": shared})

    def _discovery(self, role: str, pool: PoolRecord | None) -> Discovery:
        """The role's snapshot, with the pool (rank 0's scaler's) where the role may use it."""
        snapshot = self.managers[role].snapshot()
        if pool is not None and role in pool.roles:
            snapshot = snapshot.model_copy(update={"pool": pool})
        return snapshot

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
