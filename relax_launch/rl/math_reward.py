"""The ``math_verify`` reward's check of one response, run in a scoring worker
(``rl/reward_pool.py``): the response's final answer (``\\boxed{}``, LaTeX or a plain
expression) parsed with math-verify and compared symbolically with the row's label.

math-verify's own time limits use ``signal.alarm``; they are turned off here because the
pool's per-sample limit (``reward.sources[].timeout_s``) kills the worker instead, which also
stops a parse that never returns to Python."""

from __future__ import annotations

import logging
import re

from math_verify import parse, verify

# math-verify warns on every call that its own timeout is off (the pool's limit is in force)
logging.getLogger("math_verify").setLevel(logging.ERROR)
# XML-like tags such as <answer>...</answer>: math-verify finds no number glued to one
TAG = re.compile(r"</?[A-Za-z_]\w*>")


def gold_text(label: str) -> str:
    """A label as math-verify parses a reference: in math mode unless it delimits itself
    (``$...$``, ``\\(...\\)``, ``\\[...\\]``, ``\\boxed{}``)."""
    label = label.strip()
    delimited = "$" in label or any(d in label for d in ("\\(", "\\[", "\\boxed"))
    return label if delimited else f"${label}$"


def score(response: str, label: str | None) -> float:
    """1.0 when the response's answer equals the label symbolically, 0.0 when it does not or
    has no parseable answer; ValueError when the row has no label to compare with."""
    if label is None:
        raise ValueError("math_verify needs a label (the reference answer) on every row")
    gold = parse(gold_text(label), parsing_timeout=None)
    if not gold:
        raise ValueError(f"math_verify cannot parse the label {label!r}")
    answer = parse(TAG.sub(" ", response), parsing_timeout=None)
    return float(bool(answer) and verify(gold, answer, timeout_seconds=None))
