"""A stop at real step lengths, for real: a job whose step takes over a minute (its reward
function is slow from the second step on) is stopped by SIGTERM to ``relax-launch run``, then
resumed with the command it printed, then stopped by Ctrl-C (SIGINT to the command's process
group, as a terminal sends it). Each stop abandons the step in flight, checkpoints the last
finished step into the run directory (``checkpoint.dir`` is unset), exits 75 and leaves no
process; the resumed run scores the prompts of the abandoned step first. The seconds from the
signal until the last process is gone are printed (``-s``) beside the step's length.

``decoupled`` runs in the default suite; ``defer`` (every role handed back before the stop) and
the other schedules (one-step off-policy, fully asynchronous, split, agentic) are marked slow.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from harness.processes import TEST_TAG, processes_tagged

pytestmark = pytest.mark.e2e
HERE = Path(__file__).parent
RL_TESTS = HERE.parent / "rl"
SLOW_S = 60.0  # the slow reward alone: a step lasts longer than this
STOP_BOUND_S = 30.0  # Slurm's default KillWait between its SIGTERM and its SIGKILL
STOPPED = 75


class Run:
    """``relax-launch run`` with the slow reward; console and reward calls in files."""

    def __init__(self, args: list[str], workdir: Path, name: str) -> None:
        self.rewards = workdir / f"rewards-{name}.jsonl"
        self.console = workdir / f"console-{name}.txt"
        cli = Path(sys.executable).with_name("relax-launch")
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(HERE), str(RL_TESTS)]),  # the test functions
            "RELAX_TEST_REWARD_LOG": str(self.rewards),
            "RELAX_TEST_SLOW_S": str(SLOW_S),
        }
        with open(self.console, "w") as console:
            self.process = subprocess.Popen(
                [str(cli), "run", *args],
                stdout=console,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,  # its own process group, as in a terminal
            )

    def calls(self) -> list[dict]:
        text = self.rewards.read_text() if self.rewards.is_file() else ""
        return [json.loads(line) for line in text.split("\n")[:-1]]

    def wait_for_call(self, number: int, timeout_s: float = 400) -> dict:
        """The reward function's ``number``-th call of this run, once it began."""
        deadline = time.monotonic() + timeout_s
        while len(calls := self.calls()) < number:
            assert self.process.poll() is None, self.text()
            assert time.monotonic() < deadline, f"no reward call {number} in {timeout_s} s"
            time.sleep(0.2)
        return calls[number - 1]

    def stop(self, signum: int) -> float:
        """Signal the command (SIGINT: its whole process group, like Ctrl-C in a terminal);
        the seconds until every process of the job is gone."""
        began = time.monotonic()
        if signum == signal.SIGINT:
            os.killpg(self.process.pid, signum)
        else:
            self.process.send_signal(signum)
        tag = os.environ[TEST_TAG]
        while processes_tagged(tag) and time.monotonic() - began < 120:
            time.sleep(0.1)
        assert not processes_tagged(tag), [p.cmdline() for p in processes_tagged(tag)]
        return time.monotonic() - began

    def finish(self) -> int:
        try:
            return self.process.wait(timeout=60)
        finally:
            if self.process.poll() is None:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()

    def text(self) -> str:
        return self.console.read_text()


def stop_during_the_slow_step(run: Run, signum: int, run_dir: Path) -> tuple[dict, dict, float]:
    """Wait until the reward function's slow call (the second step of this run) began, stop the
    job with ``signum``; returns that call, the end record and the stop's seconds."""
    slow = run.wait_for_call(2)
    assert slow["slow"]
    time.sleep(2)  # well inside the slow reward
    seconds = run.stop(signum)
    code = run.finish()
    console = run.text()
    assert code == STOPPED, console[-4000:]
    end = json.loads((run_dir / "end.json").read_text())
    assert end["state"] == "stopped", end
    checkpoint = run_dir / "checkpoints" / f"step_{end['step']:06d}"
    assert end["checkpoint"] == str(checkpoint) and (checkpoint / "COMPLETE").is_file()
    last = console.strip().splitlines()[-1]
    assert last.endswith(f"resume with: {end['resume']}"), console[-3000:]
    assert seconds < STOP_BOUND_S, f"the stop took {seconds:.1f} s: {console[-3000:]}"
    return slow, end, seconds


def resumed(end: dict, workdir: Path, name: str) -> Run:
    """The command the stopped run printed, run as printed (with this environment's CLI)."""
    command = shlex.split(end["resume"])
    assert command[:2] == ["relax-launch", "run"] and command[-1] == "--resume"
    return Run(command[2:], workdir, name)


def stop_twice_and_resume(
    config: Path, tmp_path: Path, *overrides: str, same_prompts: bool = True
) -> dict[str, object]:
    """SIGTERM in the second step, resume, Ctrl-C in the resumed run's second step; returns the
    run directory and the two end records. ``same_prompts``: the resumed run first scores the
    abandoned step's prompts (a fully asynchronous rollout skips the prompts it had in flight)."""
    run_dir = tmp_path / "run"
    args = [str(config), f"logging.dir={run_dir}", *overrides]
    first = Run(args, tmp_path, "1")
    abandoned, end, by_sigterm = stop_during_the_slow_step(first, signal.SIGTERM, run_dir)
    assert end["reason"] == "SIGTERM to relax-launch run" and end["step"] == 1, end
    again = resumed(end, tmp_path, "2")
    # the resumed run's first step scores the prompts of the step that was abandoned
    first_call = again.wait_for_call(1)
    assert (first_call["questions"] == abandoned["questions"]) is same_prompts
    _, end2, by_ctrl_c = stop_during_the_slow_step(again, signal.SIGINT, run_dir)
    assert end2["reason"] == "SIGINT (Ctrl-C) to relax-launch run" and end2["step"] == 2, end2
    assert f"resuming from {end['checkpoint']}: step 1" in again.text()
    rows = [json.loads(r) for r in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2]
    print(
        f"\n{config.stem} {' '.join(overrides)}: steps of over {SLOW_S:.0f} s; "
        f"stopped by SIGTERM in {by_sigterm:.1f} s,"
        f" by Ctrl-C in {by_ctrl_c:.1f} s (signal to the last process gone)"
    )
    return {"run_dir": run_dir, "ends": (end, end2)}


def test_a_decoupled_job_stops_within_seconds_of_a_signal_and_resumes_where_it_stopped(
    tmp_path,
):
    stop_twice_and_resume(HERE / "stop_decoupled_tiny.yaml", tmp_path)


@pytest.mark.slow
def test_a_defer_job_hands_every_role_back_before_it_stops(tmp_path):
    result = stop_twice_and_resume(HERE / "stop_defer_tiny.yaml", tmp_path)
    events = [
        json.loads(line)
        for line in (result["run_dir"] / "coordinator.jsonl").read_text().splitlines()
    ]
    # each run appends its own events, its clock starting at 0
    runs = [0, *(i for i in range(1, len(events)) if events[i]["t"] < events[i - 1]["t"])]
    assert len(runs) == 2
    for begin, end in zip(runs, [*runs[1:], len(events)], strict=True):
        assert_handed_back(events[begin:end])


def test_a_stop_during_start_up_ends_the_job_at_once(tmp_path):
    run_dir = tmp_path / "run"
    run = Run([str(HERE / "stop_decoupled_tiny.yaml"), f"logging.dir={run_dir}"], tmp_path, "1")
    deadline = time.monotonic() + 120
    while "starting engines" not in run.text():  # the ranks are up, the engines loading
        assert run.process.poll() is None and time.monotonic() < deadline, run.text()
        time.sleep(0.1)
    seconds = run.stop(signal.SIGTERM)
    assert run.finish() == STOPPED, run.text()
    end = json.loads((run_dir / "end.json").read_text())
    assert end["state"] == "stopped" and end["checkpoint"] is None, end
    assert run.text().strip().endswith("before the first step; nothing to resume: run it again")
    assert not run.calls() and seconds < 15, seconds  # not after the start-up
    print(f"\nstopped during start-up in {seconds:.1f} s")


def assert_handed_back(events: list[dict]) -> None:
    """After the failed (abandoned) batch: every inference role that held memory offloads it,
    confirmed, then the trainer holds its whole state again."""
    failed = max(i for i, e in enumerate(events) if e["event"] == "fail")
    after = events[failed:]
    holding = [role for role in events[failed]["holders"] if role != "trainer"]
    assert holding, events[failed]  # the stop came while an engine held the ranks
    for role in holding:
        assert any(e["event"] == "release" and e.get("role") == role for e in after), after
    granted = [i for i, e in enumerate(after) if e["event"] == "grant" and e["role"] == "trainer"]
    confirmed = [e for e in after[granted[-1] :] if e["event"] == "confirm"]
    assert confirmed and confirmed[0]["role"] == "trainer", after
    assert after[-1]["holders"] == {"trainer": ["grads", "optimizer", "params"]}, after[-1]


@pytest.mark.slow
@pytest.mark.parametrize(
    "config,overrides,same_prompts",
    [
        ("stop_decoupled_tiny.yaml", ["algorithm.off_policy_steps=1"], True),
        ("stop_decoupled_tiny.yaml", ["algorithm.max_staleness=1"], False),
        ("stop_defer_tiny.yaml", ["placement.mode=split"], True),
        ("stop_decoupled_tiny.yaml", ["rollout.function=tiny_agent:two_turns"], True),
    ],
    ids=["off-policy", "fully-async", "split", "agentic"],
)
def test_every_schedule_stops_within_seconds_and_resumes(tmp_path, config, overrides, same_prompts):
    stop_twice_and_resume(HERE / config, tmp_path, *overrides, same_prompts=same_prompts)
