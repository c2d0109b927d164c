"""What the gateway's errors mean, for the OpenAPI document FastAPI generates from its routes."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from functools import partial
from typing import Any

from pydantic import BaseModel

ERRORS = {
    "400": "Malformed body, unknown model or route_key; no engine was contacted.",
    "401": "Admin route without a valid bearer token.",
    "404": "No scale operation of this role has that request id.",
    "409": "A lifecycle operation failed; the model stays unavailable until an onload succeeds. "
    "Scale routes: an operation is in flight for the role, the role is not serving (starting, "
    "FAILED), or it has that many engines already.",
    "413": "Body above gateway.max_body_bytes.",
    "422": "A body field of the wrong type, or a field the route does not take.",
    "502": "The engine could not be reached, or answered with something that is not HTTP.",
    "503": "Model not ready (starting, syncing weights, draining, sleeping); see Retry-After.",
    "504": "The engine did not answer within gateway.request_timeout_s.",
}


class ErrorDetail(BaseModel):
    message: str
    code: int


class ErrorReply(BaseModel):
    """The body of every error the gateway itself answers."""

    error: ErrorDetail


def error_responses(*codes: str) -> dict[int | str, dict[str, Any]]:
    """The ``responses`` of a route that answers ``codes``; ``default`` stands for the rest (an
    engine's own error passes through), and keeps FastAPI from documenting a 422 it never sends."""
    out: dict[int | str, dict[str, Any]] = {
        code: {"model": ErrorReply, "description": ERRORS[code]} for code in codes
    }
    out["default"] = {
        "model": ErrorReply,
        "description": "Any other error: 404 (no such route or role), 405; on generation routes "
        "an engine's own error passes through with its status and body.",
    }
    return out


def role_route_docs(role: str, name: str, endpoint: partial, *codes: str) -> dict[str, Any]:
    """``name``, ``description`` and ``responses`` of route ``/{role}/{name}``, served by
    ``endpoint`` (a method with the role bound, whose docstring FastAPI cannot see)."""
    method: Callable = endpoint.func
    return {
        "name": f"{role} {name}",
        "description": inspect.getdoc(method),
        "responses": error_responses(*codes),
    }
