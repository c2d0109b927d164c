"""``builtin:code``: small Python function tasks generated from the seed, each row with three
``assert`` tests for ``builtin:code_tests`` (the prompt asks for a ```python block, the
reward's default ``code_pattern``)."""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from typing import Any

ASK = "Reply with the function in a ```python code block."


def _ints(rng: random.Random, count: int, low: int = -20, high: int = 20) -> list[int]:
    return [rng.randint(low, high) for _ in range(count)]


def _word(rng: random.Random) -> str:
    return "".join(rng.choice("abcdeiouxyz") for _ in range(rng.randint(1, 8)))


# name(args) -> (what it does, the reference, a random argument tuple)
TASKS: dict[str, tuple[str, Callable[..., Any], Callable[[random.Random], tuple]]] = {
    "add(a, b)": ("returns the sum of a and b", lambda a, b: a + b, lambda r: tuple(_ints(r, 2))),
    "maximum(xs)": (
        "returns the largest number in the non-empty list xs",
        max,
        lambda r: (_ints(r, r.randint(1, 6)),),
    ),
    "reverse(s)": ("returns the string s reversed", lambda s: s[::-1], lambda r: (_word(r),)),
    "count_vowels(s)": (
        "returns how many of the characters of s are vowels (a, e, i, o, u)",
        lambda s: sum(c in "aeiou" for c in s),
        lambda r: (_word(r),),
    ),
    "is_even(n)": (
        "returns True when n is even, else False",
        lambda n: n % 2 == 0,
        lambda r: tuple(_ints(r, 1)),
    ),
    "factorial(n)": ("returns n! (n >= 0)", math.factorial, lambda r: (r.randint(0, 10),)),
    "sum_list(xs)": (
        "returns the sum of the numbers in the list xs",
        sum,
        lambda r: (_ints(r, r.randint(0, 6)),),
    ),
    "square(n)": ("returns n squared", lambda n: n * n, lambda r: tuple(_ints(r, 1))),
}


def rows(count: int, seed: int) -> list[tuple[str, list[str]]]:
    """``count`` (prompt, tests) rows, the same for the same seed."""
    rng = random.Random(seed)
    names = sorted(TASKS)
    out = []
    for _ in range(count):
        signature = rng.choice(names)
        does, reference, arguments = TASKS[signature]
        name = signature.split("(")[0]
        tests = []
        for _ in range(3):
            args = arguments(rng)
            call = f"{name}({', '.join(repr(a) for a in args)})"
            tests.append(f"assert {call} == {reference(*args)!r}")
        out.append((f"Write a Python function `{signature}` that {does}. {ASK}", tests))
    return out
