"""The ``builtin:math_verify`` reward with real math-verify in real worker processes: right,
wrong and malformed answers; an answer that makes math-verify hang is cut at the source's
``timeout_s`` (reward 0, counted), its worker killed by PID and replaced, the step going on;
no worker outlives the pool or its parent."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

import psutil
import pytest
from harness.stop_signal import abandoned_after

from relax_launch.deadline import wait_until
from relax_launch.rl.config import RewardConfig
from relax_launch.rl.reward_pool import ScoringPool
from relax_launch.rl.rewards import RewardError, Rewards
from relax_launch.rl.samples import Sample

# sympy evaluates the power tower: math-verify never returns (measured: still running at 60 s)
HANGS = r"The answer is \boxed{9^{9^{9^{9^{9}}}}}"
LIMIT_S = 3.0  # a right answer takes ~0.05 s; room for a loaded machine


def sample(text: str, label: str | None) -> Sample:
    return Sample(0, "q", label, [1], [2], [0.0], text, "1")


def limited(timeout_s: float) -> Rewards:
    return Rewards(
        RewardConfig(
            sources=[{"name": "math", "function": "builtin:math_verify", "timeout_s": timeout_s}]
        )
    )


@pytest.fixture(scope="module")
def rewards():
    rewards = limited(timeout_s=30)  # no answer of these tests hangs
    yield rewards
    rewards.close()


@pytest.fixture
def own_rewards():
    """A pool of the test's own: the workers it replaces are stopped with it."""
    rewards = limited(LIMIT_S)
    yield rewards
    rewards.close()


@pytest.mark.parametrize(
    ("text", "label", "reward"),
    [
        (r"So the result is $\boxed{\frac{1}{2}}$.", "0.5", 1.0),
        (r"We get $x = \frac{\sqrt{8}}{2}$", r"\sqrt{2}", 1.0),
        ("<answer>-3579</answer>", "-3579", 1.0),  # reasoning-gym's answer tags
        (r"\boxed{3}", "2", 0.0),
        (r"\boxed{\frac{1}{3}}", "0.5", 0.0),
        ("I do not know.", "2", 0.0),  # no answer at all
        (r"\boxed{\frac{1}{", "2", 0.0),  # malformed LaTeX
    ],
)
def test_answers_right_wrong_and_malformed(rewards, text, label, reward):
    s = sample(text, label)
    metrics = rewards.score([s])
    assert s.rewards["math"] == reward and metrics["reward/math/failed"] == 0


def test_a_row_without_a_label_fails_the_source(rewards):
    unlabelled, labelled = sample(r"\boxed{2}", None), sample(r"\boxed{2}", "2")
    metrics = rewards.score([unlabelled, labelled])
    assert metrics["reward/math/failed"] == 1 and not unlabelled.valid
    assert labelled.rewards["math"] == 1.0


def test_a_hanging_answer_costs_its_limit_and_its_worker_not_the_step(own_rewards):
    rewards = own_rewards
    rewards.score([sample(r"\boxed{1}", "1")] * 4)  # the workers are up (imports done)
    before = {w.process.pid for w in rewards.pool.workers}
    samples = [sample(HANGS, "1")] + [sample(rf"\boxed{{{n}}}", str(n)) for n in range(6)]
    limits = []  # each call's limit, as its worker took it
    for worker in rewards.pool.workers:
        send = worker.send

        def sent(index, call, timeout_s, send=send):
            limits.append(timeout_s)
            send(index, call, timeout_s)

        worker.send = sent
    metrics = rewards.score(samples)
    assert metrics["reward/math/timeouts"] == 1 and metrics["reward/math/failed"] == 0
    assert samples[0].valid and samples[0].rewards["math"] == 0.0
    assert [s.rewards["math"] for s in samples[1:]] == [1.0] * 6  # the others, scored
    # the hanging call alone ended at its limit, the source's timeout_s, each call's own
    assert limits and set(limits) == {LIMIT_S}
    after = {w.process.pid for w in rewards.pool.workers}
    killed = before - after
    assert len(killed) == 1 and len(after) == len(before)  # killed by PID, replaced
    assert not any(psutil.pid_exists(pid) for pid in killed)
    assert all(psutil.Process(pid).is_running() for pid in after)
    again = sample(r"\boxed{7}", "7")  # the replacement scores the next step
    assert rewards.score([again])["reward/math/timeouts"] == 0 and again.rewards["math"] == 1.0


def test_close_stops_every_worker():
    rewards = Rewards(RewardConfig(sources=[{"name": "m", "function": "builtin:math_verify"}]))
    pids = [w.process.pid for w in rewards.pool.workers]
    rewards.close()
    assert not any(psutil.pid_exists(pid) for pid in pids)


# a parent whose two workers are busy with answers that hang (so they never read the closed
# pipe): it prints their PIDs once both are scoring
PARENT = """
import threading, time
from relax_launch.rl.reward_pool import ScoringPool
pool = ScoringPool(2)
calls = [("math_verify", (HANG, "1"))] * 2
threading.Thread(target=pool.run, args=(calls, 600), daemon=True).start()
while not all(w.call for w in pool.workers):
    time.sleep(0.1)
print(*[w.process.pid for w in pool.workers], flush=True)
input()
"""


def test_workers_die_with_a_killed_parent():
    parent = subprocess.Popen(
        [sys.executable, "-c", f"HANG = {HANGS!r}\n" + PARENT],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    pids = [int(p) for p in parent.stdout.readline().split()]
    assert all(psutil.pid_exists(pid) for pid in pids)
    os.kill(parent.pid, signal.SIGKILL)  # no atexit, no close: only PDEATHSIG can stop them
    parent.wait(timeout=10)
    gone = wait_until(lambda: not any(_alive(pid) for pid in pids), timeout_s=10)
    assert gone, f"orphaned scoring workers: {pids}"


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_a_stop_abandons_the_scoring_at_once_and_the_pool_stays_usable(own_rewards):
    """A stop raises ``StepAbandoned`` in rank 0's main thread from a signal handler (as
    runtime/stop.py's nudge does): the wait on the workers ends at once, and the worker whose
    reply is late is replaced, so the next step's calls get their own answers."""
    rewards = own_rewards
    rewards.score([sample(r"\boxed{1}", "1")] * 2)  # the workers are up
    pool = rewards.pool
    with abandoned_after(0.5, lambda: [w.call[1] for w in pool.workers if w.call]):  # at once
        rewards.score([sample(HANGS, "1"), sample(HANGS, "1")])
    assert not any(w.call for w in rewards.pool.workers)
    after = [sample(rf"\boxed{{{n}}}", str(n)) for n in (5, 6)]
    rewards.score(after)
    assert [s.rewards["math"] for s in after] == [1.0, 1.0]


def test_a_worker_that_cannot_start_fails_the_call_instead_of_respawning(monkeypatch):
    monkeypatch.setattr(sys, "executable", "/bin/false")  # exits at once, before "ready"
    pool = ScoringPool(1)
    try:
        with pytest.raises(RuntimeError, match="exited on start"):
            pool.run([("math_verify", (r"\boxed{1}", "1"))], timeout_s=5)
    finally:
        pool.close()
    with pytest.raises(RuntimeError, match="closed"):
        pool.run([("math_verify", (r"\boxed{1}", "1"))], timeout_s=5)


def test_two_threads_score_at_once_each_with_its_own_answers_and_counts(own_rewards):
    """An off-policy step scores on its thread while the main thread evaluates."""
    rewards = own_rewards
    results = {}

    def score(name, samples):
        results[name] = (rewards.score(samples), [s.rewards["math"] for s in samples])

    hanging = [sample(HANGS, "1")] + [sample(rf"\boxed{{{n}}}", str(n)) for n in range(20)]
    thread = threading.Thread(target=score, args=("background", hanging))
    thread.start()
    score("main", [sample(rf"\boxed{{{n}}}", str(n + 1)) for n in range(20)])  # all wrong
    thread.join(timeout=60)
    assert results["main"][1] == [0.0] * 20 and results["main"][0]["reward/math/timeouts"] == 0
    assert results["background"][1] == [0.0] + [1.0] * 20
    assert results["background"][0]["reward/math/timeouts"] == 1


def test_closing_the_pool_ends_a_scoring_still_in_flight_at_once():
    """The job's end closes the pool while a background step may still be scoring: that
    scoring ends at once (its source failed), it neither hangs nor starts new workers."""
    rewards = limited(timeout_s=60)
    outcome = {}

    def score():
        try:
            rewards.score([sample(HANGS, "1")])
        except RewardError as exc:
            outcome["error"] = str(exc)

    thread = threading.Thread(target=score)
    thread.start()
    assert wait_until(lambda: any(w.call for w in rewards.pool.workers), timeout_s=60)
    rewards.close()
    thread.join(timeout=120)  # past the call's 60 s limit: a scoring the close left ends there
    # ended by the close (its source failed: "closed"), not at its limit (a timeout)
    assert not thread.is_alive() and "closed" in outcome["error"]
    assert rewards.pool.workers == []


def test_only_the_builtin_names_score_in_the_pool():
    """A user function whose module name is as long as 'builtin:' is not a pooled built-in."""
    sources = [
        {"name": "pooled", "function": "builtin:math_verify"},
        {"name": "user", "function": "rewards:math_verify"},
    ]
    pooled, user = RewardConfig(sources=sources).sources
    assert pooled.pooled and not user.pooled


def test_a_caller_is_not_held_behind_another_callers_batch():
    """An off-policy step's batch with a call that hangs until its limit holds one worker;
    the main thread's batch, submitted meanwhile, is answered on the others while that call is
    still in flight (the pool serves both batches, not one batch at a time)."""
    pool = ScoringPool(2)
    try:
        pool.run([("math_verify", (r"\boxed{1}", "1"))] * 2, timeout_s=60)  # the workers are up
        ended = []

        def hang():
            with pytest.raises(RuntimeError, match="closed"):  # by the close below
                pool.run([("math_verify", (HANGS, "1"))], timeout_s=120)
            ended.append(True)

        background = threading.Thread(target=hang, daemon=True)
        background.start()
        assert wait_until(lambda: any(w.call for w in pool.workers), timeout_s=60)
        calls = [("math_verify", (rf"\boxed{{{n}}}", str(n))) for n in range(4)]
        assert [o.value for o in pool.run(calls, timeout_s=60)] == [1.0] * 4
        hanging = [w.call[1] for w in pool.workers if w.call]
        assert background.is_alive() and hanging and not hanging[0].passed
    finally:
        pool.close()
    background.join(timeout=30)  # the close ends it
    assert not background.is_alive() and ended
