"""The gateway's OpenAPI document is generated (FastAPI, from the routes and the request models
their endpoints declare), so it cannot drift from what the gateway validates."""

from __future__ import annotations

import httpx
import pytest
from conftest import make_manager, serve
from pydantic import Field

from relax_launch.inference import generation_routes
from relax_launch.inference.requests import (
    ChatRequest,
    CompletionRequest,
    GenerateRequest,
    MemoryTags,
)

BODIES = {
    "generate": GenerateRequest,
    "v1/chat/completions": ChatRequest,
    "chat/completions": ChatRequest,
    "v1/completions": CompletionRequest,
    "admin/offload": MemoryTags,
    "admin/onload": MemoryTags,
}


def request_schema(document: dict, path: str) -> dict:
    """The components schema a POST operation's JSON body refers to."""
    body = document["paths"][path]["post"]["requestBody"]["content"]["application/json"]
    return document["components"]["schemas"][body["schema"]["$ref"].rsplit("/", 1)[1]]


@pytest.fixture
def gateway_url(upstream):
    managers = {role: make_manager(role, [f"{upstream.url}/e0"]) for role in ("rollout", "genrm")}
    with serve(managers) as url:
        yield url


def test_every_body_schema_is_its_request_model(gateway_url):
    document = httpx.get(f"{gateway_url}/openapi.json").json()
    for role in ("rollout", "genrm"):
        for name, model in BODIES.items():
            schema = request_schema(document, f"/{role}/{name}")
            assert schema["title"] == model.__name__
            assert schema["properties"].keys() == model.model_json_schema()["properties"].keys()
    assert "/teacher/generate" not in document["paths"]  # only the job's roles
    assert "422" not in str(document)  # the gateway answers 400, never FastAPI's 422


def test_a_field_added_to_a_request_model_appears_and_is_validated(upstream, monkeypatch):
    class WithPriority(GenerateRequest):
        priority: int = Field(0, ge=0, le=9, description="Scheduling priority.")

    monkeypatch.setattr(generation_routes, "GenerateRequest", WithPriority)
    with serve({"teacher": make_manager("teacher", [f"{upstream.url}/e0"])}) as url:
        document = httpx.get(f"{url}/openapi.json").json()
        refused = httpx.post(f"{url}/teacher/generate", json={"text": "hi", "priority": 10})
    field = request_schema(document, "/teacher/generate")["properties"]["priority"]
    assert field["description"] == "Scheduling priority." and field["maximum"] == 9
    assert refused.status_code == 400 and "priority" in refused.json()["error"]["message"]
    assert upstream.requests == []
