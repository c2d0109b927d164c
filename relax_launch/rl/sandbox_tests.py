"""The ``builtin:code_tests`` test runner, run inside the sandbox (``rl/sandbox_init.py``) as
its unprivileged uid, with the standard library only: the candidate program against the row's
tests, one result line per test on the result pipe (``{"test": i, "passed": bool}``).

A test is one of:
  a string     Python statements (``assert add(2, 3) == 5``) run in the namespace the candidate
               defined (the candidate runs once, as module ``solution``); passed when they raise
               nothing.
  an object    ``{"input": STDIN, "output": STDOUT}``: the candidate run as a program
               (``__name__ == "__main__"``) with that stdin; passed when its stdout equals
               ``output``, trailing spaces of each line and trailing blank lines ignored.
A test whose output passes ``output_bytes`` fails (``OutputLimit``). The sandbox's limits and
its wall time decide the rest: a test not reported before the sandbox ends failed."""

from __future__ import annotations

import io
import json
import os
import sys
from typing import Any


class OutputLimit(BaseException):
    """A test printed more than its limit: not an ``Exception``, so the candidate's own
    ``except Exception`` cannot swallow it."""


class BoundedOutput(io.StringIO):
    """stdout for a test: kept up to ``limit`` characters, then ``OutputLimit``."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit

    def write(self, text: str) -> int:
        if self.tell() + len(text) > self.limit:
            raise OutputLimit(f"more than {self.limit} bytes of output")
        return super().write(text)


def normalized(text: str) -> str:
    return "\n".join(line.rstrip() for line in text.rstrip().splitlines())


def run_program(code: Any, stdin: str, output_bytes: int) -> str:
    """The candidate's stdout when run as ``__main__`` with ``stdin``."""
    out = BoundedOutput(output_bytes)
    sys.stdin, sys.stdout = io.StringIO(stdin), out
    try:
        exec(code, {"__name__": "__main__"})  # noqa: S102 - the sandbox exists to run it
    except SystemExit:
        pass  # a program may end with exit(); its output so far is its answer
    finally:
        sys.stdin, sys.stdout = sys.__stdin__, sys.__stdout__
    return out.getvalue()


def passes(test: Any, code: Any, namespace: dict | None, output_bytes: int) -> bool:
    """Whether one test passes; ``namespace`` is what the candidate defined (None: it raised)."""
    if isinstance(test, dict):
        got = run_program(code, str(test.get("input", "")), output_bytes)
        return normalized(got) == normalized(str(test.get("output", "")))
    if namespace is None:
        return False
    sys.stdout = BoundedOutput(output_bytes)
    try:
        exec(test, namespace)  # noqa: S102
    finally:
        sys.stdout = sys.__stdout__
    return True


def define(code: Any, output_bytes: int) -> dict | None:
    """The namespace the candidate defines as module ``solution``; None when it raises."""
    namespace: dict = {"__name__": "solution"}
    sys.stdout = BoundedOutput(output_bytes)
    try:
        exec(code, namespace)  # noqa: S102
    except BaseException:  # noqa: BLE001 - a failing candidate fails its assert tests
        return None
    finally:
        sys.stdout = sys.__stdout__
    return namespace


def run_tests(source: str, tests: list, output_bytes: int, results: int) -> None:
    """Report each test on the file descriptor ``results``. A process the candidate forked
    that comes back here exits at once: only the runner's own process reports."""
    runner = os.getpid()
    try:
        code = compile(source, "solution.py", "exec")
    except (SyntaxError, ValueError):
        code = None
    asserts = any(not isinstance(t, dict) for t in tests)
    namespace = define(code, output_bytes) if code is not None and asserts else None
    for number, test in enumerate(tests):
        try:
            passed = code is not None and passes(test, code, namespace, output_bytes)
        except BaseException:  # noqa: BLE001 - a raising test failed, whatever it raised
            passed = False
        if os.getpid() != runner:
            os._exit(0)
        os.write(results, (json.dumps({"test": number, "passed": passed}) + "\n").encode())
