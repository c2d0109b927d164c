"""Measured: while a step's code rewards take long (sandboxes spinning until their wall time,
on every core), the gateway (a real one, its uvicorn thread in this process, as in rank 0)
answers HTTP requests and another thread's math_verify rewards complete, promptly: all of them
while the first round of sandboxes still spins, none of it having reached its wall time. Run
with ``-m slow -s`` for the figures."""

from __future__ import annotations

import statistics
import threading
import time
import urllib.request

import pytest
from test_code_reward import UID, py, sample

from relax_launch.deadline import wait_until
from relax_launch.inference.config import GatewayConfig
from relax_launch.inference.gateway import InferenceGateway
from relax_launch.inference.serve import GatewayServer
from relax_launch.rl.code_config import CodeTestsConfig
from relax_launch.rl.code_pool import sandbox_problem
from relax_launch.rl.config import RewardConfig
from relax_launch.rl.rewards import Rewards
from relax_launch.rl.samples import Sample

pytestmark = [
    pytest.mark.slow,  # ~20 s, most of it the math-verify workers' start on a loaded machine
    pytest.mark.skipif(
        bool(sandbox_problem(CodeTestsConfig(uid=UID))), reason="no code sandbox on this machine"
    ),
]
WALL_S = 4.0  # the room the gateway's and math's answers have (the first round's wall time)
SPINNING = 8  # 4 at once: two rounds of WALL_S


def http_latencies(url: str, count: int = 20) -> list[float]:
    out = []
    for _ in range(count):
        start = time.monotonic()
        with urllib.request.urlopen(url + "/health", timeout=30) as reply:
            assert reply.status == 200
        out.append(time.monotonic() - start)
    return out


def math_seconds(rewards: Rewards) -> float:
    samples = [Sample(0, "q", str(n), [1], [2], [0.0], rf"\boxed{{{n}}}", "1") for n in range(32)]
    start = time.monotonic()
    rewards.score(samples)
    assert [s.rewards["math"] for s in samples] == [1.0] * 32
    return time.monotonic() - start


def test_slow_code_rewards_block_neither_the_gateway_nor_other_rewards():
    source = {"name": "code", "function": "builtin:code_tests", "timeout_s": WALL_S}
    code = Rewards(RewardConfig(sources=[{**source, "code": {"uid": UID, "concurrency": 4}}]))
    math = Rewards(RewardConfig(sources=[{"name": "math", "function": "builtin:math_verify"}]))
    server = GatewayServer(
        InferenceGateway({}, config=GatewayConfig(), admin_token=None), "127.0.0.1", 0
    )
    server.start()
    try:
        math_seconds(math)  # the workers are up
        idle_http, idle_math = http_latencies(server.url), math_seconds(math)
        spinning = [sample(py("while True:\n    pass"), ["assert True"])] * SPINNING
        took: dict[str, float] = {}

        def score_code() -> None:
            start = time.monotonic()
            took.update(code.score(spinning))
            took["code"] = time.monotonic() - start

        thread = threading.Thread(target=score_code)
        thread.start()
        pool = code.sandboxes["code"]
        assert wait_until(lambda: len(pool.running) == 4, timeout_s=10, interval_s=0.01)
        first_round = list(pool.running)
        busy_http, busy_math = http_latencies(server.url), math_seconds(math)
        # all of the above happened while the first round still spun (none of it ended)
        running = list(pool.running)
        in_first_round = all(any(s is r for r in running) for s in first_round)
        thread.join(timeout=60)
    finally:
        server.stop()
        code.close()
        math.close()
    print(
        f"\ncode rewards: {SPINNING} samples spinning to their {WALL_S} s wall time, 4 at once: "
        f"{took['code']:.2f} s\n/health, idle: median {statistics.median(idle_http) * 1e3:.1f} "
        f"ms, max {max(idle_http) * 1e3:.1f} ms; during: median "
        f"{statistics.median(busy_http) * 1e3:.1f} ms, max {max(busy_http) * 1e3:.1f} ms\n"
        f"32 math_verify rewards, idle: {idle_math:.2f} s; during: {busy_math:.2f} s"
    )
    assert in_first_round
    assert took["reward/code/timeouts"] == SPINNING  # every one spun to its wall time
