"""The built-in agentic task's tool: arithmetic word problems (``builtin:word_problems``, in
``rl/data.py``) solved with a calculator (``rollout.function: builtin:calculator``).

The model may write ``<calc>EXPRESSION</calc>``; the rollout function evaluates it (numbers,
``+ - * /`` and parentheses only) and answers in a user turn ``Calculator: RESULT``, up to
``MAX_TURNS`` assistant turns, until a reply has no call. The reward is the usual
``builtin:exact_numeric`` on the last reply, so "Answer: 42" there scores.
"""

from __future__ import annotations

import ast
import operator
import re
from typing import Any

from relax_launch.rl.data import Prompt

MAX_TURNS = 3
CALL = re.compile(r"<calc>(.*?)</calc>", re.DOTALL)
OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}
OPERATORS |= {ast.Div: operator.truediv}


def evaluate(expression: str) -> float:
    """The value of an arithmetic expression; ValueError for anything else."""

    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
            return OPERATORS[type(node.op)](value(node.left), value(node.right))
        raise ValueError(f"not arithmetic: {ast.dump(node)[:60]}")

    try:
        return value(ast.parse(expression.strip(), mode="eval").body)
    except (SyntaxError, ZeroDivisionError, RecursionError) as exc:
        raise ValueError(str(exc)) from None


def result_text(expression: str) -> str:
    try:
        result = evaluate(expression)
    except ValueError as exc:
        return f"error ({exc})"
    return str(int(result)) if float(result).is_integer() else f"{result:.6g}"


async def calculator(prompt: Prompt, client: Any) -> list[Any]:
    """Turns until a reply makes no calculator call (at most MAX_TURNS)."""
    messages: list[Any] = list(prompt.messages)
    for _ in range(MAX_TURNS):
        reply = (await client.chat.completions.create(messages=messages)).choices[0].message
        messages.append(reply)
        call = CALL.search(reply.content or "")
        if call is None:
            break
        messages.append({"role": "user", "content": f"Calculator: {result_text(call.group(1))}"})
    return messages
