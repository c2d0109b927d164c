"""Restarting a failed job by itself (``cluster.max_restarts``, ``commands/restarts.py``).

The decision is a pure function, tested case by case. The loop is ``relax-launch run``'s own
(``launcher.run_local``) around real torchrun runs of ``fake_job.py``, a stand-in for the job
that leaves metrics rows, checkpoints and an end record as told, so each case takes seconds; the
real job killed for real is ``test_restart_job.py``. Notifications go to a real local webhook.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from harness.webhook import webhook

from relax_launch.commands import supervise
from relax_launch.commands.launcher import run_local
from relax_launch.commands.restarts import RESTARTS_FILE, Death, decide, resume_args
from relax_launch.commands.sbatch import SbatchOptions, render
from relax_launch.commands.status import job_status, render_status
from relax_launch.config import load_config
from relax_launch.config.errors import ConfigError
from relax_launch.placement import plan

FAKE_JOB = Path(__file__).parent / "fake_job.py"
DEATH = Death("rank 1 (trainer[tp0 pp0 dp1]) was killed by SIGKILL", 1, at=10_000.0, last_step=3)


def row(restart: int, time: float, resumed_step: int, cause: str = DEATH.cause) -> dict:
    return {"restart": restart, "time": time, "cause": cause, "resumed_step": resumed_step}


def test_a_death_after_a_checkpoint_restarts_from_it():
    decision = decide(DEATH, 3, [], max_restarts=2, window_s=3600)
    assert decision.restart and decision.step == 3 and decision.reason == "restart 1 of 2"


def test_no_restart_without_a_checkpoint_or_when_off():
    assert decide(DEATH, None, [], 2, 3600).reason == "it failed before its first checkpoint"
    assert not decide(DEATH, 3, [], 0, 3600).restart


def test_the_same_failure_with_no_newer_checkpoint_is_not_restarted():
    decision = decide(DEATH, 3, [row(1, 9_000.0, 3)], 5, 3600)
    assert not decision.restart and "the same failure again" in decision.reason
    again = Death("rank 1 (trainer[tp0 pp0 dp1], node 0) died (process 200)", 1, 10_000.0, 3)
    first = row(1, 9_000.0, 3, cause="rank 1 (trainer[tp0 pp0 dp1], node 0) died (process 100)")
    assert not decide(again, 3, [first], 5, 3600).restart  # another process, the same failure
    # a newer checkpoint since, or another cause: it made progress, or it is another failure
    assert decide(DEATH, 4, [row(1, 9_000.0, 3)], 5, 3600).restart
    assert decide(DEATH, 3, [row(1, 9_000.0, 3, cause="rank 0 died")], 5, 3600).restart


def test_restarts_are_counted_within_the_window():
    history = [row(1, 1_000.0, 1), row(2, 9_000.0, 2)]
    assert decide(DEATH, 3, history, 2, window_s=3600).restart  # the first has aged out
    refused = decide(DEATH, 3, history, 2, window_s=10_000)
    assert not refused.restart and refused.reason.startswith("2 restarts within")


def test_resume_args_replace_any_resume_setting():
    assert resume_args(["c.yaml", "checkpoint.resume=false", "a=1"]) == [
        "c.yaml",
        "a=1",
        "checkpoint.resume=true",
    ]


def test_restarts_need_checkpoints_and_notify_urls_are_checked():
    with pytest.raises(ConfigError, match=r"cluster.max_restarts=2 .* checkpoint.dir"):
        load_config("configs/quickstart_cpu.yaml", ["cluster.max_restarts=2"])
    with pytest.raises(ConfigError, match=r"logging.notify: \[1\] 'nope://x' is not"):
        load_config(
            "configs/quickstart_cpu.yaml", ["logging.notify=[json://127.0.0.1:9, nope://x]"]
        )


class FakeRun:
    """``run_local`` of ``fake_job.py`` with ``actions`` (one per torchrun run)."""

    def __init__(self, tmp_path: Path, monkeypatch, actions: list[dict], *overrides: str):
        self.run_dir, self.runs = tmp_path / "run", tmp_path / "runs.jsonl"
        config = tmp_path / "fake.yaml"
        config.write_text(
            "name: fake\n"
            "cluster: {nnodes: 1, nproc_per_node: 2, device: cpu, max_restarts: 2}\n"
            "trainer: {model: 'builtin:tiny-llama', ranks: 1}\n"
            "rollout: {ranks: 1, engine: {max_total_tokens: 2048}}\n"
            "data: {prompts_per_step: 2}\n"
            "algorithm: {n_samples_per_prompt: 2, num_steps: 6}\n"
            f"checkpoint: {{dir: {tmp_path / 'ck'}, every_steps: 1}}\n"
            f"logging: {{dir: {self.run_dir}}}\n"
        )
        self.args = [str(config), *overrides]
        monkeypatch.setenv("FAKE_JOB_ACTIONS", json.dumps(actions))
        monkeypatch.setenv("FAKE_JOB_RUNS", str(self.runs))
        monkeypatch.delenv("RELAX_LAUNCHER", raising=False)

    def run(self) -> int:
        job = load_config(self.args[0], self.args[1:])
        return run_local(FAKE_JOB, self.args, plan(job), job, timeout_s=120)

    def argv(self) -> list[list[str]]:
        return [json.loads(line) for line in self.runs.read_text().splitlines()]

    def restarts(self) -> list[dict]:
        path = self.run_dir / RESTARTS_FILE
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.slow  # the real job's restart: test_restart_job.py
def test_a_failed_job_restarts_from_its_checkpoint_and_the_webhook_hears(
    tmp_path, monkeypatch, capsys
):
    with webhook() as hook:
        fake = FakeRun(
            tmp_path,
            monkeypatch,
            [{"steps": 3, "checkpoint": 3, "exit": 1}, {"steps": 6, "exit": 0}],
            f"logging.notify=[{hook.url}]",
        )
        assert fake.run() == 0
    console = capsys.readouterr().err
    first, second = fake.argv()
    assert "checkpoint.resume=true" not in first and second[-1] == "checkpoint.resume=true"
    [record] = fake.restarts()
    assert record["cause"] == "rank 0 (trainer[tp0 pp0 dp0]) exited with code 1"
    assert record["resumed_step"] == 3 and record["died_after_step"] == 3
    assert "redo_s" in record and "startup_s" not in record  # the fake job writes no start-up
    line = next(line for line in console.splitlines() if "restarting" in line)
    assert line.startswith(f"relax-launch: {record['cause']}; restarting the job from the ")
    assert "step 3 (restart 1 of 2 within 3600 s" in line
    assert hook.events() == ["restarted", "finished"], hook.messages
    assert hook.messages[0]["message"] == line
    assert (fake.run_dir / "torchrun.before-restart3.log").is_file()


def test_a_death_before_the_first_checkpoint_is_not_restarted(tmp_path, monkeypatch, capsys):
    with webhook() as hook:
        fake = FakeRun(
            tmp_path, monkeypatch, [{"steps": 0, "exit": 1}], f"logging.notify=[{hook.url}]"
        )
        assert fake.run() == 1
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert len(fake.argv()) == 1 and fake.restarts() == []
    assert last.startswith("relax-launch: job failed: rank 0 (trainer[tp0 pp0 dp0]) exited ")
    assert "not restarted: it failed before its first checkpoint; no checkpoint" in last, last
    assert hook.events() == ["failed"] and hook.messages[0]["message"] == last


def test_the_same_failure_at_the_same_step_ends_the_job(tmp_path, monkeypatch, capsys):
    died_twice = [{"steps": 3, "checkpoint": 3, "exit": 1}, {"steps": 3, "exit": 1}]
    fake = FakeRun(tmp_path, monkeypatch, died_twice)
    assert fake.run() == 1
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert len(fake.argv()) == 2 and len(fake.restarts()) == 1
    assert "not restarted: the same failure again with no newer checkpoint than step 3 " in last
    assert "resume from step 3 with: relax-launch run" in last, last


@pytest.mark.slow  # decide() is tested case by case above
def test_restarts_stop_at_max_restarts(tmp_path, monkeypatch, capsys):
    progress = [{"steps": s, "checkpoint": s, "exit": 1} for s in (2, 3, 4)]
    fake = FakeRun(tmp_path, monkeypatch, progress)
    assert fake.run() == 1
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert [r["resumed_step"] for r in fake.restarts()] == [2, 3] and len(fake.argv()) == 3
    assert "not restarted: 2 restarts within cluster.restart_window_s=3600 s already" in last


@pytest.mark.slow  # decide() is tested case by case above
def test_an_operator_stop_is_never_restarted(tmp_path, monkeypatch, capsys):
    # the run failed while a stop was asked (its STOP file): the stop wins
    fake = FakeRun(tmp_path, monkeypatch, [{"steps": 3, "checkpoint": 3, "exit": 1, "stop": 1}])
    assert fake.run() == 1
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert "not restarted: a stop was asked (relax-launch stop)" in last and not fake.restarts()


SUMMARY = """Root Cause (first observed failure):
[0]:
  rank      : 1 (local_rank: 1)
  exitcode  : -9 (pid: 13390)
"""


def supervised(tmp_path: Path, notify: str, *checkpoints: int) -> list[str]:
    """A run directory as an sbatch job leaves it after srun (node 0's torchrun log naming rank
    1's death), with complete checkpoints of ``checkpoints``; the supervisor's arguments."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "torchrun-node0.log").write_text(SUMMARY)
    for step in checkpoints:
        (tmp_path / "ck" / f"step_{step:06d}").mkdir(parents=True)
        (tmp_path / "ck" / f"step_{step:06d}" / "COMPLETE").write_text(str(step))
    return [
        "configs/quickstart_cpu.yaml",
        f"logging.dir={run_dir}",
        f"checkpoint.dir={tmp_path / 'ck'}",
        "checkpoint.every_steps=1",
        "cluster.max_restarts=1",
        "checkpoint.resume=true",
        f"logging.notify=[{notify}]",
    ]


def test_an_sbatch_job_restarts_once_then_ends_and_is_heard(tmp_path, capsys):
    with webhook() as hook:
        args = supervised(tmp_path, hook.url, 2)
        assert supervise.main(["1", *args]) == 0  # srun failed after step 2's checkpoint
        restarted = capsys.readouterr().out.strip()
        assert restarted.startswith(
            "relax-launch: rank 1 (trainer[tp0 pp0 dp1]) was killed by SIGKILL; restarting "
        )
        assert supervise.main(["1", *args]) == 1  # again, with no newer checkpoint
        failed = capsys.readouterr().out.strip()
        assert "not restarted: the same failure again" in failed
        assert supervise.main(["0", *args]) == 1  # (a later job) finished
    assert hook.events() == ["restarted", "failed", "finished"]
    assert [m["message"] for m in hook.messages[:2]] == [restarted, failed]
    status = render_status(job_status(str(tmp_path / "run")))
    assert "restarts: 1; the last from step 2 after rank 1 (trainer[tp0 pp0 dp1])" in status


def test_the_sbatch_script_asks_the_supervisor_only_when_it_has_a_say():
    def script(*overrides: str) -> str:
        job = load_config("configs/quickstart_cpu.yaml", overrides)
        return render(job, plan(job), "c.yaml", overrides, SbatchOptions(), "python")

    restarting = script("checkpoint.dir=/ck", "checkpoint.every_steps=1", "cluster.max_restarts=2")
    assert 'python -m relax_launch.commands.supervise "$code" c.yaml' in restarting
    assert restarting.count("srun --kill-on-bad-exit") == 1 and "while :; do" in restarting
    assert "commands.supervise" in script("logging.notify=[json://127.0.0.1:9]")
    assert "commands.supervise" not in script()
