"""A reward function for the stop tests (``tests/runtime/test_stops.py``): it logs the questions
of every batch it scores to ``$RELAX_TEST_REWARD_LOG``, and from its ``$RELAX_TEST_SLOW_FROM``-th
call on it takes ``$RELAX_TEST_SLOW_S`` seconds, so a step lasts as long as a real one."""

from __future__ import annotations

import json
import os
import time

calls = 0


def slow(samples) -> list[float]:
    """1, 0, 1, 0, ... down the batch (every group has signal), slowly from the Nth call."""
    global calls
    calls += 1
    slow = calls >= int(os.environ.get("RELAX_TEST_SLOW_FROM", "2"))
    record = {"call": calls, "slow": slow, "questions": [s.question for s in samples]}
    with open(os.environ["RELAX_TEST_REWARD_LOG"], "a") as log:
        log.write(json.dumps(record) + "\n")
    if slow:
        time.sleep(float(os.environ.get("RELAX_TEST_SLOW_S", "60")))
    return [float(i % 2 == 0) for i in range(len(samples))]
