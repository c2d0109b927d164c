"""InferenceClient / AsyncInferenceClient: one role's models from Python, through the gateway
or straight to the engines.

Direct mode reads discovery (``GET {gateway}/{role}/engines``, cached for ``cache_ttl_s``) and
picks the engine with the same ``RouteResolver`` the gateway uses, so both choose the same model
and, under policy ``affinity``, the same engine for a key (through sglang-router, the key goes to
the router, which then chooses for both). A request the router refused as not ready (503) is
resolved once more on fresh discovery; a request that may have reached an engine is never sent
again (a generation is never replayed). ``InferenceClient`` runs the async client on an event
loop thread of its own, so both behave the same by construction.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import aiohttp
import orjson

from relax_launch import http
from relax_launch.inference.disaggregation import (
    PairRequest,
    PrefillFailed,
    PrefillTarget,
    PrefillUnreachable,
    bootstrapped,
    watched,
    with_input_logprobs,
)
from relax_launch.inference.discovery import Discovery, read_discovery
from relax_launch.inference.routing import (
    ENGINE_PATHS,
    REFUSED_HEADER,
    RETRY_AFTER_S,
    ROUTING_FIELDS,
    ROUTING_KEY_HEADER,
    ModelUnavailable,
    RouteResolver,
    RouteTarget,
)


class InferenceError(RuntimeError):
    """The gateway or an engine answered with an error status; ``message`` is the gateway's
    ``error.message`` when the reply carries one (the engine's body otherwise)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status, self.message = status, message

    @classmethod
    def of(cls, reply: http.Reply) -> InferenceError:
        try:
            message = reply.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = reply.text[:2000]
        return cls(reply.status, str(message))


@dataclass(frozen=True)
class Prepared:
    url: str
    body: bytes
    headers: dict[str, str]
    model_id: str = "-"  # the model it was routed to ("-" when sent through the gateway)
    prefill: PrefillTarget | None = None  # sent to this prefill half too (``disaggregation``)
    path: str = ""  # the engine path, for the prefill half
    engine_id: str | None = None  # the engine it was routed to (None through a router)

    async def post(self, session: aiohttp.ClientSession, timeout_s: float) -> http.Reply:
        """POST it once, its whole reply read (a generation is never sent twice). A prefill
        half that fails answers for the pair: its error status, or ``TimeoutError`` and
        ``http.TransportError`` as the engine's own would be."""
        call = http.fetch(
            session, "POST", self.url, body=self.body, headers=self.headers, timeout_s=timeout_s
        )
        if self.prefill is None:
            return await call
        pair = PairRequest(session, self.prefill, self.path, self.body, self.headers, timeout_s)
        try:
            reply, prefilled = await pair.alongside(call)
            body = with_input_logprobs(reply.body, prefilled, self.body) if reply.ok else reply.body
            return http.Reply(reply.status, reply.headers, body)
        except PrefillFailed as exc:
            if exc.status == 504:
                raise TimeoutError(str(exc)) from None
            if exc.status == 502:  # its prefill engine is gone, not the decode engine
                raise PrefillUnreachable(self.prefill.url + self.path, str(exc)) from None
            error = orjson.dumps({"error": {"message": str(exc), "code": exc.status}})
            return http.Reply(exc.status, {}, error)


def engine_request(target: RouteTarget, path: str, payload: dict[str, Any]) -> Prepared:
    """``payload`` for ``path`` shaped as the gateway forwards it to ``target``: routing fields
    dropped, an OpenAI-style body naming the served model, the routing key for sglang-router."""
    body = {k: v for k, v in payload.items() if k not in ROUTING_FIELDS}
    if path != "/generate":
        body["model"] = target.served_model_name
    headers = {"content-type": "application/json"}
    if target.routing_key is not None:  # sglang-router picks the engine by it
        headers[ROUTING_KEY_HEADER] = target.routing_key
    if target.prefill is not None:
        body = bootstrapped(body, target.prefill)
    engine_path = ENGINE_PATHS[path]
    return Prepared(
        target.base_url + engine_path,
        orjson.dumps(body),
        headers,
        target.model_id,
        target.prefill,
        engine_path,
        target.engine_id,
    )


class _Planner:
    """What both clients share: discovery cache, route resolution, request shaping."""

    def __init__(
        self,
        gateway_url: str,
        role: str,
        direct: bool,
        cache_ttl_s: float,
        snapshot_provider: Callable[[], Discovery] | None,
    ) -> None:
        self.base, self.role, self.direct = gateway_url.rstrip("/"), role, direct
        self.cache_ttl_s, self.provider = cache_ttl_s, snapshot_provider
        self.resolver = RouteResolver()
        self.cached: tuple[float, Discovery] | None = None

    def fresh(self) -> Discovery | None:
        if self.cached and time.monotonic() - self.cached[0] < self.cache_ttl_s:
            return self.cached[1]
        return self.provider() if self.provider else None

    def store(self, snapshot: Discovery) -> Discovery:
        self.cached = (time.monotonic(), snapshot)
        return snapshot

    def invalidate(self) -> None:
        self.cached = None

    def prepare(
        self, snapshot: Discovery | None, path: str, payload: dict[str, Any], affinity: str | None
    ) -> Prepared:
        headers = {"content-type": "application/json"}
        if not self.direct:
            if affinity:
                headers[ROUTING_KEY_HEADER] = affinity
            return Prepared(f"{self.base}/{self.role}{path}", orjson.dumps(payload), headers)
        if path not in ENGINE_PATHS:
            raise ValueError(f"direct mode serves {sorted(ENGINE_PATHS)}, not {path!r}")
        target = self.resolver.resolve(
            snapshot, payload.get("model"), payload.get("route_key"), affinity
        )
        return engine_request(target, path, payload)


T = TypeVar("T")
WAIT_MARGIN_S = 10.0  # the blocking client waits this long beyond a request's own deadline


def _check(reply: http.Reply) -> None:
    if not reply.ok:
        raise InferenceError.of(reply)


def _refused(reply: http.Reply) -> bool:
    return reply.status == 503 and REFUSED_HEADER in reply.headers


class AsyncInferenceClient:
    """Client for one role (``rollout``, ``genrm`` or ``teacher``) on the caller's event loop."""

    def __init__(
        self,
        gateway_url: str,
        role: str,
        *,
        direct: bool = False,
        timeout_s: float = 300.0,
        cache_ttl_s: float = 1.0,
        snapshot_provider: Callable[[], Discovery] | None = None,
    ) -> None:
        self.planner = _Planner(gateway_url, role, direct, cache_ttl_s, snapshot_provider)
        self.timeout_s = timeout_s
        self._session: aiohttp.ClientSession | None = None  # opened on the loop that uses it

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = http.session()
        return self._session

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def discovery(self, refresh: bool = False) -> Discovery:
        snapshot = None if refresh else self.planner.fresh()
        if snapshot is None:
            url = f"{self.planner.base}/{self.planner.role}/engines"
            reply = await http.fetch(self.session, "GET", url, timeout_s=self.timeout_s)
            _check(reply)
            snapshot = read_discovery(reply.body)  # fields added later ignored
        return self.planner.store(snapshot)

    async def _prepare(self, path: str, payload: dict, affinity: str | None) -> Prepared:
        if not self.planner.direct:
            return self.planner.prepare(None, path, payload, affinity)
        try:
            return self.planner.prepare(await self.discovery(), path, payload, affinity)
        except ModelUnavailable:
            snapshot = await self.discovery(refresh=True)
            return self.planner.prepare(snapshot, path, payload, affinity)

    async def request(self, path: str, payload: dict, *, affinity_key: str | None = None) -> Any:
        """POST a generation request; returns the parsed JSON reply."""
        for attempt in (0, 1):
            prepared = await self._prepare(path, payload, affinity_key)
            try:
                reply = await prepared.post(self.session, self.timeout_s)
            except http.TransportError:
                self.planner.invalidate()
                raise
            if attempt == 0 and _refused(reply):
                await asyncio.sleep(RETRY_AFTER_S)
                continue
            _check(reply)
            return reply.json()

    async def generate(self, payload: dict, **kwargs: Any) -> Any:
        return await self.request("/generate", payload, **kwargs)

    async def chat(self, payload: dict, **kwargs: Any) -> Any:
        return await self.request("/v1/chat/completions", payload, **kwargs)

    @asynccontextmanager
    async def stream(
        self, path: str, payload: dict, *, affinity_key: str | None = None
    ) -> AsyncIterator[AsyncIterator[bytes]]:
        """``async with client.stream(path, payload) as chunks:`` yields the SSE bytes; each
        chunk, not the whole stream, must come within the client's timeout."""
        prepared = await self._prepare(path, {**payload, "stream": True}, affinity_key)
        per_read = aiohttp.ClientTimeout(sock_connect=self.timeout_s, sock_read=self.timeout_s)
        prefill = None
        if prepared.prefill is not None:
            prefill = PairRequest(
                self.session,
                prepared.prefill,
                prepared.path,
                prepared.body,
                prepared.headers,
                self.timeout_s,
            ).prefill_until_failure()
        try:
            async with self.session.post(
                prepared.url, data=prepared.body, headers=prepared.headers, timeout=per_read
            ) as response:
                if response.status >= 400:
                    _check(http.Reply(response.status, response.headers, await response.read()))
                chunks = response.content.iter_any()
                yield chunks if prefill is None else watched(chunks, prefill)
        finally:
            if prefill is not None:
                prefill.cancel()


class InferenceClient:
    """The blocking twin of ``AsyncInferenceClient``: the same client, run on an event loop
    thread of its own."""

    def __init__(
        self,
        gateway_url: str,
        role: str,
        *,
        direct: bool = False,
        timeout_s: float = 300.0,
        cache_ttl_s: float = 1.0,
        snapshot_provider: Callable[[], Discovery] | None = None,
    ) -> None:
        self.client = AsyncInferenceClient(
            gateway_url,
            role,
            direct=direct,
            timeout_s=timeout_s,
            cache_ttl_s=cache_ttl_s,
            snapshot_provider=snapshot_provider,
        )
        self.runner = http.Portal(f"relax-{role}-client")
        # two attempts (a refusal is tried once more), each a discovery and a request
        self.wait_s = 2 * (2 * timeout_s) + RETRY_AFTER_S + WAIT_MARGIN_S

    def _run(self, coro: Coroutine[Any, Any, T], what: str) -> T:
        return self.runner.run(coro, self.wait_s, f"{self.client.planner.role} {what}")

    def close(self) -> None:
        self.runner.close(then=self.client.aclose())

    def discovery(self, refresh: bool = False) -> Discovery:
        return self._run(self.client.discovery(refresh), "discovery")

    def request(self, path: str, payload: dict, *, affinity_key: str | None = None) -> Any:
        """POST a generation request; returns the parsed JSON reply."""
        return self._run(self.client.request(path, payload, affinity_key=affinity_key), path)

    def generate(self, payload: dict, **kwargs: Any) -> Any:
        return self.request("/generate", payload, **kwargs)

    def chat(self, payload: dict, **kwargs: Any) -> Any:
        return self.request("/v1/chat/completions", payload, **kwargs)

    @contextmanager
    def stream(
        self, path: str, payload: dict, *, affinity_key: str | None = None
    ) -> Iterator[Iterator[bytes]]:
        """``with client.stream(path, {..., "stream": True}) as chunks:`` yields SSE bytes."""
        opened = self.client.stream(path, payload, affinity_key=affinity_key)
        chunks = self._run(opened.__aenter__(), path)
        try:
            yield self._chunks(chunks, path)
        finally:
            self._run(opened.__aexit__(None, None, None), path)

    def _chunks(self, chunks: AsyncIterator[bytes], path: str) -> Iterator[bytes]:
        while (chunk := self._run(_next_chunk(chunks), path)) is not None:
            yield chunk


async def _next_chunk(chunks: AsyncIterator[bytes]) -> bytes | None:
    try:
        return await anext(chunks)
    except StopAsyncIteration:
        return None
