"""The loop's schedule against a recording session (a unit test of ``rl/loop.py`` only; the real
job runs in ``test_rl_job.py``): synchronous steps, and one-step off-policy steps whose next
rollout overlaps training but never a weight sync."""

from __future__ import annotations

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
from relax_launch.rl import loop
from relax_launch.rl.config import AlgorithmConfig
from relax_launch.rl.data import PromptCursor
from relax_launch.rl.loop import RLContext, RolloutBatch
from relax_launch.rl.report import MetricsLog
from relax_launch.rl.runner import run
from relax_launch.rl.samples import Sample
from relax_launch.runtime.checkpoint import Checkpoints
from relax_launch.runtime.stop import NUDGE, JobStopped, StopRequest

PHASE_S = 0.5  # room for the next rollout to start while a step trains, on a loaded machine


class RecordingSession:
    """Trainer and engines as a timeline: what ran when, and the engines' weight version."""

    console = Console(file=io.StringIO())

    def __init__(self, tmp_path) -> None:
        self.stop = StopRequest(0, tmp_path)  # never installed: a test sets its request
        self.engine_version = 0
        self.events: list[tuple[str, float]] = []
        self.generating = threading.Event()
        self.synced_while_generating = False
        self.lock = threading.Lock()

    def stop_requested(self, wait_s: float = 0.0) -> str | None:
        return self.stop.requested(wait_s)

    def record(self, name: str) -> None:
        with self.lock:
            self.events.append((name, time.perf_counter()))

    def train_step(self, batch, spec) -> dict[str, float]:
        self.record("train-start")
        time.sleep(PHASE_S)
        self.record("train-end")
        return {"loss": 0.0}

    def engine_metrics(self) -> dict[str, float]:
        return {}

    def save_trainer(self, directory: str) -> list[str]:
        self.record("save")
        return []

    def sync_weights(self, version: int) -> list[dict[str, float]]:
        self.synced_while_generating |= self.generating.is_set()
        self.engine_version = version
        self.record(f"sync-{version}")
        return []


def fake_collect(ctx: RLContext, seconds: dict[str, float], fail_on: int | None = None):
    session: RecordingSession = ctx.session
    session.generating.set()
    session.record("rollout-start")
    version = str(session.engine_version)
    time.sleep(PHASE_S)
    session.record("rollout-end")
    session.generating.clear()
    ctx.skipped_prompts += 1  # counts calls
    if ctx.skipped_prompts == fail_on:
        raise RuntimeError("rollout engine went away")
    samples = [
        Sample(g, "q", "1", [1, 2], [3, 4], [-1.0, -1.0], "1", version, advantage=1.0)
        for g in range(2)
    ]
    seconds["rollout"] = PHASE_S
    cursor = PromptCursor(seen=ctx.skipped_prompts)
    return RolloutBatch(samples, {"reward": 1.0, "tokens_per_s": 1.0}, dict(seconds), cursor)


def context(tmp_path, off_policy_steps: int) -> RLContext:
    return RLContext(
        session=RecordingSession(tmp_path),
        algorithm=AlgorithmConfig(n_samples_per_prompt=2, off_policy_steps=off_policy_steps),
        data=DataConfig(),
        prompts=None,
        tokenizer=None,
        rewards=None,
        log=MetricsLog(tmp_path),
        has_teacher=False,
        engines=SimpleNamespace(cancel_all=lambda why: None),  # collect is replaced
        checkpoints=Checkpoints(tmp_path / "checkpoints", keep_last=0),
        checkpoint_every=None,
    )


def test_synchronous_steps_train_on_the_latest_weights(tmp_path, monkeypatch):
    monkeypatch.setattr(loop, "collect", fake_collect)
    ctx = context(tmp_path, off_policy_steps=0)
    history = run(ctx, 3, tmp_path)
    assert [h["weight_version"] for h in history] == [0, 1, 2]
    assert [h["staleness"] for h in history] == [0, 0, 0]
    names = [n for n, _ in ctx.session.events]
    assert names == ["rollout-start", "rollout-end", "train-start", "train-end", "sync-1"] + [
        "rollout-start", "rollout-end", "train-start", "train-end", "sync-2",
        "rollout-start", "rollout-end", "train-start", "train-end", "sync-3",
    ]  # fmt: skip


def test_off_policy_overlaps_the_next_rollout_with_training_but_not_with_sync(
    tmp_path, monkeypatch
):
    monkeypatch.setattr(loop, "collect", fake_collect)
    ctx = context(tmp_path, off_policy_steps=1)
    history = run(ctx, 4, tmp_path)
    session = ctx.session
    # batch k+1 is generated with the weights of step k while step k trains
    assert [h["weight_version"] for h in history] == [0, 0, 1, 2]
    assert [h["staleness"] for h in history] == [0, 1, 1, 1]
    assert [h["samples_stale"] for h in history] == [0, 0, 0, 0]
    assert not session.synced_while_generating
    times = dict.fromkeys(("rollout-start", "train-start", "train-end"), [])
    times = {name: [t for n, t in session.events if n == name] for name in times}
    for step in range(3):  # rollout of step+1 starts before training of step ends
        assert times["rollout-start"][step + 1] < times["train-end"][step]
    assert ctx.skipped_prompts == 4  # one rollout per step, none wasted
    assert all(h["time/wait"] >= 0 for h in history[:-1]) and "time/wait" not in history[-1]


def test_a_failing_background_rollout_stops_the_run_with_its_error(tmp_path, monkeypatch):
    monkeypatch.setattr(loop, "collect", lambda ctx, s: fake_collect(ctx, s, fail_on=3))
    ctx = context(tmp_path, off_policy_steps=1)
    with pytest.raises(RuntimeError, match="rollout engine went away"):
        run(ctx, 5, tmp_path)
    # step 1 trained, the rollout of step 3 failed: no sync after the failure
    assert [n for n, _ in ctx.session.events if n.startswith("sync")] == ["sync-1"]


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
    session: RecordingSession = ctx.session

    def watch() -> None:
        while [n for n, _ in session.events].count(event) < count:
            time.sleep(0.01)
        (session.stop.stop_file).write_text("a test's request\n")
        session.asked = time.perf_counter()
        while not session.finished.is_set():
            session.stop.poll(HashStore())
            time.sleep(0.1)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def stopping_run(ctx: RLContext, steps: int) -> JobStopped:
    session = ctx.session
    session.finished = threading.Event()
    try:
        with pytest.raises(JobStopped) as stopped:
            run(ctx, steps, ctx.log.path.parent)
    finally:
        session.finished.set()
    session.stop_seconds = time.perf_counter() - session.asked
    return stopped.value


def slow_second_rollout(ctx: RLContext, seconds: dict[str, float]) -> RolloutBatch:
    if ctx.skipped_prompts == 1:  # the second call: a rollout (or reward) that takes a minute
        ctx.session.record("slow-rollout-start")
        time.sleep(60)
    return fake_collect(ctx, seconds)


def test_a_stop_while_the_batch_is_made_abandons_the_step_at_once(tmp_path, monkeypatch, nudgeable):
    monkeypatch.setattr(loop, "collect", slow_second_rollout)
    ctx = context(tmp_path, off_policy_steps=0)
    nudgeable(ctx.session.stop)
    ask_to_stop_after(ctx, "slow-rollout-start")
    stopped = stopping_run(ctx, 5)
    assert stopped.step == 1 and stopped.reason == "a test's request"
    assert ctx.session.stop_seconds < 5  # not the minute the rollout would take
    names = [n for n, _ in ctx.session.events]
    assert names.count("train-start") == 1  # step 2 was not trained ...
    assert names[-2:] == ["slow-rollout-start", "save"]  # ... step 1 was saved
    assert ctx.checkpoints.newest()[0] == 1  # the last finished step, saved by the stop
    end = json.loads((tmp_path / "end.json").read_text())
    assert end["state"] == "stopped" and end["step"] == 1 and "--resume" in end["resume"]


def test_a_stop_while_training_lets_the_step_finish_without_its_sync(
    tmp_path, monkeypatch, nudgeable
):
    monkeypatch.setattr(loop, "collect", fake_collect)
    ctx = context(tmp_path, off_policy_steps=0)
    nudgeable(ctx.session.stop)
    ask_to_stop_after(ctx, "train-start", count=2)
    stopped = stopping_run(ctx, 5)
    assert stopped.step == 2  # the step that was training counts ...
    names = [n for n, _ in ctx.session.events]
    assert names[-3:] == ["train-start", "train-end", "save"]  # ... saved, not synced
    assert ctx.checkpoints.newest()[0] == 2


def test_off_policy_a_stop_abandons_the_background_rollout_not_the_trained_step(
    tmp_path, monkeypatch, nudgeable
):
    monkeypatch.setattr(loop, "collect", slow_second_rollout)
    ctx = context(tmp_path, off_policy_steps=1)
    nudgeable(ctx.session.stop)
    ask_to_stop_after(ctx, "train-end")  # step 1 trained; step 2's rollout takes a minute
    stopped = stopping_run(ctx, 5)
    assert stopped.step == 1 and ctx.session.stop_seconds < 5
    assert [n for n, _ in ctx.session.events if n.startswith("sync")] == []
    assert ctx.checkpoints.newest()[0] == 1
