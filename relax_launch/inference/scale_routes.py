"""The gateway's scale routes of an elastic role (``max_engines``), behind the admin token.

``POST /{role}/scale_out`` and ``POST /{role}/scale_in`` take ``{"num_replicas": N}`` (the
total wanted, not a delta; optional ``model``, ``timeout_secs``) and answer 202 with the
operation's ``request_id``; ``GET /{role}/scale_out/{request_id}`` and
``GET /{role}/scale_in/{request_id}`` report its progress, the role's engines serving
(``actual``) and each engine's outcome; ``GET /{role}/scale_out`` and ``GET /{role}/scale_in``
list the role's operations, newest first; ``POST /{role}/scale_out/{request_id}/cancel`` stops
a scale-out in flight (202; the engines it started are stopped, the count returns). Errors: a
field of the wrong type 422; a count outside the planned engines to ``max_engines``, the wrong
direction or an unknown model 400; an operation in flight for the role, a role not serving
(starting, FAILED), a count it has already, a cancel of an operation that ended or whose engines
already serve (its point of no return: docs/gateway.md) 409; an unknown id 404. Rank 0's
``EngineScaler`` (``runtime/scaling.py``) does the work.
"""

from __future__ import annotations

import asyncio
from functools import partial
from typing import Any, Protocol

from fastapi import Depends, HTTPException, Request, Response
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from pydantic import BaseModel, ConfigDict, Field

from relax_launch.inference.openapi import role_route_docs
from relax_launch.inference.requests import Guard, JsonBodyRoute

KINDS = ("scale_out", "scale_in")


class ScaleRefused(Exception):
    """A scale request that cannot be taken; ``status`` is the HTTP status it answers."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class ScaleRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    num_replicas: int = Field(description="The role's engines wanted in total (not a delta).")
    model: str | None = Field(None, min_length=1, description="The role's model id or alias.")
    timeout_secs: float | None = Field(
        None,
        description="Bound of the whole operation: a scale-out's start (and, for rollout, the "
        "weight sync that takes the engine in), a scale-in's drain. Default: "
        "cluster.startup_timeout_s (twice that for rollout) out, gateway.request_timeout_s in.",
    )


class Operation(Protocol):
    request_id: str
    role: str

    def document(self, actual: int) -> dict[str, Any]: ...


class Scaler(Protocol):
    """What the routes need of rank 0's ``EngineScaler``."""

    def request(
        self, role: str, kind: str, target: int, *, model: str | None, timeout_s: float | None
    ) -> Operation: ...

    def get(self, role: str, kind: str, request_id: str) -> Operation | None: ...

    def listed(self, role: str, kind: str) -> list[Operation]: ...

    def cancel(self, role: str, request_id: str) -> Operation: ...

    def actual(self, role: str) -> int: ...


class ScaleRoutes:
    """The routes; ``scaler`` is set once the job's session exists (409 before)."""

    def __init__(self, guard: Guard) -> None:
        self.guard = guard
        self.scaler: Scaler | None = None

    def routes(self, role: str, body_limit: int) -> list[APIRoute]:
        guard = [Depends(self.guard)]
        routes: list[APIRoute] = []
        for kind in KINDS:
            bound = partial(self.scale, kind, role)
            docs = role_route_docs(role, kind, bound, "400", "401", "409", "413", "422")
            routes.append(
                JsonBodyRoute(
                    f"/{role}/{kind}",
                    bound,
                    body_limit=body_limit,
                    guard=self.guard,
                    invalid_status=422,
                    status_code=202,
                    **docs,
                )
            )
            bound = partial(self.listing, kind, role)
            docs = role_route_docs(role, f"{kind} (list)", bound, "401")
            routes.append(
                APIRoute(f"/{role}/{kind}", bound, methods=["GET"], dependencies=guard, **docs)
            )
            bound = partial(self.status, kind, role)
            docs = role_route_docs(role, f"{kind}/{{request_id}}", bound, "401", "404")
            path = f"/{role}/{kind}/{{request_id}}"
            routes.append(APIRoute(path, bound, methods=["GET"], dependencies=guard, **docs))
        bound = partial(self.cancel, role)
        docs = role_route_docs(role, "scale_out/{request_id}/cancel", bound, "401", "404", "409")
        path = f"/{role}/scale_out/{{request_id}}/cancel"
        routes.append(
            APIRoute(path, bound, methods=["POST"], dependencies=guard, status_code=202, **docs)
        )
        return routes

    async def scale(self, kind: str, role: str, request: Request, body: ScaleRequest) -> Response:
        """Start or stop engines of the role until it has ``num_replicas``; answers 202 with
        the operation (its ``request_id`` names it on the status route)."""
        scaler = self._scaler()
        try:
            op = await asyncio.to_thread(
                scaler.request,
                role,
                kind,
                body.num_replicas,
                model=body.model,
                timeout_s=body.timeout_secs,
            )
        except ScaleRefused as exc:
            raise HTTPException(exc.status, str(exc)) from None
        location = {"location": f"/{role}/{kind}/{op.request_id}"}
        return JSONResponse(op.document(scaler.actual(role)), 202, location)

    async def status(self, kind: str, role: str, request_id: str) -> Response:
        """The operation's state, the role's engines serving now and each engine's outcome."""
        scaler = self._scaler()
        op = scaler.get(role, kind, request_id)
        if op is None:
            raise HTTPException(404, f"{role} has no {kind} operation {request_id!r}")
        return JSONResponse(op.document(scaler.actual(role)))

    async def listing(self, kind: str, role: str) -> Response:
        """The role's operations of this kind kept by rank 0, newest first."""
        scaler = self._scaler()
        actual = scaler.actual(role)
        documents = [op.document(actual) for op in scaler.listed(role, kind)]
        return JSONResponse({"role": role, "operation": kind, "operations": documents})

    async def cancel(self, role: str, request_id: str) -> Response:
        """Stop a scale-out in flight: 202 with the operation, ``cancelling`` until the engines
        it started are stopped (then always ``cancelled``); 409 once its engines serve."""
        scaler = self._scaler()
        try:
            op = scaler.cancel(role, request_id)
        except ScaleRefused as exc:
            raise HTTPException(exc.status, str(exc)) from None
        location = {"location": f"/{role}/scale_out/{request_id}"}
        return JSONResponse(op.document(scaler.actual(role)), 202, location)

    def _scaler(self) -> Scaler:
        if self.scaler is None:
            raise HTTPException(409, "the job is still starting: scale once it serves")
        return self.scaler
