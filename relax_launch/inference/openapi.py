"""The gateway's OpenAPI 3.1 document, built from the request models in requests.py."""

from __future__ import annotations

from functools import cache
from typing import Any

from pydantic.json_schema import models_json_schema

from relax_launch.inference.requests import (
    ChatRequest,
    CompletionRequest,
    GenerateRequest,
    MemoryTags,
)

ERRORS = {
    "400": "Malformed body, unknown model or route_key; no engine was contacted.",
    "401": "Admin route without a valid bearer token.",
    "404": "No such route, or this job has no such role.",
    "409": "A lifecycle operation failed; the model stays unavailable until an onload succeeds.",
    "413": "Body above gateway.max_body_bytes.",
    "502": "The engine could not be reached, or answered with something that is not HTTP.",
    "503": "Model not ready (starting, syncing weights, draining, sleeping); see Retry-After.",
    "504": "The engine did not answer within gateway.request_timeout_s.",
}


def _responses(*codes: str, ok: str = "OK") -> dict[str, Any]:
    out: dict[str, Any] = {"200": {"description": ok}}
    for code in codes:
        out[code] = {
            "description": ERRORS[code],
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}},
        }
    return out


def _body(model: str) -> dict[str, Any]:
    schema = {"$ref": f"#/components/schemas/{model}"}
    return {"required": True, "content": {"application/json": {"schema": schema}}}


@cache
def _components() -> dict[str, Any]:
    _, schema = models_json_schema(
        [(m, "validation") for m in (GenerateRequest, ChatRequest, CompletionRequest, MemoryTags)],
        ref_template="#/components/schemas/{model}",
    )
    schemas = schema["$defs"]
    schemas["Error"] = {
        "type": "object",
        "properties": {
            "error": {
                "type": "object",
                "properties": {"message": {"type": "string"}, "code": {"type": "integer"}},
            }
        },
    }
    return schemas


def _role_paths(role: str) -> dict[str, Any]:
    generation = ("400", "413", "502", "503", "504")
    paths: dict[str, Any] = {
        f"/{role}/generate": {
            "post": {"requestBody": _body("GenerateRequest"), "responses": _responses(*generation)}
        },
        f"/{role}/v1/chat/completions": {
            "post": {"requestBody": _body("ChatRequest"), "responses": _responses(*generation)}
        },
        f"/{role}/chat/completions": {
            "post": {"requestBody": _body("ChatRequest"), "responses": _responses(*generation)}
        },
        f"/{role}/v1/completions": {
            "post": {
                "requestBody": _body("CompletionRequest"),
                "responses": _responses(*generation),
            }
        },
        f"/{role}/v1/models": {"get": {"responses": _responses()}},
        f"/{role}/engines": {"get": {"responses": _responses(ok="Discovery, schema 2")}},
        f"/{role}/health": {"get": {"responses": _responses()}},
        f"/{role}/admin/engines": {"get": {"responses": _responses("401")}},
        f"/{role}/admin/drain": {"post": {"responses": _responses("401", "409")}},
    }
    for op in ("offload", "onload"):
        paths[f"/{role}/admin/{op}"] = {
            "post": {
                "requestBody": _body("MemoryTags"),
                "responses": _responses("400", "401", "409"),
            }
        }
    return paths


def document(roles: list[str]) -> dict[str, Any]:
    paths: dict[str, Any] = {
        "/health": {"get": {"responses": _responses(ok="Alive (even when no role is ready)")}},
        "/ready": {"get": {"responses": _responses("503", ok="Every role is ready")}},
        "/metrics": {"get": {"responses": _responses(ok="Prometheus text format")}},
    }
    for role in roles:
        paths.update(_role_paths(role))
    return {
        "openapi": "3.1.0",
        "info": {"title": "relax-launch inference gateway", "version": "2"},
        "paths": paths,
        "components": {"schemas": _components()},
    }
