"""A single-turn environment in verifiers' contract (a miniature of its SingleTurnEnv, written
without verifiers, which cannot share the job's virtualenv): arithmetic questions as its
dataset; ``run_rollout(input, client, model, sampling_args)`` asks once through the
OpenAI-compatible client and scores the reply with its rubric."""

from __future__ import annotations

import os
import random
import re

NUMBER = re.compile(r"-?\d+")


def last_reply(completion: list[dict]) -> str:
    replies = [m for m in completion if m["role"] == "assistant"]
    return (replies[-1].get("content") or "") if replies else ""


def correct_answer(completion: list[dict], answer: str) -> float:
    numbers = NUMBER.findall(last_reply(completion))
    return float(bool(numbers) and numbers[-1] == answer)


def checksum(completion: list[dict], answer: str) -> float:
    """Unequal for unequal replies: the random tiny model's groups get a reward spread."""
    return sum(map(ord, last_reply(completion))) % 97 / 96


class Rubric:
    """Weighted reward functions of (completion, answer), as verifiers' Rubric."""

    def __init__(self, funcs: list, weights: list[float]) -> None:
        self.funcs, self.weights = funcs, weights

    async def score(self, completion: list[dict], answer: str) -> float:
        pairs = zip(self.funcs, self.weights, strict=True)
        return sum(w * f(completion, answer) for f, w in pairs)


def arithmetic_rows(size: int, seed: int, system: str | None = None) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for number in range(size):
        a, b = rng.randint(1, 20), rng.randint(1, 20)
        prompt = [{"role": "system", "content": system}] if system else []
        prompt.append({"role": "user", "content": f"What is {a} + {b}?"})
        row = {"prompt": prompt, "answer": str(a + b), "task": "add", "info": {"a": a}}
        rows.append(row | {"example_id": number})
    return rows


class SingleTurnEnvironment:
    def __init__(self, dataset: list[dict], rubric: Rubric, max_tokens: int, die: bool) -> None:
        self.dataset, self.rubric, self.max_tokens, self.die = dataset, rubric, max_tokens, die

    async def run_rollout(self, input, client, model, sampling_args):
        if self.die:
            os._exit(3)  # the worker process dies mid-rollout
        print("a print of the environment's own")  # must not break the worker's protocol
        response = await client.chat.completions.create(
            model=model, messages=input["prompt"], max_tokens=self.max_tokens, **sampling_args
        )
        completion = [{"role": "assistant", "content": response.choices[0].message.content}]
        reward = await self.rubric.score(completion, input["answer"])
        return {"example_id": input["example_id"], "completion": completion, "reward": reward}


def load_environment(size: int = 8, seed: int = 0, max_tokens: int = 8, die: bool = False):
    rubric = Rubric([correct_answer, checksum], [1.0, 0.0])
    return SingleTurnEnvironment(arithmetic_rows(size, seed), rubric, max_tokens, die)
