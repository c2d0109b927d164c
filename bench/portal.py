"""Benchmark: the blocking callers' event loop, ``http.Portal`` (anyio's blocking portal on a
daemon thread), against the hand-written loop thread it replaced (``asyncio`` loop on a thread,
``run_coroutine_threadsafe``), in the same run. Per call, the overhead of running a coroutine
from another thread: one at a time (a blocking caller), and 5000 in flight (a rollout's
requests). Best of 3 rounds of 5000 calls each; prints microseconds and the ratio Portal/loop.

Run: ``.venv/bin/python bench/portal.py``.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

from relax_launch import http

CALLS, ROUNDS = 5000, 3


async def echo(x: int) -> int:
    return x


def one_at_a_time(submit: Callable[[int], Future]) -> float:
    started = time.perf_counter()
    for i in range(CALLS):
        assert submit(i).result(10) == i
    return (time.perf_counter() - started) / CALLS * 1e6


def all_in_flight(submit: Callable[[int], Future]) -> float:
    started = time.perf_counter()
    futures = [submit(i) for i in range(CALLS)]
    assert [f.result(60) for f in futures] == list(range(CALLS))
    return (time.perf_counter() - started) / CALLS * 1e6


def main() -> None:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    portal = http.Portal("bench-portal")
    runners = {
        "loop thread": lambda i: asyncio.run_coroutine_threadsafe(echo(i), loop),
        "Portal": lambda i: portal.submit(echo(i)),
    }
    best = {}
    for name, submit in runners.items():
        one_at_a_time(submit)  # warm-up
        best[name] = (
            min(one_at_a_time(submit) for _ in range(ROUNDS)),
            min(all_in_flight(submit) for _ in range(ROUNDS)),
        )
        print(
            f"{name:12s} one at a time {best[name][0]:6.1f} us/call, "
            f"{CALLS} in flight {best[name][1]:6.1f} us/call"
        )
    ratios = [p / b for p, b in zip(best["Portal"], best["loop thread"], strict=True)]
    print(f"Portal/loop thread: one at a time {ratios[0]:.2f}, in flight {ratios[1]:.2f}")
    portal.close()
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


if __name__ == "__main__":
    main()
