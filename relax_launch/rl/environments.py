"""Environments (``rollout.environment``): an environment module in verifiers' contract supplies
the prompts (its dataset), holds each conversation (its ``rollout`` through an OpenAI-compatible
client: one turn, several, tool calls) and scores it (its ``rubric``; ``builtin:environment``).

The environment runs in a worker process (``environment_worker.py``) under its own interpreter
(its dataset, read before the job starts: ``environment_dataset.py``):
verifiers needs openai >= 2.54, the job's SGLang pins openai 2.8.0, so the two cannot share the
job's virtualenv. Its model calls come back over HTTP to rank 0, one endpoint per conversation
(``/sessions/ID/v1/chat/completions``), served on the job's event loop by that conversation's
``AgentClient``: token in, token out, as any agentic rollout (``rl/agent.py``), so the engine's
tokens and logprobs are what the trainer trains on.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from pathlib import Path
from typing import Any

from aiohttp import web

from relax_launch.rl.agent import AgentClient, RolloutBudgetExceeded
from relax_launch.rl.data import Prompt
from relax_launch.rl.environment_config import EnvironmentConfig
from relax_launch.rl.environment_dataset import ROW, command

LINE_LIMIT = 1 << 26  # one reply line: a whole conversation


class WorkerGone(RuntimeError):
    """The environment's worker process ended while the job needed it: the step fails."""


class EnvironmentRollout:
    """The rollout function of an environment (``async (prompt, client) -> conversation``):
    the worker holds the conversation, its model calls are answered by ``client``, the rubric's
    reward goes to ``client.scores["environment"]``. The worker and the endpoint start on the
    first call, on the job's event loop; the worker ends when rank 0 does (its stdin closes)."""

    def __init__(self, config: EnvironmentConfig, log_path: Path) -> None:
        self.config, self.log_path = config, log_path
        self.sessions: dict[str, AgentClient] = {}
        self.exhausted: set[str] = set()  # conversations that used their token budget
        self.pending: dict[int, asyncio.Future] = {}
        self.ids = itertools.count()
        self.url = ""
        self.worker: asyncio.subprocess.Process | None = None
        self.gone: WorkerGone | None = None
        self.starting = asyncio.Lock()
        self.reader: asyncio.Task | None = None
        self.runner: web.AppRunner | None = None

    async def __call__(self, prompt: Prompt, client: AgentClient) -> list[dict[str, Any]]:
        number = next(self.ids)
        sid = str(number)
        self.sessions[sid] = client
        try:
            reply = await self._rollout(number, prompt)
        except WorkerGone as exc:
            client.engine_error = exc  # not this sample's failure: the step's
            raise
        finally:
            self.sessions.pop(sid, None)
        exhausted, self.exhausted = sid in self.exhausted, self.exhausted - {sid}
        if "error" in reply:
            if exhausted:
                raise RolloutBudgetExceeded(reply["error"])
            raise RuntimeError(f"the environment's rollout failed: {reply['error']}")
        client.scores["environment"] = reply["reward"]
        return [*prompt.messages, *reply["completion"]]

    async def _rollout(self, number: int, prompt: Prompt) -> dict[str, Any]:
        async with self.starting:
            if self.worker is None:
                await self._start()
        if self.gone is not None:
            raise self.gone
        future = asyncio.get_running_loop().create_future()
        self.pending[number] = future
        request = {
            "id": number,
            "row": (prompt.meta or {})[ROW],
            "base_url": f"{self.url}/sessions/{number}/v1",
            "timeout_s": self.config.rollout_timeout_s,
        }
        self.worker.stdin.write((json.dumps(request) + "\n").encode())
        try:
            await self.worker.stdin.drain()
            return await asyncio.wait_for(future, self.config.rollout_timeout_s)
        finally:
            self.pending.pop(number, None)

    async def _start(self) -> None:
        """The recording endpoint on 127.0.0.1, then the worker, ready once its environment
        has loaded."""
        app = web.Application(client_max_size=LINE_LIMIT)
        app.router.add_post("/sessions/{sid}/v1/chat/completions", self._chat)
        self.runner = runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        port = runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{port}"
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            self.worker = await asyncio.create_subprocess_exec(
                *command(self.config, "serve"),
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=log,
                limit=LINE_LIMIT,
            )
        try:
            first = await asyncio.wait_for(
                self.worker.stdout.readline(), self.config.load_timeout_s
            )
        except TimeoutError:
            self.worker.kill()
            await self.worker.wait()
            first = json.dumps({"error": f"not loaded in {self.config.load_timeout_s} s"})
        reply = json.loads(first) if first.strip() else {"error": "it exited"}
        if not reply.get("ready"):
            self.gone = WorkerGone(
                f"the environment {self.config.module} did not start: {reply.get('error')} "
                f"(its log: {self.log_path})"
            )
            raise self.gone
        self.reader = asyncio.create_task(self._read())

    async def close(self, timeout_s: float = 10.0) -> None:
        """End the worker (its stdin closes; killed by its PID if it does not exit within
        ``timeout_s``) and the endpoint."""
        if self.worker is not None and self.worker.returncode is None:
            self.worker.stdin.close()
            try:
                await asyncio.wait_for(self.worker.wait(), timeout_s)
            except TimeoutError:
                self.worker.kill()
                await asyncio.wait_for(self.worker.wait(), timeout_s)
        if self.reader is not None:
            await asyncio.wait_for(self.reader, timeout_s)
        if self.runner is not None:
            await self.runner.cleanup()

    async def _read(self) -> None:
        """Each reply to the rollout waiting for it; the worker's end (or a reply line over
        LINE_LIMIT, which ends the stream's reading) fails them all."""
        try:
            while line := await self.worker.stdout.readline():
                try:
                    reply = json.loads(line)
                except ValueError:  # not the protocol's: the worker sends its replies only
                    continue
                future = self.pending.get(reply.get("id"))
                if future is not None and not future.done():
                    future.set_result(reply)
        except ValueError as exc:  # asyncio's reader: a line past its limit
            self.worker.kill()
            self.gone = WorkerGone(
                f"the environment's worker sent {exc} (its log: {self.log_path})"
            )
        code = await self.worker.wait()
        self.gone = self.gone or WorkerGone(
            f"the environment's worker exited with code {code} (its log: {self.log_path})"
        )
        for future in self.pending.values():
            if not future.done():
                future.set_exception(self.gone)

    async def _chat(self, request: web.Request) -> web.Response:
        """One model call of one conversation, answered by its AgentClient."""
        sid = request.match_info["sid"]
        client = self.sessions.get(sid)
        if client is None:
            return _error(404, f"no conversation {sid} is running")
        body = await request.json()
        messages = [_as_recorded(m) for m in body.pop("messages")]
        options = {k: v for k, v in body.items() if v is not None}
        try:
            completion = await client.create(messages=messages, **options)
        except RolloutBudgetExceeded as exc:
            self.exhausted.add(sid)
            return _error(400, str(exc))
        except TypeError as exc:  # an option the agent client does not take
            return _error(400, str(exc))
        except Exception as exc:  # noqa: BLE001 - the engines' failure: client.engine_error
            return _error(502, f"{type(exc).__name__}: {exc}")
        return web.json_response(completion.model_dump(mode="json", exclude_none=True))


def _as_recorded(message: dict[str, Any]) -> dict[str, Any]:
    """A message as the agent client records one: without the nulls that openai's message
    objects dump for unset fields, and null content as "" (verifiers sends a reply that is only
    a tool call without its content; the recorded reply's content is "")."""
    return {"content": ""} | {k: v for k, v in message.items() if v is not None}


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message}}, status=status)
