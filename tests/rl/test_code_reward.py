"""The ``builtin:code_tests`` reward with real sandboxes (``unshare`` namespaces, limits, an
unprivileged uid): right, wrong and malformed answers; each escape the sandbox must contain
(an infinite loop, a fork bomb, a memory hog, a huge output, a write outside its directory, a
network connection) is contained, the reward still answers, the job's process is unaffected
and the next sample scores as usual."""

from __future__ import annotations

import errno
import os
import resource
import socket
import threading
import time
from pathlib import Path

import psutil
import pytest
from harness.stop_signal import abandoned_after

from relax_launch.deadline import wait_until
from relax_launch.rl.code_config import CodeTestsConfig
from relax_launch.rl.code_pool import CodeSandboxPool, sandbox_problem
from relax_launch.rl.code_tasks import rows
from relax_launch.rl.config import RewardConfig
from relax_launch.rl.rewards import Rewards
from relax_launch.rl.samples import Sample

# each xdist worker its own uids: RLIMIT_NPROC counts every process of a uid on the machine
UID = 62000 + 100 * int(os.environ.get("PYTEST_XDIST_WORKER", "gw0")[2:] or 0)
# A sandbox takes ~0.1 s to start and run. One that must end by itself has a wall it reaches
# only on a hang (beside CI's e2e pass a 3 s wall once ran out on one); one killed at its wall
# time has a short one, which the test waits out.
WALL_S = 60.0
LIMIT_S = 3.0

pytestmark = pytest.mark.skipif(
    bool(sandbox_problem(CodeTestsConfig(uid=UID))), reason="no code sandbox on this machine"
)


def py(code: str) -> str:
    return f"Here it is:\n```python\n{code}\n```\nDone."


def sample(text: str, tests: list | None) -> Sample:
    return Sample(0, "q", None, [1], [2], [0.0], text, "1", meta={"tests": tests})


def code_rewards(timeout_s: float = WALL_S, **code) -> Rewards:
    source = {"name": "code", "function": "builtin:code_tests", "timeout_s": timeout_s}
    return Rewards(RewardConfig(sources=[{**source, "code": {"uid": UID, **code}}]))


@pytest.fixture(scope="module")
def rewards():
    rewards = code_rewards()
    yield rewards
    rewards.close()


def sandboxed_processes() -> list[psutil.Process]:
    """Processes of the sandboxes' uids still alive (zombies included)."""
    uids = range(UID, UID + 100)
    return [p for p in psutil.process_iter(["uids"]) if p.info["uids"].real in uids]


def scores(rewards: Rewards, samples: list[Sample]) -> tuple[list[float], dict, float]:
    start = time.monotonic()
    metrics = rewards.score(samples)
    return [s.rewards.get("code") for s in samples], metrics, time.monotonic() - start


ADD = ["assert add(2, 3) == 5", "assert add(-1, 1) == 0"]
DOUBLE = [{"input": "3\n", "output": "6"}, {"input": "10", "output": "20\n"}]


@pytest.mark.parametrize(
    ("text", "tests", "reward"),
    [
        (py("def add(a, b):\n    return a + b"), ADD, 1.0),
        (py("def add(a, b):\n    return a + b if a > 0 else 7"), ADD, 0.5),
        (py("def add(a, b):\n    return a - b"), ADD, 0.0),
        (py("print(int(input()) * 2)"), DOUBLE, 1.0),
        (py("print(int(input()) + 3)"), DOUBLE, 0.5),  # 6, then 13
        # the last block is the program; an earlier one is not
        (py("def add(a, b):\n    return 0") + py("def add(a, b):\n    return a + b"), ADD, 1.0),
        ("```\ndef add(a, b):\n    return a + b\n```", ADD, 1.0),  # a bare fence
        (
            py("import math, json, collections\ndef add(a, b):\n    return int(math.fsum([a, b]))"),
            ADD,
            1.0,
        ),
        ("def add(a, b):\n    return a + b", ADD, 0.0),  # malformed: no ```python block
        (py("def add(a, b) return a + b"), ADD, 0.0),  # malformed: a syntax error
        (py("def add(a, b):\n    return a + b\nraise SystemExit(3)"), ADD, 0.0),
        (py("def add(a, b):\n    return a + b\nimport os\nos._exit(0)"), ADD, 0.0),
        (py("import sys\nsys.exit(0)"), DOUBLE, 0.0),  # exits before printing: wrong output
    ],
    ids=[
        "right",
        "half",
        "wrong",
        "stdin-right",
        "stdin-half",
        "last-block",
        "bare-fence",
        "stdlib",
        "no-block",
        "syntax",
        "raises",
        "exits-early",
        "stdin-exits",
    ],
)
def test_right_wrong_and_malformed_answers(rewards, text, tests, reward):
    (value,), metrics, _ = scores(rewards, [sample(text, tests)])
    assert value == reward
    assert metrics["reward/code/failed"] == 0 and metrics["reward/code/timeouts"] == 0


def test_a_row_without_tests_fails_the_source_not_the_step(rewards):
    good, bad = sample(py("def add(a, b):\n    return a + b"), ADD), sample(py("x = 1"), None)
    values, metrics, _ = scores(rewards, [good, bad])
    assert values == [1.0, None] and not bad.valid and metrics["reward/code/failed"] == 1


def test_the_builtin_code_tasks_pass_with_right_functions_and_fail_with_wrong_ones(rewards):
    right = """
def add(a, b): return a + b
def maximum(xs): return max(xs)
def reverse(s): return s[::-1]
def count_vowels(s): return sum(c in "aeiou" for c in s)
def is_even(n): return n % 2 == 0
def factorial(n): return 1 if n < 2 else n * factorial(n - 1)
def sum_list(xs): return sum(xs)
def square(n): return n * n
"""
    wrong = right.replace("a + b", "a * b").replace("s[::-1]", "s").replace("n * n", "n + n")
    tasks = rows(24, seed=3)
    assert len({text for text, _ in tasks}) > 4 and all(len(tests) == 3 for _, tests in tasks)
    values, _, _ = scores(rewards, [sample(py(right), tests) for _, tests in tasks])
    assert values == [1.0] * len(tasks)
    values, _, _ = scores(rewards, [sample(py(wrong), tests) for _, tests in tasks])
    assert min(values) == 0.0


def contained(rewards: Rewards, samples: list[Sample]) -> tuple[list[float], dict, float]:
    """Score ``samples``; then the job's process is as it was, nothing of the sandboxes is
    left, and a right answer still scores 1."""
    limits = {k: resource.getrlimit(k) for k in (resource.RLIMIT_NPROC, resource.RLIMIT_AS)}
    cwd, uid = os.getcwd(), os.getuid()
    values, metrics, seconds = scores(rewards, samples)
    assert {k: resource.getrlimit(k) for k in limits} == limits
    assert (os.getcwd(), os.getuid()) == (cwd, uid)
    assert sandboxed_processes() == []
    (after,), _, _ = scores(rewards, [sample(py("def add(a, b):\n    return a + b"), ADD)])
    assert after == 1.0
    return values, metrics, seconds


def test_an_infinite_loop_is_killed_at_the_wall_time_keeping_the_tests_passed_before(monkeypatch):
    loop = "def add(a, b):\n    return a + b\ndef spin():\n    while True:\n        pass"
    sleep = "import time\ntime.sleep(3600)"
    tests = ["assert add(1, 1) == 2", "spin()", "assert add(2, 2) == 4"]
    rewards = code_rewards(timeout_s=LIMIT_S)
    pool, limits = rewards.sandboxes["code"], []
    start = pool._start

    def started(*args):
        sandbox = start(*args)
        limits.append(args[-1])  # the wall time its deadline was set to
        return sandbox

    monkeypatch.setattr(pool, "_start", started)
    try:
        values, metrics, _ = contained(
            rewards, [sample(py(loop), tests), sample(py(sleep), ["assert True"])]
        )
    finally:
        rewards.close()
    # each timed out: the pool killed it at its deadline (the source's timeout_s), before the
    # sandbox's own alarm (wall_s + 1 s) would have ended it, which counts no timeout
    assert values == [1 / 3, 0.0] and metrics["reward/code/timeouts"] == 2
    assert limits[:2] == [LIMIT_S, LIMIT_S]  # then contained()'s right answer


def test_a_fork_bomb_stops_at_the_process_limit(rewards):
    bomb = "import os\nwhile True:\n    os.fork()"
    # forks children that live on until it cannot fork more: how many it got
    count = (
        "import os, time\nforked = 0\ntry:\n    while True:\n        if os.fork() == 0:\n"
        "            time.sleep(3600)\n        forked += 1\nexcept OSError:\n    pass"
    )
    values, metrics, seconds = contained(
        rewards, [sample(py(bomb), ["assert True"]), sample(py(count), ["assert 0 < forked < 8"])]
    )
    # it ended by itself, not at the wall time: the sandbox does not wait for its children
    assert values == [0.0, 1.0] and metrics["reward/code/timeouts"] == 0


def test_a_memory_hog_gets_memory_errors_at_its_limit():
    """Both end by a MemoryError, not at the wall time. The wall is long and the address space
    small: filling 512 MiB page by page beside CI's engines once took past the usual 3 s."""
    hog = (
        "blocks = []\ntry:\n    while True:\n        blocks.append(bytearray(1 << 24))\n"
        "except MemoryError:\n    blocks, stopped = [], True"
    )
    refused = (
        "try:\n    blob = bytearray(1 << 30)\n    got = True\nexcept MemoryError:\n    got = False"
    )
    rewards = code_rewards(timeout_s=60.0, memory_mb=128)
    try:
        values, metrics, _ = contained(
            rewards, [sample(py(hog), ["assert stopped"]), sample(py(refused), ["assert not got"])]
        )
    finally:
        rewards.close()
    assert values == [1.0, 1.0] and metrics["reward/code/timeouts"] == 0


def test_a_huge_output_fails_its_test_and_reaches_nothing(rewards):
    printed = "print('x' * 10**7)"  # past output_kb: its test fails
    written = "import os\nfor _ in range(100):\n    os.write(1, b'x' * 10**6)"  # to /dev/null
    big_file = (
        "try:\n    open('big', 'wb').write(b'x' * (64 << 20))\n    full = False\n"
        "except OSError as exc:\n    full = exc.errno == 27\n"  # EFBIG at disk_mb
    )
    values, _, _ = contained(
        rewards,
        [
            sample(py(printed), ["assert True"]),
            sample(py(written), ["assert True"]),
            sample(py(big_file), ["assert full"]),
        ],
    )
    assert values == [0.0, 1.0, 1.0]


def test_a_write_outside_its_directory_is_refused(rewards):
    """Places every uid may write to, outside /tmp: the read-only mounts refuse them (EROFS;
    fresh names, so no earlier file answers EACCES instead)."""
    name = f"relax-sandbox-{os.getpid()}-{time.monotonic_ns()}"
    outside = Path("/var/tmp") / name
    outside.mkdir(mode=0o777)
    outside.chmod(0o777)
    targets = [outside / "x", Path("/var/tmp") / f"{name}.y", Path("/dev/shm") / f"{name}.z"]
    this_file = Path(__file__).stat()
    try:
        attempt = (
            "import os\nfailures = []\n"
            f"for path in {[str(t) for t in targets] + [__file__]!r}:\n"
            "    try:\n        open(path, 'a').write('escaped')\n"
            "    except OSError as exc:\n        failures.append(exc.errno)\n"
            "open('/tmp/mine', 'w').write('ok')\n"
        )
        tests = [
            f"assert failures[:3] == [{errno.EROFS}] * 3, failures",
            "assert len(failures) == 4",
            "assert open('mine').read() == 'ok'",  # /tmp is its own, and its working directory
        ]
        values, _, _ = contained(rewards, [sample(py(attempt), tests)])
        assert values == [1.0]
        assert not any(t.exists() for t in targets)
        assert Path(__file__).stat().st_mtime_ns == this_file.st_mtime_ns
    finally:
        for target in targets:
            target.unlink(missing_ok=True)
        outside.rmdir()


def test_a_network_connection_reaches_nothing(rewards):
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    attempt = (
        "import socket\ntry:\n"
        f"    socket.create_connection(('127.0.0.1', {port}), timeout=2)\n    refused = None\n"
        "except OSError as exc:\n    refused = exc.errno\n"
    )
    try:
        values, _, seconds = contained(
            rewards, [sample(py(attempt), [f"assert refused == {errno.ENETUNREACH}, refused"])]
        )
        assert values == [1.0]  # ENETUNREACH: no route at all, not a timeout
        listener.settimeout(0.5)
        with pytest.raises(TimeoutError):
            listener.accept()
    finally:
        listener.close()


def test_the_sandbox_leaves_no_directory_behind(tmp_path):
    pool = CodeSandboxPool(CodeTestsConfig(uid=UID), scratch=str(tmp_path))
    writes = [("code_tests", (py("open('f', 'w').write('x')"), ["assert True"]))] * 3
    loop = [("code_tests", (py("while True: pass"), ["assert True"]))]
    outcomes = pool.run(writes, timeout_s=WALL_S) + pool.run(loop, timeout_s=1.0)
    assert [o.value for o in outcomes] == [1.0, 1.0, 1.0, 0.0] and outcomes[3].timed_out
    assert list(tmp_path.iterdir()) == []


def test_the_sandbox_check_leaves_no_descriptor_behind():
    """``sandbox_problem`` runs for every config check: its trial pool is closed."""
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(3):
        assert sandbox_problem(CodeTestsConfig(uid=UID)) is None
    assert len(os.listdir("/proc/self/fd")) == before


def test_a_stop_abandons_the_scoring_at_once_and_kills_its_sandboxes(rewards):
    """A stop raises ``StepAbandoned`` in the scoring thread from a signal handler (as
    runtime/stop.py's nudge does): the wait ends at once and no sandbox is left."""
    pool = rewards.sandboxes["code"]
    with abandoned_after(0.5, lambda: [s.deadline for s in pool.running]):  # at once
        rewards.score([sample(py("while True:\n    pass"), ["assert True"])] * 2)
    assert rewards.sandboxes["code"].running == [] and sandboxed_processes() == []
    (after,), _, _ = scores(rewards, [sample(py("def add(a, b):\n    return a + b"), ADD)])
    assert after == 1.0


def test_a_caller_is_not_held_behind_another_callers_batch():
    """A batch whose program loops until its wall time holds one sandbox slot; another
    thread's batch, submitted meanwhile, runs in the other slots and is answered while the
    loop still runs."""
    pool = CodeSandboxPool(CodeTestsConfig(uid=UID, concurrency=2))
    loop = [("code_tests", (py("while True:\n    pass"), ["assert True"]))]
    ended = []

    def spin():
        with pytest.raises(RuntimeError, match="closed"):  # by the close below
            pool.run(loop, timeout_s=WALL_S)
        ended.append(True)

    background = threading.Thread(target=spin, daemon=True)
    background.start()
    try:
        assert wait_until(lambda: pool.running, timeout_s=WALL_S)
        adds = [("code_tests", (py("def add(a, b):\n    return a + b"), ADD))] * 3
        assert [o.value for o in pool.run(adds, timeout_s=WALL_S)] == [1.0] * 3
        assert background.is_alive() and not pool.running[0].deadline.passed
    finally:
        pool.close()
    background.join(timeout=30)  # the close ends it
    assert not background.is_alive() and ended and sandboxed_processes() == []
