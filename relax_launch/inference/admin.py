"""The gateway's token-guarded admin routes of a role (engines, drain, offload, onload) and the
health document of a role."""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import Callable
from functools import partial
from typing import Any

from fastapi import Depends, HTTPException, Request, Response
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute

from relax_launch.inference.manager import InferenceManager, LifecycleError
from relax_launch.inference.openapi import role_route_docs
from relax_launch.inference.requests import JsonBodyRoute, MemoryTags


def health_of(role: str, manager: InferenceManager) -> dict[str, Any]:
    snapshot = manager.snapshot()
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


class AdminRoutes:
    """Every admin route first checks ``Authorization: Bearer <token>`` (401 otherwise, and
    always when the job has no token)."""

    def __init__(
        self, managers: dict[str, InferenceManager], token: str | None, token_env: str
    ) -> None:
        self.managers, self.token, self.token_env = managers, token, token_env
        # split/defer: the coordinator's lease state; it alone moves the roles' memory
        self.leases: Callable[[], dict[str, dict[str, Any]]] | None = None
        # elastic roles: every engine of the plan (reserved ones too) and its state, and the
        # scale operation in flight
        self.scaling: Callable[[str], dict[str, Any]] | None = None

    def authorize(self, request: Request) -> None:
        if self.token is None:
            raise HTTPException(
                401,
                f"admin routes are disabled: set ${self.token_env} for the job",
                {"www-authenticate": "Bearer"},
            )
        given = request.headers.get("authorization") or ""
        if not hmac.compare_digest(given.encode(), f"Bearer {self.token}".encode()):
            raise HTTPException(
                401,
                "admin routes need 'Authorization: Bearer <token>'",
                {"www-authenticate": "Bearer"},
            )

    def routes(self, role: str, body_limit: int) -> list[APIRoute]:
        """The admin routes of ``role``."""
        guard = [Depends(self.authorize)]
        out = [
            ("GET", "admin/engines", self.engines, ("401",)),
            ("POST", "admin/drain", self.drain, ("401", "409")),
        ]
        routes = []
        for method, name, endpoint, codes in out:
            bound = partial(endpoint, role)
            docs = role_route_docs(role, name, bound, *codes)
            route = APIRoute(f"/{role}/{name}", bound, methods=[method], dependencies=guard, **docs)
            routes.append(route)
        for op in ("offload", "onload"):
            bound, name = partial(self.memory, role, op), f"admin/{op}"
            docs = role_route_docs(role, name, bound, "400", "401", "409", "413")
            route = JsonBodyRoute(
                f"/{role}/{name}", bound, body_limit=body_limit, guard=self.authorize, **docs
            )
            routes.append(route)
        return routes

    async def engines(self, role: str) -> Response:
        """Engine URLs, loaded memory tags, recent control operations; for an elastic role,
        every engine of the plan (``replicas``: reserved ones too) and its state, and the scale
        operation in flight (``operation``)."""
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
        document = {"role": role, "state": manager.state.value, "engines": engines}
        if self.leases is not None:
            document["lease"] = self.leases().get(role)
        if self.scaling is not None and manager.elastic:
            document |= self.scaling(role)
        return JSONResponse(document)

    async def drain(self, role: str) -> Response:
        """Pause generation, abort, flush until idle."""
        return await self._run(role, "drain", self.managers[role].drain)

    async def memory(self, role: str, op: str, request: Request, body: MemoryTags) -> Response:
        """offload: drain, then release memory tags; onload: resume the missing tags and reopen
        generation once all are back."""
        action = getattr(self.managers[role], op)
        return await self._run(role, op, partial(action, body.tags))

    async def _run(self, role: str, op: str, action: Any) -> Response:
        if self.leases is not None:
            raise HTTPException(
                409,
                f"{op} refused: this job's lifecycle coordinator moves {role}'s memory between "
                "phases (placement.mode split/defer); an admin operation would break its leases",
            )
        try:
            await asyncio.to_thread(action)
        except LifecycleError as exc:
            raise HTTPException(409, str(exc)) from None
        health = health_of(role, self.managers[role])
        return JSONResponse({"role": role, "operation": op, **health})
