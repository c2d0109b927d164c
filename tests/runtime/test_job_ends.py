"""Every way a running job can end, for real: a stop (signal) writes a checkpoint and exits 75
(at real step lengths: ``test_stops.py``); the death of any process of the job (the relax-launch
command, torchrun's agent, a rank, an SGLang server) ends the whole job within 30 s, names what
died on the console's last line with what to do next, and leaves no process.

Each case runs ``relax-launch run`` on a tiny 2-rank job (trainer on rank 0, rollout engine on
rank 1), waits for a few steps, then signals one process. The seconds until the job's last
process is gone are printed (``-s``) for the operations table in docs/operations.md.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from harness.processes import TEST_TAG, processes_tagged

from relax_launch.inference.engine_load import engine_load
from relax_launch.platform import sglang_server_module

pytestmark = pytest.mark.e2e
CONFIG = Path(__file__).parent / "lifecycle_tiny.yaml"
ALL_GONE_S = 30.0  # the promise: every process of the job gone within this
STOPPED = 75


SERVER_MODULE = sglang_server_module("cpu")  # what an engine's server runs as


class Job:
    """``relax-launch run`` of the lifecycle config in ``tmp_path``; finds its processes."""

    def __init__(self, tmp_path: Path, *overrides: str) -> None:
        self.run_dir, self.checkpoints = tmp_path / "run", tmp_path / "ck"
        self.tag = os.environ[TEST_TAG]
        cli = Path(sys.executable).with_name("relax-launch")
        args = [f"logging.dir={self.run_dir}", f"checkpoint.dir={self.checkpoints}", *overrides]
        self.process = subprocess.Popen(
            [str(cli), "run", str(CONFIG), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )

    def wait_for_steps(self, steps: int, timeout_s: float = 300) -> None:
        metrics, deadline = self.run_dir / "metrics.jsonl", time.monotonic() + timeout_s
        while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= steps):
            assert self.process.poll() is None, self.finish()[1]
            assert time.monotonic() < deadline, f"no {steps} steps within {timeout_s} s"
            time.sleep(0.2)

    def target(self, what: str) -> psutil.Process:
        """The process called ``what``: cli, agent, rank0, rank1, engine (rank 1's server)."""
        if what == "cli":
            return psutil.Process(self.process.pid)
        for p in processes_tagged(self.tag):
            command, env = " ".join(p.cmdline()), p.environ()
            if what == "agent" and "torchrun" in command:
                return p
            if what.startswith("rank") and "relax_launch.launch" in command:
                if env.get("RANK") == what[4:] and "sglang" not in command:
                    return p
            if what == "engine" and SERVER_MODULE in command:
                return p
        raise LookupError(f"no {what} process among {self.describe()}")

    def rows(self) -> list[dict]:
        """The metrics rows written so far (a line still being written is not one yet)."""
        path = self.run_dir / "metrics.jsonl"
        complete = path.read_text().split("\n")[:-1] if path.is_file() else []
        return [json.loads(line) for line in complete]

    def wait_for_row(self, condition, timeout_s: float = 300) -> int:
        """The step of the first metrics row for which ``condition`` holds, once written."""
        deadline = time.monotonic() + timeout_s
        while not (found := [row["step"] for row in self.rows() if condition(row)]):
            assert self.process.poll() is None, self.finish()[1]
            assert time.monotonic() < deadline, f"no such row within {timeout_s} s"
            time.sleep(0.2)
        return found[0]

    def describe(self) -> list[str]:
        return [f"{p.pid} {' '.join(p.cmdline())[:80]}" for p in processes_tagged(self.tag)]

    def seconds_until_gone(self, since: float, limit_s: float = 90) -> float:
        while processes_tagged(self.tag) and time.monotonic() - since < limit_s:
            time.sleep(0.1)
        assert not processes_tagged(self.tag), f"left after {limit_s} s: {self.describe()}"
        return time.monotonic() - since

    def finish(self) -> tuple[int, str, str]:
        out, err = self.process.communicate(timeout=120)
        return self.process.returncode, out, err


def end_by(tmp_path: Path, what: str, signum: int) -> tuple[Job, float, int, str]:
    """Run the job, signal ``what`` once it has trained 3 steps; returns the job, the seconds
    until its last process was gone, its exit code and its console (stdout + stderr)."""
    job = Job(tmp_path)
    try:
        job.wait_for_steps(3)
        victim = job.target(what)
        began = time.monotonic()
        victim.send_signal(signum)
        seconds = job.seconds_until_gone(began)
        code, out, err = job.finish()
    finally:
        if job.process.poll() is None:
            os.killpg(job.process.pid, signal.SIGKILL)
            job.process.wait()
    print(f"\n{what} {signal.Signals(signum).name}: all gone in {seconds:.1f} s, exit {code}")
    return job, seconds, code, out + err


def last_line(console: str) -> str:
    return console.strip().splitlines()[-1]


@pytest.mark.slow  # in the default run: a dead prefill engine's, tests/rl/test_pd_job.py
def test_a_dead_engine_server_ends_the_job_and_names_it(tmp_path):
    _, seconds, code, console = end_by(tmp_path, "engine", signal.SIGKILL)
    assert seconds < ALL_GONE_S
    assert code not in (0, STOPPED)
    cause = "rollout engine 0 on rank 1 (rollout[e0 head], node 0): its SGLang server was killed"
    # the cause once, last, with what to do next; the engine's log above it, less warnings
    assert last_line(console).startswith(f"relax-launch: job failed: {cause} by SIGKILL; ")
    assert "rollout.fault_tolerance=true" in last_line(console), console
    assert console.count("job failed") == 1, console
    assert "last lines of" in console and "rollout-engine0.log" in console
    assert "warnings.warn(" not in console and "Traceback" not in console


@pytest.mark.parametrize(
    "what,signum,cause",
    [
        # slow: a killed trainer rank is named, and every process stopped, before the restart
        # of tests/runtime/test_restart_job.py
        pytest.param(
            "rank1",
            signal.SIGKILL,
            "rank 1 (rollout[e0 head], node 0) died",
            marks=pytest.mark.slow,
        ),
        # the controller (it writes no end record): torchrun's summary names it
        pytest.param(
            "rank0",
            signal.SIGKILL,
            "rank 0 (trainer[tp0 pp0 dp0]) was killed by SIGKILL",
            marks=pytest.mark.slow,
        ),
        pytest.param("agent", signal.SIGKILL, "its torchrun agent died", marks=pytest.mark.slow),
    ],
)
def test_a_dead_process_ends_the_job(tmp_path, what, signum, cause):
    _, seconds, code, console = end_by(tmp_path, what, signum)
    assert seconds < ALL_GONE_S and code not in (0, STOPPED), console
    last = last_line(console)
    assert last.startswith(f"relax-launch: job failed: {cause}") or last.startswith(
        f"relax-launch: job failed: rank 0 (trainer[tp0 pp0 dp0], node 0): {cause}"
    ), console
    assert console.count("job failed") == 1 and "warnings.warn(" not in console, console
    assert "resume from step" in last or "no checkpoint to resume from" in last, last


@pytest.mark.slow
@pytest.mark.parametrize(
    "what,signum",
    [("cli", signal.SIGKILL), ("rank1", signal.SIGTERM), ("agent", signal.SIGTERM)],
)
def test_a_stop_anywhere_checkpoints_and_exits_75(tmp_path, what, signum):
    job, seconds, code, console = end_by(tmp_path, what, signum)
    end = json.loads((job.run_dir / "end.json").read_text())
    assert end["state"] == "stopped" and (Path(end["checkpoint"]) / "COMPLETE").is_file()
    assert seconds < ALL_GONE_S
    if what != "cli":  # a killed command has no exit code of its own to give
        assert code == STOPPED, console


def kill_a_rollout_engine_and_stop(job: Job, where: str) -> tuple[int, str, str]:
    """After step 3, SIGKILL a rollout engine's server (its whole process group, as when it
    crashes); once a step row counts its restart and 2 more steps ran, stop the job (STOP
    file). Returns its exit code and console."""
    try:
        job.wait_for_steps(3)
        os.killpg(job.target("engine").pid, signal.SIGKILL)
        began = time.monotonic()
        back = job.wait_for_row(lambda row: row.get("rollout/engine_restarts") == 1)
        seconds = time.monotonic() - began
        print(
            f"\nrollout engine SIGKILL{where}: serving again at step {back} after {seconds:.1f} s"
        )
        job.wait_for_steps(back + 2)
        (job.run_dir / "STOP").touch()
        return job.finish()
    finally:
        if job.process.poll() is None:
            os.killpg(job.process.pid, signal.SIGKILL)
            job.process.wait()


def server_of(job: Job, rank: int) -> psutil.Process:
    """The SGLang server a rank launched."""
    return next(
        p
        for p in job.target(f"rank{rank}").children(recursive=True)
        if SERVER_MODULE in " ".join(p.cmdline())
    )


@pytest.mark.slow  # the fully asynchronous case below proves the same in the default run
def test_a_dead_rollout_engine_restarts_and_the_job_goes_on(tmp_path):
    """rollout.fault_tolerance with two engines: one engine's server is killed (its whole
    process group, as when it crashes) after step 3. The generations it lost are made by the
    other engine, its rank restarts it, the first sync after it is ready gives it the current
    weights, and no step is lost; then the job is stopped (exit 75)."""
    job = Job(
        tmp_path, "cluster.nproc_per_node=3", "rollout.ranks=2", "rollout.fault_tolerance=true"
    )
    code, out, err = kill_a_rollout_engine_and_stop(job, "")
    assert code == STOPPED, out + err
    rows = job.rows()
    assert [row["step"] for row in rows] == list(range(1, len(rows) + 1))  # none lost
    assert all(row["weight_version"] == row["step"] - 1 for row in rows)  # never stale
    serving = [int(row["rollout/engines_serving"]) for row in rows]
    runs = [(n, len(list(group))) for n, group in itertools.groupby(serving)]
    print(f"engines serving (count, for so many steps): {runs}")
    assert serving[:3] == [2, 2, 2] and 1 in serving, serving  # it left routing ...
    assert serving[-1] == 2 and rows[-1]["rollout/engine_restarts"] == 1, serving  # ... came back
    logs = "".join(p.read_text() for p in job.run_dir.glob("rank*.log"))
    assert re.search(r"rollout engine \d on rank \d .*killed by SIGKILL; restarting it", logs)


TEACHER = [  # the lifecycle job distilled from a teacher with one engine, on rank 2
    "cluster.nproc_per_node=3",
    "teacher.model=builtin:tiny-llama",
    "teacher.ranks=1",
    "teacher.engine.max_total_tokens=2048",
    "algorithm.distill_coef=0.1",
]
GENRM = [  # the lifecycle job judged by a genrm with one engine, on rank 2
    "cluster.nproc_per_node=3",
    "genrm.model=builtin:tiny-llama",
    "genrm.ranks=1",
    "genrm.engine.max_total_tokens=2048",
    "reward.sources=[{name: answer, function: 'builtin:exact_numeric'}, "
    "{name: judge, genrm: true, weight: 0.5}]",
]


def a_static_engine_restarts(tmp_path: Path, role: str, overrides: list[str]) -> None:
    """``{role}.fault_tolerance`` with the role's only engine (rank 2): its server is killed
    (its whole process group) after step 2. The role's requests wait for it (announced once),
    its rank restarts it, it serves its starting weights again as soon as it is ready (no
    weight sync), and every step runs; then the job is stopped (exit 75)."""
    job = Job(tmp_path, *overrides, f"{role}.fault_tolerance=true")
    console = job.run_dir / "rank0.log"
    try:
        job.wait_for_steps(2)
        server = server_of(job, 2)
        os.killpg(server.pid, signal.SIGKILL)
        began = time.monotonic()
        serves_again = f"{role} engine 0 serves again (restarted, 1 of 3 restarts"
        while serves_again not in console.read_text():
            assert job.process.poll() is None, job.finish()[1]
            assert time.monotonic() - began < 300, f"{role} engine not back within 300 s"
            time.sleep(0.2)
        print(f"\n{role} engine SIGKILL: serving again after {time.monotonic() - began:.1f} s")
        back = job.wait_for_row(lambda row: row.get(f"{role}/engine_restarts") == 1)
        job.wait_for_steps(back + 2)
        (job.run_dir / "STOP").touch()
        code, out, err = job.finish()
    finally:
        if job.process.poll() is None:
            os.killpg(job.process.pid, signal.SIGKILL)
            job.process.wait()
    assert code == STOPPED, out + err
    rows = job.rows()
    assert [row["step"] for row in rows] == list(range(1, len(rows) + 1))  # none lost
    assert rows[0][f"{role}/engine_restarts"] == 0 and rows[-1][f"{role}/engines_serving"] == 1
    assert rows[-1][f"{role}/engine_restarts"] == 1
    logs = "".join(p.read_text() for p in job.run_dir.glob("rank*.log"))
    assert re.search(rf"{role} engine 0 on rank 2 .*killed by SIGKILL; restarting it", logs)
    waited = re.findall(rf"every {role} engine is out of routing", console.read_text())
    assert len(waited) <= 1, waited  # announced once (a kill between two phases waits not)


@pytest.mark.slow  # with a rollout engine's death: the fully asynchronous test below
def test_a_dead_teacher_engine_restarts_and_the_job_goes_on(tmp_path):
    a_static_engine_restarts(tmp_path, "teacher", TEACHER)


@pytest.mark.slow
def test_a_dead_genrm_engine_restarts_and_the_job_goes_on(tmp_path):
    a_static_engine_restarts(tmp_path, "genrm", GENRM)


def test_dead_rollout_and_teacher_engines_come_back_in_the_fully_asynchronous_schedule(tmp_path):
    """algorithm.max_staleness=1, where the engines generate all the time; two rollout engines
    (ranks 1, 2) and the teacher's only engine (rank 3), every role fault tolerant. One rollout
    engine's server and the teacher's are killed at once (their process groups), the rollout
    engine while it generates: its generations in flight are generated again on the other
    (counted in rollout/prompts_regenerated), the weight syncs' pauses pass over it, and the
    restarted engine rejoins at the next sync; the teacher's requests wait (announced once) for
    its restart, which serves its starting weights again without a sync. Every step trains its
    full batch (less the samples too old for max_staleness, counted as in any fully
    asynchronous job)."""
    job = Job(
        tmp_path,
        "cluster.nproc_per_node=4",
        "rollout.ranks=2",
        "rollout.fault_tolerance=true",
        *[o for o in TEACHER if not o.startswith("cluster.")],
        "teacher.fault_tolerance=true",
        "algorithm.max_staleness=1",
        "data.max_response_tokens=64",
    )
    console = job.run_dir / "rank0.log"
    try:
        job.wait_for_steps(3)
        rollout, teacher = server_of(job, 1), server_of(job, 3)
        command = rollout.cmdline()
        url = f"http://127.0.0.1:{command[command.index('--port') + 1]}"
        deadline = time.monotonic() + 60
        while not ((load := engine_load(url)) and load.running + load.queued):  # generating
            assert time.monotonic() < deadline, "the engine never had a generation in flight"
            time.sleep(0.01)
        os.killpg(rollout.pid, signal.SIGKILL)
        os.killpg(teacher.pid, signal.SIGKILL)
        began = time.monotonic()
        back = job.wait_for_row(lambda row: row.get("rollout/engine_restarts") == 1)
        seconds = time.monotonic() - began
        print(f"\nrollout engine SIGKILL (async): back at step {back} after {seconds:.1f} s")
        job.wait_for_row(lambda row: row.get("teacher/engine_restarts") == 1)
        job.wait_for_steps(len(job.rows()) + 2)
        (job.run_dir / "STOP").touch()
        code, out, err = job.finish()
    finally:
        if job.process.poll() is None:
            os.killpg(job.process.pid, signal.SIGKILL)
            job.process.wait()
    assert code == STOPPED, out + err
    rows = job.rows()
    assert [row["step"] for row in rows] == list(range(1, len(rows) + 1))  # none lost
    for row in rows:  # 2 prompts x 2 samples each step: trained, or too old and counted
        trained = sum(row[f"async/samples_staleness_{age}"] for age in (0, 1))
        assert trained + row["samples_stale"] == 4, row
    regenerated = sum(row["rollout/prompts_regenerated"] for row in rows)
    serving = [int(row["rollout/engines_serving"]) for row in rows]
    print(f"generations sent again: {regenerated:.0f}; engines serving by step: {serving}")
    assert regenerated >= 1  # it died generating (killed then): those were made elsewhere
    # (a step row may miss the outage: the teacher's, as long, holds the steps while it lasts)
    assert serving[-1] == 2 and rows[-1]["rollout/engine_restarts"] == 1
    assert rows[-1]["teacher/engines_serving"] == 1 and rows[-1]["teacher/engine_restarts"] == 1
    assert all("reverse_kl" in row for row in rows)  # every step scored by the teacher
    logs = console.read_text()
    assert "teacher engine 0 serves again (restarted, 1 of 3 restarts" in logs
    assert len(re.findall(r"every teacher engine is out of routing", logs)) <= 1


@pytest.mark.slow
def test_a_dead_rollout_engine_behind_sglang_router_leaves_its_workers_and_comes_back(tmp_path):
    """The rollout engine's death in route mode router: sglang-router sends what the engine
    was generating to the other one itself; rank 0 takes the engine out of the router's workers
    as soon as its rank begins the restart, and adds it back when the first sync after it is
    ready commits on it; no step is lost."""
    overrides = ["cluster.nproc_per_node=3", "rollout.ranks=2", "rollout.fault_tolerance=true"]
    job = Job(tmp_path, *overrides, "gateway.rollout_route_mode=router")
    code, out, err = kill_a_rollout_engine_and_stop(job, " behind sglang-router")
    assert code == STOPPED, out + err
    rows = job.rows()
    assert [row["step"] for row in rows] == list(range(1, len(rows) + 1))  # none lost
    serving = [int(row["rollout/engines_serving"]) for row in rows]
    assert 1 in serving and serving[-1] == 2 and rows[-1]["rollout/engine_restarts"] == 1
    console = (job.run_dir / "rank0.log").read_text()
    removed = re.search(r"sglang-router no longer routes to (http://\S+)", console)
    assert removed, console[-3000:]
    assert f"sglang-router routes to {removed[1]}" in console[removed.end() :], console[-3000:]
