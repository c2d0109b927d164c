"""How the project talks to an SGLang engine's HTTP server outside generation: rank 0's
``EngineHandle`` on one engine, and the calls to its control routes.

Every control operation of the lifecycle goes through ``EngineHandle.call``, which refuses a
weight mutation or LoRA operation on a STATIC model (teacher, genrm) before any network I/O.
A weight sync sends a few requests per engine, each of which the engine answers only once the
sender has joined a collective, so ``EngineControl`` starts requests on its own event loop,
awaited later, over one session that keeps a connection open per engine between syncs; the
other calls (``post``, ``get_json``) are one-shot.
"""

from __future__ import annotations

import time
from collections import deque
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from relax_launch import http

if TYPE_CHECKING:
    import aiohttp

MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")

# SGLang routes that change what a model computes; a STATIC model refuses all of them.
WEIGHT_MUTATIONS = frozenset(
    {
        "init_weights_update_group",
        "destroy_weights_update_group",
        "begin_weight_update",
        "end_weight_update",
        "update_weights_from_distributed",
        "update_weights_from_tensor",
        "update_weights_from_disk",
        "update_weights_from_ipc",
        "update_weight_version",
        "init_weights_send_group_for_remote_instance",
        "send_weights_to_remote_instance",
        "load_lora_adapter",
        "load_lora_adapter_from_tensors",
        "unload_lora_adapter",
    }
)


class StaticModelError(RuntimeError):
    """A weight or LoRA operation was asked of a static model; nothing was sent."""


@dataclass
class EngineHandle:
    """One logical engine; ``loaded`` tracks which memory tags it holds, as last confirmed."""

    engine_id: str
    url: str
    role: str
    static: bool
    timeout_s: float = 60.0
    generation: int = 1
    loaded: set[str] = field(default_factory=lambda: set(MEMORY_TAGS))
    history: deque = field(default_factory=lambda: deque(maxlen=64))
    # prefill/decode disaggregation: which half this engine is, a prefill engine's bootstrap
    # port, and the prefill engine a decode engine pairs with
    half: str | None = None
    bootstrap_port: int | None = None
    prefill_id: str | None = None
    index: int | None = None  # the engine's index in the plan (its ranks)
    model_id: str | None = None  # the model it serves, of a role with several (None: the default)

    def require_mutable(self, op: str) -> None:
        if self.static and op in WEIGHT_MUTATIONS:
            raise StaticModelError(
                f"{self.role} engine {self.engine_id} serves a STATIC model and refuses {op!r}; "
                "only the rollout policy takes weight or LoRA updates"
            )

    def call(self, op: str, body: dict[str, Any] | None = None, timeout_s: float | None = None):
        """POST ``/op`` to the engine; raises ``EngineRequestError`` naming the engine."""
        self.require_mutable(op)
        started = time.monotonic()
        try:
            reply = post(self.url, "/" + op, body, timeout_s or self.timeout_s)
        except EngineRequestError as exc:
            self.history.append((op, "error", round(time.monotonic() - started, 3)))
            # the same kind: an unreachable engine (gone) stays told apart from a failing one
            raise type(exc)(f"{self.role} engine {self.engine_id}: {exc}") from None
        self.history.append((op, "ok", round(time.monotonic() - started, 3)))
        return reply

    def info(self, path: str = "/model_info") -> dict[str, Any]:
        return get_json(self.url, path, self.timeout_s)

    def weight_version(self) -> str:
        return str(self.info()["weight_version"])

    @property
    def complete(self) -> bool:
        return self.loaded >= set(MEMORY_TAGS)


# a blocking call waits this much longer than its request's own deadline before giving up
LOOP_MARGIN_S = 5.0


class EngineRequestError(RuntimeError):
    """An engine answered a control request with an error, or not at all."""


class EngineUnreachable(EngineRequestError):
    """The engine refused the connection or dropped it: its server is gone (not merely slow)."""


class EngineControl:
    """Blocking and background POSTs to engines over kept-alive connections."""

    def __init__(self) -> None:
        self.portal = http.Portal("engine-control")
        self.session = self.portal.session(limit=64)

    def post(self, url: str, path: str, body: dict[str, Any] | None, timeout_s: float) -> Any:
        """POST JSON and return the parsed reply; raise EngineRequestError on any failure."""
        return result(self.submit(url, path, body or {}, timeout_s), timeout_s + LOOP_MARGIN_S)

    def submit(self, url: str, path: str, body: dict[str, Any], timeout_s: float) -> Future:
        """The same POST, started now: the engine may block in a collective we are about to
        join."""
        return self.portal.submit(_post(self.session, url + path, body, timeout_s))

    def close(self) -> None:
        self.portal.close(LOOP_MARGIN_S, then=self.session.close())


async def _post(
    session: aiohttp.ClientSession, where: str, body: dict[str, Any], timeout_s: float
) -> Any:
    try:
        reply = await http.fetch(session, "POST", where, json=body, timeout_s=timeout_s)
    except (http.TransportError, TimeoutError) as exc:
        raise _failure(where, exc) from None
    return _parsed(where, reply)


def _failure(where: str, exc: BaseException) -> EngineRequestError:
    """Connection refused/reset: the engine is gone; a timeout: it is slow."""
    error = EngineUnreachable if http.unreachable(exc) else EngineRequestError
    why = str(exc) or "no reply in time"
    return error(f"{where}: {type(exc).__name__}: {why}")


def _parsed(where: str, reply: http.Reply) -> Any:
    if not reply.ok:
        raise EngineRequestError(f"{where}: HTTP {reply.status}: {reply.body[:500]!r}")
    try:
        parsed = reply.json() if reply.body else None
    except ValueError:
        return reply.text
    if isinstance(parsed, dict) and parsed.get("success") is False:
        raise EngineRequestError(f"{where}: {parsed.get('message')}")
    return parsed


def _blocking(method: str, where: str, body: dict[str, Any] | None, timeout_s: float) -> Any:
    try:
        reply = http.call(method, where, json=body, timeout_s=timeout_s)
    except (http.TransportError, TimeoutError) as exc:
        raise _failure(where, exc) from None
    return _parsed(where, reply)


def post(url: str, path: str, body: dict[str, Any] | None, timeout_s: float) -> Any:
    """One POST on a connection of its own (calls off the weight-sync path)."""
    return _blocking("POST", url + path, body or {}, timeout_s)


def get_json(url: str, path: str, timeout_s: float) -> Any:
    return _blocking("GET", url + path, None, timeout_s)


def result(call: Future, timeout_s: float) -> Any:
    """The reply of a submitted request, waiting at most ``timeout_s``."""
    try:
        return call.result(timeout=max(timeout_s, 0.0))
    except FutureTimeout:
        raise EngineRequestError(f"no reply within {timeout_s:.0f} s") from None
