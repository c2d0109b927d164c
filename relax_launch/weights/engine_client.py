"""Minimal blocking HTTP client for one SGLang engine's control routes (stdlib only)."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from typing import Any


class EngineRequestError(RuntimeError):
    """An engine answered a control request with an error, or not at all."""


def post(url: str, path: str, body: dict[str, Any] | None, timeout_s: float) -> Any:
    """POST JSON and return the parsed reply; raise EngineRequestError on any failure."""
    request = urllib.request.Request(
        url + path,
        data=json.dumps(body or {}).encode(),
        method="POST",
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            raw = response.read()
    except urllib.error.HTTPError as exc:
        raise EngineRequestError(f"{url}{path}: HTTP {exc.code}: {exc.read()[:500]!r}") from None
    except OSError as exc:  # connection refused/reset, timeout
        raise EngineRequestError(f"{url}{path}: {type(exc).__name__}: {exc}") from None
    try:
        reply = json.loads(raw) if raw else None
    except json.JSONDecodeError:
        return raw.decode(errors="replace")
    if isinstance(reply, dict) and reply.get("success") is False:
        raise EngineRequestError(f"{url}{path}: {reply.get('message')}")
    return reply


def get_json(url: str, path: str, timeout_s: float) -> Any:
    try:
        with urllib.request.urlopen(url + path, timeout=timeout_s) as response:
            return json.loads(response.read())
    except (OSError, json.JSONDecodeError) as exc:
        raise EngineRequestError(f"{url}{path}: {type(exc).__name__}: {exc}") from None


class Background:
    """One blocking request on a thread: the engine blocks in a collective we are about to join."""

    def __init__(self, url: str, path: str, body: dict[str, Any], timeout_s: float) -> None:
        self.error: Exception | None = None
        self.value: Any = None
        self.thread = threading.Thread(
            target=self._run, args=(url, path, body, timeout_s), daemon=True
        )
        self.thread.start()

    def _run(self, url: str, path: str, body: dict[str, Any], timeout_s: float) -> None:
        try:
            self.value = post(url, path, body, timeout_s)
        except EngineRequestError as exc:
            self.error = exc

    def result(self, timeout_s: float) -> Any:
        self.thread.join(timeout_s)
        if self.thread.is_alive():
            raise EngineRequestError(f"no reply within {timeout_s:.0f} s")
        if self.error is not None:
            raise self.error
        return self.value
