"""Request bodies the gateway accepts, read and validated before any engine is touched.

FastAPI generates the gateway's OpenAPI document from these models: each ``JsonBodyRoute``
declares one. Generation fields SGLang knows beyond these pass through untouched
(``extra="allow"``); sampling parameters are checked strictly, since SGLang would fail on them
only after admission.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Awaitable, Callable
from typing import Annotated, Any, Literal

import orjson
from fastapi import HTTPException, Request, Response
from fastapi.routing import APIRoute
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from starlette.requests import ClientDisconnect

# Never empty: SGLang's CPU engine crashes (and stays down) on a prompt of zero tokens.
NonEmpty = Annotated[str, Field(min_length=1)]
Ids = Annotated[list[int], Field(min_length=1)]
Text = NonEmpty | Annotated[list[NonEmpty], Field(min_length=1)]
TokenIds = Ids | Annotated[list[Ids], Field(min_length=1)]
Stop = str | list[str]


class SamplingParams(BaseModel):
    """SGLang's sampling parameters (the commonly used subset, strictly typed)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    max_new_tokens: int | None = Field(None, ge=0)
    min_new_tokens: int = Field(0, ge=0)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(-1, ge=-1)
    min_p: float = Field(0.0, ge=0, le=1)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    repetition_penalty: float = Field(1.0, gt=0, le=2)
    n: int = Field(1, ge=1, le=64)
    stop: Stop | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    sampling_seed: int | None = None
    regex: str | None = Field(None, min_length=1)  # constrained decoding (grammar backend)

    @field_validator("regex")
    @classmethod
    def _regex_compiles(cls, regex: str | None) -> str | None:
        if regex is not None:
            try:
                re.compile(regex)
            except re.error as exc:
                raise ValueError(f"not a regular expression: {exc}") from None
        return regex


class Routed(BaseModel):
    # strict: JSON types as sent ("yes" is not a boolean, "3" not an integer)
    model_config = ConfigDict(extra="allow", strict=True)

    model: str | None = Field(None, min_length=1, description="Model id or alias.")
    route_key: str | None = Field(None, min_length=1, description="A key of routing.route_key_map.")
    stream: bool = False


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None


class GenerateRequest(Routed):
    """SGLang-native ``/generate``: ``text`` or ``input_ids``; ``messages`` only for the judge."""

    text: Text | None = None
    input_ids: TokenIds | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    sampling_params: SamplingParams | None = None
    return_logprob: bool | None = None
    logprob_start_len: int | None = Field(None, ge=-1)
    top_logprobs_num: int | None = Field(None, ge=0, le=20)

    @model_validator(mode="after")
    def _one_input(self) -> GenerateRequest:
        given = [k for k in ("text", "input_ids", "messages") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(
                f"give exactly one of text, input_ids, messages (got {given or 'none'})"
            )
        if self.messages is not None and self.stream:
            raise ValueError("the messages (judge) form of /generate does not stream")
        return self


class ChatRequest(Routed):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    n: int | None = Field(None, ge=1, le=64)
    stop: Stop | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    seed: int | None = None


class CompletionRequest(Routed):
    prompt: Text | Ids
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    n: int | None = Field(None, ge=1, le=64)
    stop: Stop | None = None
    logprobs: int | None = Field(None, ge=0, le=5)
    seed: int | None = None


class MemoryTags(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    tags: list[Literal["weights", "kv_cache", "cuda_graph"]] = Field(
        default=["weights", "kv_cache", "cuda_graph"], min_length=1
    )


def validate(model: type[BaseModel], payload: dict[str, Any], status: int = 400) -> BaseModel:
    """``model`` parsed from ``payload``, or an error (``status``) naming the first bad field."""
    try:
        return model.model_validate(payload)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "body"
        raise HTTPException(status, f"{where}: {first['msg']}") from None


async def read_body(request: Request, limit: int) -> bytes:
    """The whole request body; 413 as soon as it is known to exceed ``limit`` bytes."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise HTTPException(413, f"request body of {declared} bytes exceeds the {limit}-byte limit")
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise HTTPException(413, f"request body exceeds the {limit}-byte limit")
            chunks.append(chunk)
    except ClientDisconnect:
        raise HTTPException(499, "client disconnected") from None
    return b"".join(chunks)


def parse_object(body: bytes) -> dict[str, Any]:
    """The body as a JSON object (an empty body is ``{}``), whatever its Content-Type says."""
    if not body:
        return {}
    try:
        payload = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise HTTPException(400, f"request body is not valid JSON: {exc}") from None
    if not isinstance(payload, dict):
        raise HTTPException(400, "request body must be a JSON object")
    return payload


Guard = Callable[[Request], None]


class JsonBodyRoute(APIRoute):
    """A POST route that reads and validates its JSON body the gateway's way, then calls
    ``endpoint(request, body)``; FastAPI documents the body from the endpoint's ``body``
    annotation, as for any route.

    Not FastAPI's request handler, for two reasons: the gateway's contract (a body read only up to
    ``body_limit`` bytes, JSON whatever the Content-Type says, as ``curl -d`` sends a form type,
    and a 400 naming the first bad field), and cost on the generation path (FastAPI's dependency
    solving and body parsing would more than double the gateway's own CPU per request;
    docs/gateway.md, "Performance"). ``guard`` (the admin token check) runs before the body is
    read. The raw body and its parsed object stay on ``request.state`` (``raw_body``,
    ``payload``) for byte-faithful forwarding.
    """

    def __init__(
        self,
        path: str,
        endpoint: Callable[..., Awaitable[Response]],
        *,
        body_limit: int,
        guard: Guard | None = None,
        invalid_status: int = 400,
        **kwargs: Any,
    ) -> None:
        self.body_limit, self.guard, self.invalid_status = body_limit, guard, invalid_status
        self.body_model = inspect.signature(endpoint, eval_str=True).parameters["body"].annotation
        super().__init__(path, endpoint, methods=["POST"], **kwargs)

    def get_route_handler(self) -> Callable[[Request], Awaitable[Response]]:
        return self.respond

    async def respond(self, request: Request) -> Response:
        """The endpoint's reply; an HTTPException for a refused request."""
        if self.guard is not None:
            self.guard(request)
        raw = await read_body(request, self.body_limit)
        payload = parse_object(raw)
        body = validate(self.body_model, payload, self.invalid_status)
        request.state.raw_body, request.state.payload = raw, payload
        return await self.endpoint(request, body)


def vocabulary_problem(ids: object, vocab_size: int | None) -> str | None:
    """Why token ``ids`` (one list or a batch of lists) must be refused: an out-of-vocabulary
    id would crash the engine's embedding lookup. The gateway and the in-process client ask."""
    if vocab_size is None or not isinstance(ids, list) or not ids or isinstance(ids[0], str):
        return None
    rows = ids if isinstance(ids[0], list) else [ids]
    bad = next(
        (t for row in rows for t in row if not (isinstance(t, int) and 0 <= t < vocab_size)), None
    )
    return None if bad is None else f"token id {bad} is outside the vocabulary [0, {vocab_size})"
