"""The generation routes of every role, which the gateway serves (``gateway.py``): SGLang's
native ``/generate`` (on genrm also the judge form, chat messages in and ``{"response": text}``
out), OpenAI chat completions and completions. Each request is validated (400 before any
engine), routed (``RouteResolver``) and forwarded (``Upstream``) to an engine of the role, and to
its prefill half alongside when it has one; a whole request a scale-in cut off goes again.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from functools import partial
from typing import Any

import orjson
from fastapi import HTTPException, Request, Response
from fastapi.responses import JSONResponse

from relax_launch.inference.disaggregation import (
    PairRequest,
    PrefillFailed,
    bootstrapped,
    with_input_logprobs,
)
from relax_launch.inference.images import (
    ImagePolicy,
    ImageRefused,
    has_images,
    image_urls,
    text_placeholders_problem,
)
from relax_launch.inference.manager import InferenceManager
from relax_launch.inference.proxy import Upstream, forwarded_headers
from relax_launch.inference.requests import (
    ChatRequest,
    CompletionRequest,
    GenerateRequest,
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
    select_model,
)

# Renders judge messages to a prompt with the GenRM model's chat template.
Renderer = Callable[[list[dict[str, Any]], dict[str, Any]], str]


def renderer_for(renderers: dict[str, Renderer], role: str, model_id: str) -> Renderer | None:
    """The judge form's renderer for ``model_id`` of ``role``: the model's own (key
    ``role/model_id``, a role with several models), else the role's."""
    return renderers.get(f"{role}/{model_id}") or renderers.get(role)


JUDGE_SAMPLING = {"temperature": 0.0, "max_new_tokens": 256}
GENERATION_ERRORS = ("400", "413", "502", "503", "504")


async def checked_images(
    policy: ImagePolicy,
    manager: InferenceManager,
    payload: dict[str, Any],
    model_id: str | None = None,
) -> dict[str, Any] | None:
    """``payload`` with its images checked and sent as data (``images.py``), or None when it
    has none; ``model_id`` (default: the one the payload selects, ``RoutingError`` if none) must
    take images. The check (PIL decodes each image) runs off the event loop. A non-streaming chat
    with images answers with the prompt's token ids as the engine saw them (image placeholders
    included), unless the request says otherwise."""
    if not has_images(payload):
        return None
    if model_id is None:
        model_id = select_model(manager.snapshot(), payload.get("model"), payload.get("route_key"))
    image_token = manager.image_token_of(model_id)
    checked = await asyncio.to_thread(policy.checked, payload, model_id, image_token)
    if checked.get("messages") is not None and not checked.get("stream"):
        checked.setdefault("return_prompt_token_ids", True)
    return checked


class GenerationRoutes:
    """The handlers of the generation routes; each takes the role first (``partial``).
    ``timeout_s``: every request's deadline at its engine; ``images``: what images requests
    may carry."""

    def __init__(
        self,
        managers: dict[str, InferenceManager],
        renderers: dict[str, Renderer],
        timeout_s: float,
        images: ImagePolicy | None = None,
    ) -> None:
        self.managers, self.renderers, self.timeout_s = managers, renderers, timeout_s
        self.images = images or ImagePolicy()
        self.resolver, self.upstream = RouteResolver(), Upstream(timeout_s)

    async def generate(self, role: str, request: Request, body: GenerateRequest) -> Response:
        """SGLang-native generation; on genrm, also the judge form (``messages``)."""
        if body.messages is not None:
            return await self._judge(role, request)
        return await self._forward(role, "/generate", request, body.stream, body.input_ids)

    async def chat(self, role: str, request: Request, body: ChatRequest) -> Response:
        """OpenAI chat completions; ``stream`` for SSE."""
        return await self._forward(role, "/v1/chat/completions", request, body.stream, None)

    async def completion(self, role: str, request: Request, body: CompletionRequest) -> Response:
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
        problem = vocabulary_problem(token_ids, self.managers[role].vocab_of(target.model_id))
        if problem is not None:
            raise HTTPException(400, problem)
        imaged = await self._images(role, target.model_id, payload)
        payload = payload if imaged is None else imaged
        if path == "/generate":
            routing = {k: payload.pop(k) for k in ROUTING_FIELDS if k in payload}
            # byte-faithful unless a routing field has to go, images were read or checked, or
            # a prefill half needs its address
            changed = routing or imaged is not None or target.prefill is not None
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
        session = self.upstream.session
        pair = PairRequest(session, target.prefill, path, body, headers, self.timeout_s)
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

    async def _images(
        self, role: str, model_id: str, payload: dict[str, Any]
    ) -> dict[str, Any] | None:
        """``checked_images``; a refused image is a 400."""
        try:
            return await checked_images(self.images, self.managers[role], payload, model_id)
        except ImageRefused as exc:
            raise HTTPException(exc.status, str(exc)) from None

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
        if role not in self.renderers:
            raise HTTPException(400, f"/{role}/generate takes messages only on the genrm role")
        chosen = self._route(role, payload, request)  # refuse before rendering when not ready
        payload = await self._images(role, chosen.model_id, payload) or payload
        render = renderer_for(self.renderers, role, chosen.model_id)
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
        if image_urls(payload["messages"]):  # in the order the template shows them
            body["image_data"] = image_urls(payload["messages"])
            try:
                text_placeholders_problem(prompt, body["image_data"])
            except ImageRefused as exc:
                raise HTTPException(exc.status, str(exc)) from None
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
