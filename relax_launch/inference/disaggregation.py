"""Prefill/decode disaggregation: SGLang's flags for each half of a pair, and a request's way
through one.

A disaggregated request goes to both halves at once, the same body carrying the prefill
engine's bootstrap address and a fresh room number: the prefill engine computes the prompt's KV
cache and sends it (SGLang's Mooncake transfer) to the decode engine, which generates the answer.
The decode engine's reply is the request's; the prefill engine's says whether its half went
well and holds the prompt's logprobs, merged in when they were asked for. A prefill that fails
would leave the decode engine waiting for a KV cache that never comes, so its failure ends the
decode request at once (``PairRequest``).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import urlsplit

import aiohttp
import orjson

from relax_launch import http

TRANSFER_BACKEND = "mooncake"
# SGLang's own: a request to one half with this bootstrap address generates without a partner
# (its warm-up and health checks); the readiness probe of a half uses it too.
ALONE = {"bootstrap_host": "2.2.2.2", "bootstrap_room": 0}
_rooms = random.SystemRandom()
PREFILL_GRACE_S = 1.0  # how long a pair's answer waits for its prefill half's own reply
T = TypeVar("T")
# A decode half checks its prefill halves' bootstrap servers every HEARTBEAT_S and, after
# HEARTBEAT_FAILURES failed checks in a row, forgets what it cached of one (its bootstrap info,
# its KV-transfer connection: SGLang's ``CommonKVManager._handle_node_failure``); the next
# request then fetches it again and registers its KV memory anew. A prefill half restarted at
# the same address before that would be sent to as if it were the dead one (it knows no decode
# half's memory, and its KV transfer waits for one), so its restart waits PARTNER_FORGETS_S.
HEARTBEAT_S = 2.0  # SGLang's shortest interval (SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL)
HEARTBEAT_FAILURES = 2  # its default (SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE)
PARTNER_FORGETS_S = HEARTBEAT_S * (HEARTBEAT_FAILURES + 1)  # one check's phase at most, on top


def server_args(half: str | None, bootstrap_port: int | None) -> dict[str, Any]:
    """SGLang server arguments of one half (none for an engine that is not disaggregated)."""
    if half is None:
        return {}
    args = {"disaggregation_mode": half, "disaggregation_transfer_backend": TRANSFER_BACKEND}
    if half == "prefill":
        args["disaggregation_bootstrap_port"] = bootstrap_port
    return args


def server_env(half: str | None) -> dict[str, str]:
    """A decode half's heartbeat to its prefill halves, pinned (see ``PARTNER_FORGETS_S``)."""
    if half != "decode":
        return {}
    return {
        "SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL": str(HEARTBEAT_S),
        "SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE": str(HEARTBEAT_FAILURES),
    }


def halves_without_partner(engines: list[Any], out: set[str]) -> set[str]:
    """The ids of the halves among ``engines`` (``EngineHandle``) left without a partner by the
    engines ``out`` of routing: a decode half whose prefill half is out, a prefill half whose
    decode halves all are."""
    decodes = [e for e in engines if e.half == "decode"]
    alone = {d.engine_id for d in decodes if d.prefill_id in out}
    for prefill in (e for e in engines if e.half == "prefill"):
        partners = [d.engine_id for d in decodes if d.prefill_id == prefill.engine_id]
        if partners and set(partners) <= out:
            alone.add(prefill.engine_id)
    return alone - out


@dataclass(frozen=True)
class EngineHalf:
    """One engine of a role: ``prefill``, ``decode`` or None (not disaggregated), and a decode
    engine's prefill engine (its index among the role's engines)."""

    half: str | None
    prefill_index: int | None = None


@dataclass(frozen=True)
class PrefillTarget:
    """The prefill half a request is sent to beside its decode engine."""

    engine_id: str
    url: str
    bootstrap_host: str
    bootstrap_port: int

    @classmethod
    def at(cls, engine_id: str, url: str, bootstrap_port: int) -> PrefillTarget:
        """The prefill engine serving at ``url``: its bootstrap server is on the same host."""
        return cls(engine_id, url, urlsplit(url).hostname or "", bootstrap_port)


class PrefillUnreachable(aiohttp.ClientConnectionError):
    """The prefill half of a pair's request refused or dropped it: the failure is that engine's
    (``url``: where the request went), not the decode half's the request was routed to."""

    def __init__(self, url: str, message: str) -> None:
        super().__init__(message)
        self.url = url


class PrefillFailed(RuntimeError):
    """The prefill half of a request failed; ``status`` is its HTTP status (502: unreachable,
    504: no answer in time)."""

    def __init__(self, prefill: PrefillTarget, status: int, why: str) -> None:
        super().__init__(f"prefill engine {prefill.engine_id} ({prefill.url}) failed: {why}")
        self.status = status


def bootstrapped(payload: dict[str, Any], prefill: PrefillTarget) -> dict[str, Any]:
    """``payload`` for both halves: the prefill engine's bootstrap address and a new room."""
    return {
        **payload,
        "bootstrap_host": prefill.bootstrap_host,
        "bootstrap_port": prefill.bootstrap_port,
        "bootstrap_room": _rooms.getrandbits(63),
    }


@dataclass(frozen=True)
class PairRequest:
    """One request to a pair: ``body`` (``bootstrapped``) goes to the prefill half at ``path``
    beside the caller's own request to the decode half."""

    session: aiohttp.ClientSession
    prefill: PrefillTarget
    path: str
    body: bytes
    headers: dict[str, str]
    timeout_s: float

    async def alongside(self, decode: Awaitable[T]) -> tuple[T, http.Reply | None]:
        """Run ``decode`` (the request to the decode half) with the prefill half's; returns
        what ``decode`` returns and, when the request asked for the prompt's logprobs (which
        only the prefill half has), the prefill half's reply (None otherwise), or raises
        ``PrefillFailed`` as soon as the prefill half fails (the decode request is then
        cancelled, which aborts it)."""
        prefill_call = asyncio.ensure_future(self._post())
        decode_call = asyncio.ensure_future(decode)
        try:
            pending = {prefill_call, decode_call}
            while not decode_call.done():
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                if prefill_call in done:
                    prefill_call.result()  # raises PrefillFailed
            reply = decode_call.result()
            if not _answered(reply):
                return reply, None
            if wants_input_logprobs(self.body):  # the decode half answered once the KV came:
                return reply, await asyncio.wait_for(prefill_call, self.timeout_s)
            # its prefill half is answering too: let it, briefly (its reply is only a report)
            await asyncio.wait({prefill_call}, timeout=PREFILL_GRACE_S)
            if prefill_call.done() and not prefill_call.cancelled():
                prefill_call.exception()  # a late failure: the decode half's answer stands
            return reply, None
        finally:
            for call in (prefill_call, decode_call):
                call.cancel()

    def prefill_until_failure(self) -> asyncio.Task:
        """The prefill half of a streamed request: a task that ends only if that half fails
        (raising ``PrefillFailed``); cancel it once the decode half's stream ends."""

        async def until_failure() -> None:
            await self._post()
            await asyncio.Event().wait()  # its half is done; the decode half streams on

        return asyncio.ensure_future(until_failure())

    async def _post(self) -> http.Reply:
        prefill = self.prefill
        try:
            reply = await http.fetch(
                self.session,
                "POST",
                prefill.url + self.path,
                body=self.body,
                headers=self.headers,
                timeout_s=self.timeout_s,
            )
        except TimeoutError:
            raise PrefillFailed(prefill, 504, f"no answer within {self.timeout_s:.0f} s") from None
        except http.TransportError as exc:
            raise PrefillFailed(prefill, 502, f"{type(exc).__name__}: {exc}") from None
        if not reply.ok:
            raise PrefillFailed(prefill, reply.status, f"HTTP {reply.status}: {reply.text[:300]}")
        return reply


def _answered(reply: Any) -> bool:
    """Whether a decode half's reply (``http.Reply`` or a gateway ``Response``) is a success."""
    status = getattr(reply, "status", None)
    return (reply.status_code if status is None else status) == 200


async def watched(chunks: AsyncIterator[bytes], prefill: asyncio.Task) -> AsyncIterator[bytes]:
    """A decode half's stream, ended by ``PrefillFailed`` if the prefill half fails first."""
    while True:
        chunk = asyncio.ensure_future(anext(chunks, None))
        try:
            await asyncio.wait({chunk, prefill}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not chunk.done():
                chunk.cancel()
        if not chunk.done():
            prefill.result()  # raises PrefillFailed
        if chunk.result() is None:
            return
        yield chunk.result()


def wants_input_logprobs(request: bytes) -> bool:
    """Whether a native request asks for logprobs (the prompt's come from the prefill half)."""
    if b"return_logprob" not in request:
        return False
    try:
        return bool(orjson.loads(request).get("return_logprob"))
    except (ValueError, AttributeError):
        return False


def with_input_logprobs(decode_body: bytes, prefill: http.Reply | None, request: bytes) -> bytes:
    """A native ``/generate`` reply with the prompt's logprobs, which the prefill half computed
    (the decode half returns none), when the request asked for logprobs; as sglang-router's PD
    mode answers. Any other reply as it is."""
    if prefill is None or not wants_input_logprobs(request):
        return decode_body
    try:
        decoded, prefilled = orjson.loads(decode_body), prefill.json()
        pairs = zip(*(r if isinstance(r, list) else [r] for r in (decoded, prefilled)), strict=True)
        for mine, theirs in pairs:
            meta = mine["meta_info"]
            meta["input_token_logprobs"] = (
                theirs["meta_info"]["input_token_logprobs"] + meta["input_token_logprobs"]
            )
    except (ValueError, KeyError, TypeError, AttributeError):
        return decode_body  # not the reply of a generation (an error): as the engine sent it
    return orjson.dumps(decoded)


def check_pair(decode_url: str, prefill: PrefillTarget, timeout_s: float) -> None:
    """One token generated through the pair (the prefill engine's KV cache reached the decode
    engine), or ``RuntimeError`` naming both halves."""
    probe = {"text": "Hello", "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
    body = orjson.dumps(bootstrapped(probe, prefill))
    headers = {"content-type": "application/json"}

    async def once() -> http.Reply:
        async with http.session() as session:
            decode = http.fetch(
                session,
                "POST",
                decode_url + "/generate",
                body=body,
                headers=headers,
                timeout_s=timeout_s,
            )
            pair = PairRequest(session, prefill, "/generate", body, headers, timeout_s)
            return (await pair.alongside(decode))[0]

    try:
        reply = asyncio.run(once())
        reply.raise_for_status()
    except Exception as exc:  # noqa: BLE001 - any failure: the pair cannot serve
        raise RuntimeError(
            f"the pair of decode engine {decode_url} and prefill engine {prefill.engine_id} "
            f"({prefill.url}, bootstrap port {prefill.bootstrap_port}) did not generate a token "
            f"within {timeout_s:.0f} s: {type(exc).__name__}: {exc}. Look for the KV transfer's "
            "error in both engines' logs."
        ) from None
