"""Whether an engine that dropped a request is gone: the controller's health probe.

SGLang 0.5's ``/health`` (``sglang/srt/entrypoints/http_server.py``, ``health_generate``) sends
a one-token request, sleeps 1 s, and answers 200 once its scheduler has sent anything since, or
503 after ``SGLANG_HEALTH_CHECK_TIMEOUT`` (20 s). A live engine busy with one long prefill or a
weight update therefore answers in seconds, or says 503 once. So one slow or failed probe
proves nothing: an engine is gone when nothing listens on its port (its process is gone), or
when ``attempts`` probes, each given longer than SGLang's own bound, fail over at least
``window_s``. An engine taken out of routing this way is probed again before each weight sync
and comes back when it answers (``runtime/engine_restart.py``).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import aiohttp

from relax_launch import http
from relax_launch.deadline import Deadline

SGLANG_HEALTH_S = 20.0  # SGLang's HEALTH_CHECK_TIMEOUT: the longest its /health takes to answer


@dataclass(frozen=True)
class HealthProbe:
    """How the controller decides an engine is gone (defaults sized for SGLang, above)."""

    timeout_s: float = SGLANG_HEALTH_S + 5.0  # each probe ends with the engine's own answer
    attempts: int = 3
    window_s: float = 3 * SGLANG_HEALTH_S  # the failed probes span at least this

    async def gone(self, session: aiohttp.ClientSession, url: str) -> str | None:
        """None as soon as the engine at ``url`` answers ``/health`` with 200; else why it is
        gone: its port refuses connections, or every probe over ``window_s`` failed."""
        window, failures = Deadline(self.window_s), []
        for attempt in range(self.attempts):
            try:
                reply = await self._health(session, url)
                if reply.ok:
                    return None
                failures.append(f"HTTP {reply.status}")
            except TimeoutError:
                failures.append(f"no answer within {self.timeout_s:.0f} s")
            except http.TransportError as exc:
                if http.refused(exc):
                    return f"nothing listens at {url} (its server is gone)"
                failures.append(f"{type(exc).__name__}: {exc}")
            remaining = self.attempts - 1 - attempt
            if remaining:  # spread the probes left over what is left of the window
                await asyncio.sleep(window.left() / remaining)
        return (
            f"{self.attempts} probes of {url}/health over {self.window_s:.0f} s failed: "
            + "; ".join(failures)
        )

    async def _health(self, session: aiohttp.ClientSession, url: str) -> http.Reply:
        """``GET /health``. A connection dropped under it is most likely one the engine's dead
        server left in the pool (kept alive, its close not read yet; aiohttp's one retry of a
        GET may take another such): asked again at once on a connection of its own, whose
        refusal tells a dead server without waiting out a share of the window."""
        try:
            return await http.fetch(session, "GET", url + "/health", timeout_s=self.timeout_s)
        except http.TransportError as exc:
            if http.refused(exc) or not http.unreachable(exc):
                raise
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as own:
            return await http.fetch(own, "GET", url + "/health", timeout_s=self.timeout_s)
