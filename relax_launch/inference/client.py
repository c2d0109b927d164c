"""InferenceClient / AsyncInferenceClient: one role's models from Python, through the gateway
or straight to the engines.

Direct mode reads discovery (``GET {gateway}/{role}/engines``, cached for ``cache_ttl_s``) and
picks the engine with the same ``RouteResolver`` the gateway uses, so both choose the same model
and, under policy ``affinity``, the same engine for a key (through sglang-router, the key goes to
the router, which then chooses for both). A request the router refused as not ready (503) is
resolved once more on fresh discovery; a request that may have reached an engine is never sent
again (a generation is never replayed).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import orjson

from relax_launch.inference.discovery import Discovery
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
    def of(cls, response: httpx.Response) -> InferenceError:
        try:
            message = response.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = response.text[:2000]
        return cls(response.status_code, str(message))


@dataclass(frozen=True)
class Prepared:
    url: str
    body: bytes
    headers: dict[str, str]
    model_id: str = "-"  # the model it was routed to ("-" when sent through the gateway)


def engine_request(target: RouteTarget, path: str, payload: dict[str, Any]) -> Prepared:
    """``payload`` for ``path`` shaped as the gateway forwards it to ``target``: routing fields
    dropped, an OpenAI-style body naming the served model, the routing key for sglang-router."""
    body = {k: v for k, v in payload.items() if k not in ROUTING_FIELDS}
    if path != "/generate":
        body["model"] = target.served_model_name
    headers = {"content-type": "application/json"}
    if target.routing_key is not None:  # sglang-router picks the engine by it
        headers[ROUTING_KEY_HEADER] = target.routing_key
    url = target.base_url + ENGINE_PATHS[path]
    return Prepared(url, orjson.dumps(body), headers, target.model_id)


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


def _check(response: httpx.Response) -> None:
    if response.status_code >= 400:
        raise InferenceError.of(response)


def _refused(response: httpx.Response) -> bool:
    return response.status_code == 503 and REFUSED_HEADER in response.headers


class InferenceClient:
    """Blocking client for one role (``rollout``, ``genrm`` or ``teacher``)."""

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
        self.http = httpx.Client(timeout=timeout_s)

    def close(self) -> None:
        self.http.close()

    def discovery(self, refresh: bool = False) -> Discovery:
        snapshot = None if refresh else self.planner.fresh()
        if snapshot is None:
            url = f"{self.planner.base}/{self.planner.role}/engines"
            response = self.http.get(url)
            _check(response)
            snapshot = Discovery.model_validate_json(response.content)
        return self.planner.store(snapshot)

    def _prepare(self, path: str, payload: dict, affinity: str | None) -> Prepared:
        if not self.planner.direct:
            return self.planner.prepare(None, path, payload, affinity)
        try:
            return self.planner.prepare(self.discovery(), path, payload, affinity)
        except ModelUnavailable:
            return self.planner.prepare(self.discovery(refresh=True), path, payload, affinity)

    def request(self, path: str, payload: dict, *, affinity_key: str | None = None) -> Any:
        """POST a generation request; returns the parsed JSON reply."""
        for attempt in (0, 1):
            prepared = self._prepare(path, payload, affinity_key)
            try:
                response = self.http.post(
                    prepared.url, content=prepared.body, headers=prepared.headers
                )
            except httpx.TransportError:
                self.planner.invalidate()
                raise
            if attempt == 0 and _refused(response):
                time.sleep(RETRY_AFTER_S)
                continue
            _check(response)
            return response.json()

    def generate(self, payload: dict, **kwargs: Any) -> Any:
        return self.request("/generate", payload, **kwargs)

    def chat(self, payload: dict, **kwargs: Any) -> Any:
        return self.request("/v1/chat/completions", payload, **kwargs)

    @contextmanager
    def stream(
        self, path: str, payload: dict, *, affinity_key: str | None = None
    ) -> Iterator[Iterator[bytes]]:
        """``with client.stream(path, {..., "stream": True}) as chunks:`` yields SSE bytes."""
        prepared = self._prepare(path, {**payload, "stream": True}, affinity_key)
        with self.http.stream(
            "POST", prepared.url, content=prepared.body, headers=prepared.headers
        ) as response:
            if response.status_code >= 400:
                response.read()
                _check(response)
            yield response.iter_raw()


class AsyncInferenceClient:
    """The asyncio twin of ``InferenceClient`` (same selection rule, same retry rule)."""

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
        self.http = httpx.AsyncClient(timeout=timeout_s)

    async def aclose(self) -> None:
        await self.http.aclose()

    async def discovery(self, refresh: bool = False) -> Discovery:
        snapshot = None if refresh else self.planner.fresh()
        if snapshot is None:
            response = await self.http.get(f"{self.planner.base}/{self.planner.role}/engines")
            _check(response)
            snapshot = Discovery.model_validate_json(response.content)
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
        for attempt in (0, 1):
            prepared = await self._prepare(path, payload, affinity_key)
            try:
                response = await self.http.post(
                    prepared.url, content=prepared.body, headers=prepared.headers
                )
            except httpx.TransportError:
                self.planner.invalidate()
                raise
            if attempt == 0 and _refused(response):
                await asyncio.sleep(RETRY_AFTER_S)
                continue
            _check(response)
            return response.json()

    async def generate(self, payload: dict, **kwargs: Any) -> Any:
        return await self.request("/generate", payload, **kwargs)

    @asynccontextmanager
    async def stream(
        self, path: str, payload: dict, *, affinity_key: str | None = None
    ) -> AsyncIterator[AsyncIterator[bytes]]:
        prepared = await self._prepare(path, {**payload, "stream": True}, affinity_key)
        async with self.http.stream(
            "POST", prepared.url, content=prepared.body, headers=prepared.headers
        ) as response:
            if response.status_code >= 400:
                await response.aread()
                _check(response)
            yield response.aiter_raw()
