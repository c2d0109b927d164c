"""Prompts for the RL loop: JSONL files or built-in tasks, shuffled deterministically, resumable.

A JSONL line has ``prompt`` (text) or ``messages`` (chat), and optionally ``label`` and
``data_source``. Built-in tasks are generated locally from the seed (no downloads) and carry
checkable labels:
  arithmetic  "What is 17 + 25? ..."  label "42"           (reward builtin:exact_numeric)
  format      "... End with the line 'Answer: <word>'"      (reward builtin:format)
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

WORDS = ("cat", "light", "tree", "blue", "rain", "sing", "moon", "day", "fun", "cold", "go", "red")


@dataclass(frozen=True)
class Prompt:
    index: int
    messages: tuple[dict[str, str], ...]
    label: str | None = None
    data_source: str = "default"


@dataclass
class PromptCursor:
    """Where the loop is in the data: epoch and position (saved with checkpoints)."""

    epoch: int = 0
    position: int = 0
    seen: int = 0


def arithmetic(count: int, seed: int) -> list[Prompt]:
    rng = random.Random(seed)
    prompts = []
    for i in range(count):
        a, b = rng.randint(1, 20), rng.randint(1, 20)
        text = f"What is {a} + {b}? Reply with just the number."
        prompts.append(Prompt(i, ({"role": "user", "content": text},), str(a + b), "arithmetic"))
    return prompts


def format_task(count: int, seed: int) -> list[Prompt]:
    rng = random.Random(seed)
    prompts = []
    for i in range(count):
        word = rng.choice(WORDS)
        text = (
            f'Give one word that rhymes with "{word}". '
            "End your reply with a line of the form 'Answer: <word>'."
        )
        prompts.append(Prompt(i, ({"role": "user", "content": text},), None, "format"))
    return prompts


BUILTIN_TASKS = {"arithmetic": arithmetic, "format": format_task}
BUILTIN_SIZE = 1000


def load_prompts(dataset: str, seed: int) -> list[Prompt]:
    """Every prompt of ``dataset`` (builtin:NAME or a .jsonl path); errors name the line."""
    if dataset.startswith("builtin:"):
        return BUILTIN_TASKS[dataset[8:]](BUILTIN_SIZE, seed)
    prompts = []
    for number, line in enumerate(Path(dataset).read_text().splitlines(), start=1):
        if line.strip():
            prompts.append(_from_json(line, len(prompts), f"{dataset}:{number}"))
    if not prompts:
        raise ValueError(f"data.dataset {dataset} has no prompts; add JSONL lines with 'prompt'")
    return prompts


def _from_json(line: str, index: int, where: str) -> Prompt:
    try:
        row: Any = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where}: not JSON ({exc})") from None
    if not isinstance(row, dict):
        raise ValueError(f"{where}: a line must be a JSON object")
    if isinstance(row.get("prompt"), str) and row["prompt"]:
        messages = ({"role": "user", "content": row["prompt"]},)
    elif isinstance(row.get("messages"), list) and row["messages"]:
        messages = tuple(row["messages"])
    else:
        raise ValueError(f"{where}: needs a non-empty 'prompt' string or 'messages' list")
    label = row.get("label")
    return Prompt(
        index, messages, None if label is None else str(label), row.get("data_source", "default")
    )


class PromptStream:
    """Batches of prompts in a seeded order that is reshuffled every epoch; resumable."""

    def __init__(self, prompts: list[Prompt], *, shuffle: bool, seed: int) -> None:
        self.prompts, self.shuffle, self.seed = prompts, shuffle, seed
        self.cursor = PromptCursor()
        self.order = self._order(0)

    def _order(self, epoch: int) -> list[int]:
        order = list(range(len(self.prompts)))
        if self.shuffle:
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def next_batch(self, size: int) -> list[Prompt]:
        batch = []
        while len(batch) < size:
            if self.cursor.position == len(self.order):
                self.cursor.epoch, self.cursor.position = self.cursor.epoch + 1, 0
                self.order = self._order(self.cursor.epoch)
            batch.append(self.prompts[self.order[self.cursor.position]])
            self.cursor.position += 1
        self.cursor.seen += size
        return batch

    def checkpoint(self) -> PromptCursor:
        """A copy of the position, to save (``restore`` continues exactly from it)."""
        return PromptCursor(self.cursor.epoch, self.cursor.position, self.cursor.seen)

    def restore(self, cursor: PromptCursor) -> None:
        self.cursor = PromptCursor(cursor.epoch, cursor.position, cursor.seen)
        self.order = self._order(cursor.epoch)
