"""The schedules against a recording job (a unit test of ``rl/schedules.py`` and
``rl/runner.py`` only; the real job runs in ``test_rl_job.py``): synchronous steps, and
one-step off-policy steps whose next rollout overlaps training but never a weight sync; what a
stop abandons and what it lets finish."""

from __future__ import annotations

import dataclasses
import io
import json
import signal
import threading
import time
from types import SimpleNamespace

import pytest
from rich.console import Console
from torch.distributed import HashStore

from relax_launch.config import DataConfig
from relax_launch.deadline import wait_until
from relax_launch.rl.checkpoints import Checkpoints
from relax_launch.rl.config import AlgorithmConfig
from relax_launch.rl.context import RLContext
from relax_launch.rl.data import PromptCursor
from relax_launch.rl.interfaces import JobStopped
from relax_launch.rl.phases import RolloutBatch
from relax_launch.rl.report import MetricsLog
from relax_launch.rl.runner import run
from relax_launch.rl.samples import Sample
from relax_launch.rl.schedules import OffPolicy, Synchronous
from relax_launch.runtime.stop import NUDGE, StopRequest

PHASE_S = 0.5  # room for the next rollout to start while a step trains, on a loaded machine


class RecordingJob:
    """Trainer and engines as a timeline: what ran when, and the engines' weight version."""

    console = Console(file=io.StringIO())
    engines = SimpleNamespace(cancel_all=lambda why: None)  # collect is the test's

    def __init__(self, tmp_path) -> None:
        self.stop = StopRequest(0, tmp_path)  # never installed: a test sets its request
        self.engine_version = 0
        self.rollouts = 0
        self.events: list[tuple[str, float]] = []
        self.generating = threading.Event()
        self.synced_while_generating = False
        self.lock = threading.Lock()
        self.trains_until_stop: int | None = None  # that step trains until a stop is asked
        self.overlapped_steps = 0  # each step before it trains until the next rollout began

    def record(self, name: str) -> None:
        with self.lock:
            self.events.append((name, time.perf_counter()))

    def train_step(self, batch, spec) -> dict[str, float]:
        self.record("train-start")
        step = [n for n, _ in self.events].count("train-start")
        if step == self.trains_until_stop:
            self.stop.requested(wait_s=60)  # not a phase: its watcher may be late to ask
        else:
            if step < self.overlapped_steps:  # a loaded machine may start it late, not never
                wait_until(lambda: [n for n, _ in self.events].count("rollout-start") > step, 60)
            time.sleep(PHASE_S)
        self.record("train-end")
        return {"loss": 0.0}

    def engine_metrics(self) -> dict[str, float]:
        return {"rollout/engines_serving": 1.0}

    def save_trainer(self, directory: str) -> list[str]:
        self.record("save")
        return []

    def sync_weights(self, version: int) -> list[dict[str, float]]:
        self.synced_while_generating |= self.generating.is_set()
        self.engine_version = version
        self.record(f"sync-{version}")
        return []


class CountingFeed:
    """The prompt position as the number of rollouts made so far."""

    skipped = 0

    def __init__(self, job: RecordingJob) -> None:
        self.job = job

    def position(self) -> PromptCursor:
        return PromptCursor(seen=self.job.rollouts)


def fake_collect(ctx: RLContext, seconds: dict[str, float], fail_on: int | None = None):
    job: RecordingJob = ctx.job
    job.generating.set()
    job.record("rollout-start")
    version = str(job.engine_version)
    time.sleep(PHASE_S)
    job.record("rollout-end")
    job.generating.clear()
    job.rollouts += 1
    if job.rollouts == fail_on:
        raise RuntimeError("rollout engine went away")
    samples = [
        Sample(g, "q", "1", [1, 2], [3, 4], [-1.0, -1.0], "1", version, advantage=1.0)
        for g in range(2)
    ]
    seconds["rollout"] = PHASE_S
    batch_metrics = {"reward": 1.0, "tokens_per_s": 1.0}
    return RolloutBatch(samples, batch_metrics, dict(seconds), ctx.feed.position())


def context(tmp_path, collect=fake_collect) -> RLContext:
    job = RecordingJob(tmp_path)
    return RLContext(
        job=job,
        algorithm=AlgorithmConfig(n_samples_per_prompt=2),
        data=DataConfig(),
        feed=CountingFeed(job),
        tokenizer=None,
        rewards=None,
        log=MetricsLog(tmp_path),
        checkpoints=Checkpoints(tmp_path / "checkpoints", keep_last=0),
        checkpoint_every=None,
        generator=None,
        score=None,
        collect=collect,
    )


def run_schedule(ctx: RLContext, off_policy: bool, steps: int) -> list[dict[str, float]]:
    schedule = OffPolicy(ctx, steps) if off_policy else Synchronous(ctx)
    return run(ctx, schedule, steps, ctx.log.path.parent)


def test_synchronous_steps_train_on_the_latest_weights(tmp_path):
    ctx = context(tmp_path)
    history = run_schedule(ctx, off_policy=False, steps=3)
    assert [h["weight_version"] for h in history] == [0, 1, 2]
    assert [h["staleness"] for h in history] == [0, 0, 0]
    names = [n for n, _ in ctx.job.events]
    assert names == ["rollout-start", "rollout-end", "train-start", "train-end", "sync-1"] + [
        "rollout-start", "rollout-end", "train-start", "train-end", "sync-2",
        "rollout-start", "rollout-end", "train-start", "train-end", "sync-3",
    ]  # fmt: skip


def test_off_policy_overlaps_the_next_rollout_with_training_but_not_with_sync(tmp_path):
    ctx = context(tmp_path)
    ctx.job.overlapped_steps = 4
    history = run_schedule(ctx, off_policy=True, steps=4)
    job = ctx.job
    # batch k+1 is generated with the weights of step k while step k trains
    assert [h["weight_version"] for h in history] == [0, 0, 1, 2]
    assert [h["staleness"] for h in history] == [0, 1, 1, 1]
    assert [h["samples_stale"] for h in history] == [0, 0, 0, 0]
    assert not job.synced_while_generating
    times = dict.fromkeys(("rollout-start", "train-start", "train-end"), [])
    times = {name: [t for n, t in job.events if n == name] for name in times}
    for step in range(3):  # rollout of step+1 starts before training of step ends
        assert times["rollout-start"][step + 1] < times["train-end"][step]
    assert job.rollouts == 4  # one rollout per step, none wasted
    assert all(h["time/wait"] >= 0 for h in history[:-1]) and "time/wait" not in history[-1]


def test_a_failing_background_rollout_stops_the_run_with_its_error(tmp_path):
    ctx = context(tmp_path, lambda ctx, s: fake_collect(ctx, s, fail_on=3))
    with pytest.raises(RuntimeError, match="rollout engine went away"):
        run_schedule(ctx, off_policy=True, steps=5)
    # step 1 trained, the rollout of step 3 failed: no sync after the failure
    assert [n for n, _ in ctx.job.events if n.startswith("sync")] == ["sync-1"]


def test_the_background_rollout_is_waited_for_as_long_as_the_job_derived(tmp_path):
    """The wait is the context's rollout_wait_s (3 x gateway.request_timeout_s, sized by the
    batch: tests/config/test_derived_bounds.py), not a constant: scaled down here, a rollout
    that outlasts it fails naming the field, and one within it completes."""

    def slow_second(ctx, seconds):
        if ctx.job.rollouts == 1:  # the background rollout of step 2
            time.sleep(2 * PHASE_S)
        return fake_collect(ctx, seconds)

    short = dataclasses.replace(
        context(tmp_path / "short", slow_second), rollout_wait_s=PHASE_S / 5
    )
    with pytest.raises(TimeoutError, match=r"did not finish .* \(3 x gateway.request_timeout_s"):
        run_schedule(short, off_policy=True, steps=2)
    enough = dataclasses.replace(context(tmp_path / "enough", slow_second), rollout_wait_s=60)
    assert len(run_schedule(enough, off_policy=True, steps=2)) == 2


# ---- stopping: what a stop abandons, and what it lets finish ------------------------------


@pytest.fixture
def nudgeable():
    """Rank 0's handler of the watchdog's nudge, as ``StopRequest.install`` sets it (only that
    one: the test process keeps its own SIGINT and SIGTERM)."""
    installed = []

    def install(stop: StopRequest) -> None:
        installed.append(signal.signal(NUDGE, stop._on_nudge))

    yield install
    for previous in installed:
        signal.signal(NUDGE, previous)


def ask_to_stop_after(ctx: RLContext, event: str, count: int = 1) -> threading.Thread:
    """Write the STOP file once ``event`` was recorded ``count`` times, then poll as the
    watchdog does (every 0.1 s here) until the run is over."""
    job: RecordingJob = ctx.job

    def watch() -> None:
        while [n for n, _ in job.events].count(event) < count:
            time.sleep(0.01)
        (job.stop.stop_file).write_text("a test's request\n")
        while not job.finished.is_set():
            job.stop.poll(HashStore())
            time.sleep(0.1)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def stopping_run(ctx: RLContext, steps: int, off_policy: bool = False) -> JobStopped:
    job = ctx.job
    job.finished = threading.Event()
    try:
        with pytest.raises(JobStopped) as stopped:
            run_schedule(ctx, off_policy, steps)
    finally:
        job.at_stop = [n for n, _ in job.events]  # what had happened when the run ended
        job.finished.set()
    return stopped.value


def slow_second_rollout(ctx: RLContext, seconds: dict[str, float]) -> RolloutBatch:
    if ctx.job.rollouts == 1:  # the second call: a rollout (or reward) that takes a minute,
        ctx.job.record("slow-rollout-start")  # or until the run is over
        ctx.job.finished.wait(timeout=60)
        ctx.job.record("slow-rollout-end")
    return fake_collect(ctx, seconds)


def test_a_stop_while_the_batch_is_made_abandons_the_step_at_once(tmp_path, nudgeable):
    ctx = context(tmp_path, slow_second_rollout)
    nudgeable(ctx.job.stop)
    ask_to_stop_after(ctx, "slow-rollout-start")
    stopped = stopping_run(ctx, 5)
    assert stopped.step == 1 and stopped.reason == "a test's request"
    assert "slow-rollout-end" not in ctx.job.at_stop  # the run ended while it still ran
    names = [n for n, _ in ctx.job.events]
    assert names.count("train-start") == 1  # step 2 was not trained ...
    assert names[-2:] == ["slow-rollout-start", "save"]  # ... step 1 was saved
    assert ctx.checkpoints.newest()[0] == 1  # the last finished step, saved by the stop
    assert stopped.checkpoint == str(ctx.checkpoints.step_dir(1))  # what a resume takes


def test_a_stop_while_training_lets_the_step_finish_without_its_sync(tmp_path, nudgeable):
    ctx = context(tmp_path)
    nudgeable(ctx.job.stop)
    ctx.job.trains_until_stop = 2
    ask_to_stop_after(ctx, "train-start", count=2)
    stopped = stopping_run(ctx, 5)
    assert stopped.step == 2  # the step that was training counts ...
    names = [n for n, _ in ctx.job.events]
    assert names[-3:] == ["train-start", "train-end", "save"]  # ... saved, not synced
    assert ctx.checkpoints.newest()[0] == 2
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2]
    assert all(row["rollout/engines_serving"] == 1.0 for row in rows)  # unsynced step too


def test_off_policy_a_stop_abandons_the_background_rollout_not_the_trained_step(
    tmp_path, nudgeable
):
    ctx = context(tmp_path, slow_second_rollout)
    nudgeable(ctx.job.stop)
    ask_to_stop_after(ctx, "train-end")  # step 1 trained; step 2's rollout takes a minute
    stopped = stopping_run(ctx, 5, off_policy=True)
    assert stopped.step == 1 and "slow-rollout-end" not in ctx.job.at_stop
    assert [n for n, _ in ctx.job.events if n.startswith("sync")] == []
    assert ctx.checkpoints.newest()[0] == 1
