"""The process an environment runs in (``rollout.environment``; ``rl/environments.py`` starts
it). Run as a script by the environment's own interpreter, so it imports only the standard
library, ``openai`` and the environment's module, never relax_launch.

``environment_worker.py check MODULE ARGS_JSON``: load the environment, print its dataset as one
JSON line (``{"rows": [...]}``, or ``{"error": ..., "field": "module" | "args"}``) and exit.
``environment_worker.py serve MODULE ARGS_JSON``: load it, print ``{"ready": true}``, then read
one JSON request a line from stdin (``{"id", "row", "base_url", "timeout_s"}``) and answer each
with ``{"id", "reward", "completion"}`` or ``{"id", "error"}``, rollouts running concurrently:
the environment's ``run_rollout`` (verifiers' Environment: the rollout, then its rubric), its
model calls to ``base_url`` (the job's recording endpoint of that one conversation). Stdin's
end (the job ended) ends the process.

The protocol has the process's stdout to itself: what the environment prints goes to stderr.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import os
import sys
import traceback
from typing import Any

MODEL = "rollout"  # the recording endpoint ignores the model name


class Protocol:
    """The process's stdout, kept for the replies; file descriptor 1 then points at stderr, so
    that whatever the environment prints (Python or a child process) goes there."""

    def __init__(self) -> None:
        self.out = os.fdopen(os.dup(sys.stdout.fileno()), "w")
        os.dup2(sys.stderr.fileno(), sys.stdout.fileno())

    def send(self, message: dict[str, Any]) -> None:
        self.out.write(json.dumps(message, default=str) + "\n")
        self.out.flush()

    def fail(self, field: str, message: str) -> None:
        self.send({"error": message, "field": field})
        raise SystemExit(1)


def load(protocol: Protocol, module_name: str, args: dict[str, Any]) -> Any:
    """The environment, or SystemExit with the error line naming the field at fault."""
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 - whatever the module raises on import
        protocol.fail("module", f"cannot import {module_name!r}: {type(exc).__name__}: {exc}")
    loader = getattr(module, "load_environment", None)
    if not callable(loader):
        protocol.fail("module", f"{module_name!r} has no load_environment function")
    try:
        return loader(**args)
    except Exception as exc:  # noqa: BLE001 - the environment's own error
        protocol.fail("args", f"load_environment(**args) raised {type(exc).__name__}: {exc}")


def dataset_rows(protocol: Protocol, environment: Any) -> list[dict[str, Any]]:
    """The dataset's rows as they are (verifiers' columns: ``prompt`` messages, ``answer``,
    ``info``, ``example_id``, ``task``; ``get_dataset()`` where the environment has it): each
    rollout's input."""
    getter = getattr(environment, "get_dataset", None)
    dataset = getter() if callable(getter) else getattr(environment, "dataset", None)
    if dataset is None:
        protocol.fail("module", "its environment has no dataset")
    out = []
    for number, row in enumerate(dataset):
        row = plain(dict(row))
        if not isinstance(row.get("prompt"), list) or not row["prompt"]:
            protocol.fail("module", f"dataset row {number} has no prompt (a list of messages)")
        out.append({"example_id": number} | row)
    if not out:
        protocol.fail("module", "its environment's dataset is empty")
    return out


def prompts(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """What rank 0 makes its prompts of: each row's messages, answer (the label) and task."""
    return [
        {
            "prompt": row["prompt"],
            "answer": "" if row.get("answer") is None else str(row["answer"]),
            "task": str(row.get("task") or "default"),
        }
        for row in rows
    ]


def plain(value: Any) -> Any:
    """JSON-able: message objects (pydantic models) as the dicts they dump to."""
    if hasattr(value, "model_dump"):
        return value.model_dump(exclude_none=True)
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    return value


def model_client(client: Any) -> Any:
    """The client the environment takes: verifiers (0.2) wraps openai's in a client of its
    own; an environment without verifiers takes openai's."""
    try:
        from verifiers.clients import OpenAIChatCompletionsClient  # where it is installed
    except ImportError:
        return client
    return OpenAIChatCompletionsClient(client)


async def rollout(environment: Any, row: dict[str, Any], request: dict[str, Any]) -> dict:
    """One conversation through the recording endpoint, scored by the rubric: verifiers'
    ``run_rollout(input, client, model, sampling_args)`` and the reward of its output."""
    from openai import AsyncOpenAI  # serving only: a check loads the module alone, faster

    client = AsyncOpenAI(
        base_url=request["base_url"], api_key="relax", max_retries=0, timeout=request["timeout_s"]
    )
    output = await environment.run_rollout(row, model_client(client), MODEL, {})
    if hasattr(output, "model_dump"):
        output = output.model_dump()
    return {"reward": float(output["reward"]), "completion": plain(output["completion"])}


async def answer(
    protocol: Protocol, environment: Any, table: list[dict[str, Any]], request: dict[str, Any]
) -> None:
    try:
        reply = await rollout(environment, table[request["row"]], request)
    except Exception as exc:  # noqa: BLE001 - this rollout failed; the others go on
        traceback.print_exc()
        reply = {"error": f"{type(exc).__name__}: {exc}"}
    protocol.send({"id": request["id"]} | reply)


async def serve(protocol: Protocol, environment: Any, table: list[dict[str, Any]]) -> None:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    protocol.send({"ready": True})
    running = set()
    while line := await reader.readline():
        task = asyncio.create_task(answer(protocol, environment, table, json.loads(line)))
        running.add(task)
        task.add_done_callback(running.discard)


def main() -> None:
    protocol = Protocol()
    mode, module_name, args = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    environment = load(protocol, module_name, args)
    table = dataset_rows(protocol, environment)
    if mode == "check":
        protocol.send({"rows": prompts(table)})
        return
    asyncio.run(serve(protocol, environment, table))


if __name__ == "__main__":
    main()
