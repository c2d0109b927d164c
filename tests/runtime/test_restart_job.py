"""A job that loses a process after a checkpoint starts again by itself (``cluster.max_restarts``),
for real: ``relax-launch run`` of the lifecycle job (trainer DP=2 on ranks 0-1, a rollout engine
on rank 2; 6 steps, a checkpoint after each) has a process SIGKILLed while step 4 is scored (its
reward call sleeps, so the step is surely in flight). The launcher sees every process of it gone,
starts it again with ``checkpoint.resume=true``, and the job resumes from the checkpoint of step
3, scores the same prompts step 4 scored before, and ends with exit 0 after the same 6 steps;
``restarts.jsonl`` records the restart (written once every process of the killed run is gone:
checked by PID), and a local webhook (Apprise's ``json://``) hears the job come up, restart,
come up again and finish. No process is left.

The trainer rank that is not rank 0 runs in the default suite; rank 0 (the controller, which the
end record's writer is) and torchrun's agent are marked slow. The seconds from the kill to the
restarted job's first step are printed (``-s``) for docs/operations.md.
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import psutil
import pytest
from harness.processes import processes_tagged
from harness.webhook import webhook
from test_job_ends import Job, last_line

pytestmark = pytest.mark.e2e
HERE = Path(__file__).parent
KILLED_AT_CALL = 4  # the reward call of step 4: steps 1-3 are checkpointed by then


def alive(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def calls(path: Path) -> list[dict]:
    text = path.read_text() if path.is_file() else ""
    return [json.loads(line) for line in text.split("\n")[:-1]]


@pytest.mark.parametrize(
    "what,cause",
    [
        ("rank1", "rank 1 (trainer[tp0 pp0 dp1], node 0)"),
        pytest.param("rank0", "rank 0 (trainer[tp0 pp0 dp0])", marks=pytest.mark.slow),
        pytest.param("agent", "its torchrun agent died", marks=pytest.mark.slow),
    ],
)
def test_a_killed_process_restarts_the_job_from_its_checkpoint(tmp_path, monkeypatch, what, cause):
    rewards = tmp_path / "rewards.jsonl"
    monkeypatch.setenv("PYTHONPATH", str(HERE))  # slow_reward
    monkeypatch.setenv("RELAX_TEST_REWARD_LOG", str(rewards))
    monkeypatch.setenv("RELAX_TEST_SLOW_FROM", str(KILLED_AT_CALL))  # a restarted run: never
    monkeypatch.setenv("RELAX_TEST_SLOW_S", "2")
    with webhook() as hook:
        job = Job(
            tmp_path,
            "cluster.nproc_per_node=3",
            "trainer.ranks=2",
            "trainer.micro_batch_size=1",
            "algorithm.num_steps=6",
            "checkpoint.every_steps=1",
            "cluster.max_restarts=2",
            "reward.sources=[{name: slow, function: 'slow_reward:slow'}]",
            f"logging.notify=[{hook.url}]",
        )
        try:
            deadline = time.monotonic() + 300
            while len(calls(rewards)) < KILLED_AT_CALL:
                assert job.process.poll() is None, job.finish()[1]
                assert time.monotonic() < deadline, "step 4 was not scored within 300 s"
                time.sleep(0.1)
            old_run = [p for p in processes_tagged(job.tag) if p.pid != job.process.pid]
            job.target(what).send_signal(signal.SIGKILL)
            killed = time.monotonic()
            restarted = job.run_dir / "restarts.jsonl"
            while not restarted.is_file():  # written once the old run's processes are gone
                assert job.process.poll() is None, job.finish()[1]
                assert time.monotonic() - killed < 120, "no restart within 120 s"
                time.sleep(0.05)
            left = [p.pid for p in old_run if alive(p)]
            assert not left, f"processes of the killed run left at its restart: {left}"
            while not (job.rows() and job.rows()[-1]["step"] > 4):
                assert job.process.poll() is None, job.finish()[1]
                assert time.monotonic() - killed < 300, "no step after the restart in 300 s"
                time.sleep(0.1)
            print(f"\n{what} SIGKILL: step 5 done {time.monotonic() - killed:.1f} s later")
            code, out, err = job.finish()
            job.seconds_until_gone(time.monotonic(), limit_s=30)
        finally:
            if job.process.poll() is None:
                job.process.kill()
                job.process.wait()
        events = hook.events()
    console = out + err
    assert code == 0, console
    [record] = [json.loads(line) for line in restarted.read_text().splitlines()]
    assert cause in record["cause"] and record["resumed_step"] in (3, 4), record
    assert record["lost_s"] == pytest.approx(record["redo_s"] + record["startup_s"], abs=0.2)
    assert [row["step"] for row in job.rows()] == [1, 2, 3, 4, 5, 6]
    scored = calls(rewards)
    second = next(i for i, call in enumerate(scored) if i and call["call"] == 1)
    resumed = record["resumed_step"]
    assert scored[second]["questions"] == scored[resumed]["questions"]  # step R+1's prompts
    assert len(scored) - second == 6 - resumed  # the restarted run scored steps R+1..6 once
    restart = next(line for line in console.splitlines() if "restarting the job" in line)
    assert f"from the checkpoint of step {resumed} (restart 1 of 2" in restart
    assert "restart 1 cost" in console and "job failed" not in console
    assert events == ["up", "restarted", "up", "finished"], events
    assert "every step ran" in hook.messages[-1]["message"], last_line(console)
