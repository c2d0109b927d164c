"""Benchmark data: the arithmetic task with prompts of two visible difficulties, for PPO's critic.

The built-in ``builtin:arithmetic`` draws every sum from 1..20 + 1..20: all its prompts are
about equally hard, so a value model has little to tell apart between prompts and its
explained variance stays near 0 (docs/benchmarks.md). Here half the prompts add two one-digit
numbers (SmolLM2-135M gets many right) and half two four-digit numbers (it gets almost none),
in the built-in task's words, so what a response will earn shows in its prompt.

Run: ``.venv/bin/python bench/critic_data.py OUT.jsonl [--rows 400] [--seed 0]``, then train
with ``data.dataset=OUT.jsonl`` (rows: messages, label, data_source ``easy``/``hard``).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

DIGITS = {"easy": (1, 9), "hard": (1000, 9999)}


def rows(count: int, seed: int) -> list[dict]:
    """``count`` prompts, easy and hard alternating, from the seed."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        source = "easy" if i % 2 == 0 else "hard"
        low, high = DIGITS[source]
        a, b = rng.randint(low, high), rng.randint(low, high)
        text = f"What is {a} + {b}? Reply with just the number."
        messages = [{"role": "user", "content": text}]
        out.append({"messages": messages, "label": str(a + b), "data_source": source})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--rows", type=int, default=400)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    lines = (json.dumps(row) for row in rows(args.rows, args.seed))
    args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
