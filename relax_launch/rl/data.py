"""Prompts for the RL loop: built-in tasks, or JSONL, Parquet and HF ``datasets`` directories
(read locally with pyarrow), shuffled deterministically, resumable.

A row has ``prompt`` (text) or ``messages`` (chat; a message's content may be typed parts with
images, read by ``rl/vision_prompts.py``), and optionally ``label`` and ``data_source``;
``data.prompt_key``, ``messages_key``, ``label_key`` and ``data_source_key`` name other fields.
The chat template is the tokenizer's (``rl.context.PromptFeed``). Built-in tasks are generated
locally from the seed (no downloads) and carry checkable labels:
  arithmetic  "What is 17 + 25? ..."  label "42"           (reward builtin:exact_numeric)
  format      "... End with the line 'Answer: <word>'"      (reward builtin:format)
  word_problems  "Ann has 17 apples and buys 25 more. ..."  label "42", with a system prompt
                 offering the calculator of rollout.function: builtin:calculator
  code        "Write a Python function `add(a, b)` ..." with three assert ``tests``
                 (reward builtin:code_tests; rl/code_tasks.py)
  shape_counting  an image of coloured shapes (PIL) and "How many red circles are in the
                 image? ..."  label "2" (reward builtin:exact_numeric; a vision-language
                 policy; rl/visual_tasks.py)
A row's ``tests`` (for ``builtin:code_tests``) travel in its ``meta``.
``reasoning_gym:TASK[+TASK...]`` draws reasoning-gym's procedural tasks (``data.reasoning_gym``;
``rl/reasoning_gym_tasks.py``), each row carrying its task's entry for ``builtin:reasoning_gym``.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from relax_launch.rl import code_tasks, visual_tasks
from relax_launch.rl.data_config import PromptSource
from relax_launch.rl.prompt import Prompt
from relax_launch.rl.reasoning_gym_config import PREFIX, ReasoningGymConfig, task_names
from relax_launch.rl.vision_prompts import attach_images, image_parts, text_of

WORDS = ("cat", "light", "tree", "blue", "rain", "sing", "moon", "day", "fun", "cold", "go", "red")


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


CALCULATOR_SYSTEM = (
    "You can use a calculator: write <calc>EXPRESSION</calc> with numbers, + - * / and "
    "parentheses, and you will get its result. End your final reply with 'Answer: <number>'."
)
STORIES = (
    ("{name} has {a} apples and buys {b} more. How many apples does {name} have now?", "+"),
    ("{name} had {a} stamps and gave {b} of them away. How many stamps are left?", "-"),
    ("{name} buys {a} boxes with {b} pencils in each. How many pencils is that in total?", "*"),
)
NAMES = ("Ann", "Ben", "Cleo", "Dev", "Eva", "Finn")


def word_problems(count: int, seed: int) -> list[Prompt]:
    """``count`` problems with integer answers, from the seed."""
    rng = random.Random(seed)
    prompts = []
    for i in range(count):
        story, op = rng.choice(STORIES)
        a, b = rng.randint(12, 99), rng.randint(2, 11)
        answer = {"+": a + b, "-": a - b, "*": a * b}[op]
        text = story.format(name=rng.choice(NAMES), a=a, b=b)
        messages = (
            {"role": "system", "content": CALCULATOR_SYSTEM},
            {"role": "user", "content": text},
        )
        prompts.append(Prompt(i, messages, str(answer), "word_problems"))
    return prompts


def code(count: int, seed: int) -> list[Prompt]:
    """``count`` Python function tasks with their assert tests, from the seed."""
    return [
        Prompt(i, ({"role": "user", "content": text},), None, "code", {"tests": tests})
        for i, (text, tests) in enumerate(code_tasks.rows(count, seed))
    ]


BUILTIN_TASKS = {
    "arithmetic": arithmetic,
    "format": format_task,
    "word_problems": word_problems,
    "code": code,
    "shape_counting": visual_tasks.shape_counting,
}
BUILTIN_SIZE = 1000


def load_prompts(data: PromptSource) -> list[Prompt]:
    """Every prompt of ``data.dataset``: a built-in task, or the rows of a JSONL file, a Parquet
    file or an HF ``datasets`` directory, read with the data's key mapping. Errors name the file
    and the line or row, and what to do."""
    if data.dataset.startswith("builtin:"):
        return BUILTIN_TASKS[data.dataset[8:]](BUILTIN_SIZE, data.seed)
    if data.dataset.startswith(PREFIX):
        return reasoning_gym_prompts(data)
    prompts = [from_row(row, i, where, data) for i, (where, row) in enumerate(read_rows(data))]
    if not prompts:
        raise ValueError(f"{data.where}.dataset {data.dataset} has no prompts")
    return prompts


def reasoning_gym_prompts(data: PromptSource) -> list[Prompt]:
    """``size`` prompts of each task of ``reasoning_gym:A+B``, from ``data.seed``."""
    from relax_launch.rl import reasoning_gym_tasks  # only for these datasets: seconds to import

    rg = data.reasoning_gym or ReasoningGymConfig()
    rows = reasoning_gym_tasks.rows(
        task_names(data.dataset),
        rg.size,
        data.seed,
        rg.tasks,
        rg.answer_format,
        rg.answer_pattern,
    )
    return [
        Prompt(i, ({"role": "user", "content": text},), label, task, meta)
        for i, (text, label, task, meta) in enumerate(rows)
    ]


def question(prompt: Prompt) -> tuple[str, str]:
    """A reasoning-gym row's task and question, whatever answer format the prompt adds."""
    return prompt.data_source, (prompt.meta or {}).get("entry", {}).get("question", "")


def held_out(
    prompts: list[Prompt], held: PromptSource, training: list[Prompt], data: PromptSource
) -> list[Prompt]:
    """The eval ``prompts`` whose question the ``training`` prompts do not ask, when both are
    reasoning-gym tasks: a small task (sums of one-digit numbers) draws the same question under
    another seed. Other datasets are the user's split, kept as given."""
    if not (held.dataset.startswith(PREFIX) and data.dataset.startswith(PREFIX)):
        return prompts
    trained = {question(p) for p in training}
    return [p for p in prompts if question(p) not in trained]


def read_rows(data: PromptSource) -> Iterator[tuple[str, Any]]:
    """(where, row) for every row of the dataset's file or directory."""
    path = Path(data.dataset).expanduser()
    if path.suffix == ".jsonl":
        for number, line in enumerate(path.read_text().splitlines(), start=1):
            if line.strip():
                yield f"{path}:{number}", _json_row(line, f"{path}:{number}")
        return
    for file in [path] if path.suffix == ".parquet" else table_files(path, data.split):
        for number, row in enumerate(read_table(file).to_pylist(), start=1):
            yield f"{file} row {number}", row


def table_files(directory: Path, split: str) -> list[Path]:
    """The files of one split of a dataset directory: ``save_to_disk``'s Arrow files (a
    DatasetDict keeps one directory per split), else the Parquet files named after the split or
    in a directory named after it (the Hub's layout), else every Parquet file there."""
    if not directory.is_dir():
        raise ValueError(
            f"data.dataset {directory} is not a .jsonl or .parquet file or a directory"
        )
    if (directory / "dataset_dict.json").is_file():
        splits = json.loads((directory / "dataset_dict.json").read_text())["splits"]
        if split not in splits:
            raise ValueError(f"data.split={split!r} is not in {directory}: it has {splits}")
        directory = directory / split
    if (directory / "state.json").is_file():
        state = json.loads((directory / "state.json").read_text())
        return [directory / f["filename"] for f in state["_data_files"]]
    parquet = sorted(directory.rglob("*.parquet"))
    named = [f for f in parquet if f.name.startswith(split) or f.parent.name == split]
    if not (named or parquet):
        raise ValueError(f"data.dataset {directory} has no Parquet or datasets Arrow files")
    return named or parquet


def read_table(file: Path) -> Any:
    """A pyarrow table from a Parquet file or an Arrow stream file (what ``datasets`` writes)."""
    import pyarrow as pa  # only for datasets in files
    import pyarrow.parquet as pq

    try:
        if file.suffix == ".parquet":
            return pq.read_table(file)
        with pa.memory_map(str(file)) as source:
            return pa.ipc.open_stream(source).read_all()
    except (OSError, pa.ArrowInvalid) as exc:
        raise ValueError(f"data.dataset: cannot read {file}: {exc}") from None


def _json_row(line: str, where: str) -> Any:
    try:
        return json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where}: not JSON ({exc})") from None


def from_row(row: Any, index: int, where: str, data: PromptSource) -> Prompt:
    """A prompt from one row: its ``prompt_key`` text or ``messages_key`` chat, and the optional
    ``label_key`` and ``data_source_key``."""
    if not isinstance(row, dict):
        raise ValueError(f"{where}: a row must be an object with named fields")
    text, chat = row.get(data.prompt_key), row.get(data.messages_key)
    if isinstance(text, str) and text:
        messages: tuple[dict[str, str], ...] = ({"role": "user", "content": text},)
    elif isinstance(chat, list) and chat and all(_is_message(m) for m in chat):
        messages = tuple({"role": m["role"], "content": _content(m["content"])} for m in chat)
        if any(p.get("type") == "image" and not p.get("image") for _, p in image_parts(messages)):
            messages = attach_images(messages, row.get("images"), where)  # TRL's image column
    else:
        raise ValueError(
            f"{where}: needs a non-empty {data.prompt_key!r} string or {data.messages_key!r} list "
            f"of {{role, content}} (fields: {', '.join(row)}); set {data.where}.prompt_key "
            f"or {data.where}.messages_key to the dataset's field"
        )
    label = row.get(data.label_key)
    meta = {"tests": row["tests"]} if "tests" in row else None  # builtin:code_tests's
    source = str(row.get(data.data_source_key, "default"))  # e.g. the teacher that scores it
    return Prompt(index, messages, None if label is None else str(label), source, meta)


def _is_message(message: Any) -> bool:
    """A chat message: a role and content, text or a list of typed parts (text, image,
    image_url: ``rl/vision_prompts.py`` reads the images)."""
    if not isinstance(message, dict) or "role" not in message:
        return False
    content = message.get("content")
    parts = isinstance(content, list) and all(
        isinstance(p, dict) and isinstance(p.get("type"), str) for p in content
    )
    return isinstance(content, str) or parts


def _content(content: Any) -> Any:
    """A message's content as a chat template reads it: text parts alone as one string; each
    part without its None fields (Arrow gives every part of a column every struct field, and
    Qwen2.5-VL's template takes a part with an ``image`` key for an image)."""
    if isinstance(content, str):
        return content
    parts = [{k: v for k, v in part.items() if v is not None} for part in content]
    return text_of(parts) if all(p["type"] == "text" for p in parts) else parts


def prompt_ids(tokenizer: Any, prompt: Prompt) -> list[int]:
    """The prompt's token ids: its messages in the tokenizer's chat template, ready for the
    assistant's reply."""
    text = tokenizer.apply_chat_template(
        list(prompt.messages), add_generation_prompt=True, tokenize=False
    )
    return tokenizer.encode(text, add_special_tokens=False)


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
