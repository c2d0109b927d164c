"""Benchmark: SIGKILL of one engine of each role, in each schedule; the job goes on.

For each schedule (``sync``: every step on the newest weights; ``off_policy``: one step behind,
``algorithm.off_policy_steps=1``; ``async``: fully asynchronous, ``algorithm.max_staleness=2``;
``pd``: the rollout served by prefill/decode pairs) it runs one long tiny RL job (a trainer rank;
two rollout engines, or two prefill/decode pairs; a teacher and a judge engine; every role
fault tolerant) and, once it has trained 2 steps, kills one engine after another: its SGLang
server's whole process group, by SIGKILL, as a crash would. For each kill it records:

- ``back_s``: seconds from the kill until the gateway's discovery (``GET /{role}/engines``)
  lists the engine as routable again (a rollout engine: after the weight sync that follows its
  restart; a teacher or judge: once restarted, its weights are its own);
- the steps trained meanwhile, and whether every step of the job was trained (no step lost);
- prompts regenerated: the step metrics that count regenerated or rerouted work, summed over
  the steps after the kill;
- ``logprob_diff_max``: trainer against engine logprobs of the first step sampled after the
  engine was back (on-policy schedules; off-policy ones measure the staleness too).

The job is stopped after the last kill (STOP file, exit 75). Prints a markdown table (held in
docs/benchmarks.md, "Engine deaths"). Run:
``.venv/bin/python bench/engine_kills.py [--schedules sync,off_policy,async,pd] [--logs DIR]``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil
import yaml

from relax_launch.deadline import wait_until
from relax_launch.platform import sglang_server_module

POLL_S = 0.2
UP_TIMEOUT_S = 600.0  # the job to come up on 2 busy cores
BACK_TIMEOUT_S = 300.0  # one engine to serve again
STOPPED = 75
SCHEDULES = {
    "sync": [],
    "off_policy": ["algorithm.off_policy_steps=1"],
    "async": ["algorithm.max_staleness=2"],
    "pd": ["rollout.ranks=2", "rollout.prefill={ranks: 2}"],
}


SERVER_MODULE = sglang_server_module("cpu")  # what an engine's server runs as


def job_config(schedule: str) -> dict:
    """The long tiny job: rank 0 trains, then the rollout, teacher and genrm engines."""
    rollout_ranks = 4 if schedule == "pd" else 2
    return {
        "name": f"engine-kills-{schedule}",
        "cluster": {
            "nnodes": 1,
            "nproc_per_node": 1 + rollout_ranks + 2,
            "device": "cpu",
            "collective_timeout_s": 180,
            "startup_timeout_s": 300,
        },
        "placement": {"mode": "decoupled"},
        "trainer": {
            "model": "builtin:tiny-llama",
            "ranks": 1,
            "dtype": "float32",
            "lr": 1.0e-3,
            "micro_batch_size": 2,
        },
        "rollout": {"ranks": 2, "fault_tolerance": True, "engine": {"max_total_tokens": 2048}},
        "teacher": {
            "model": "builtin:tiny-llama",
            "ranks": 1,
            "fault_tolerance": True,
            "engine": {"max_total_tokens": 2048},
        },
        "genrm": {
            "model": "builtin:tiny-llama",
            "ranks": 1,
            "fault_tolerance": True,
            "engine": {"max_total_tokens": 2048},
        },
        "algorithm": {
            "num_steps": 1000,
            "n_samples_per_prompt": 2,
            "distill_coef": 0.1,
            "temperature": 0.7,
        },
        "data": {
            "dataset": "builtin:arithmetic",
            "prompts_per_step": 4,
            "max_prompt_tokens": 128,
            "max_response_tokens": 16,
        },
        "reward": {
            "sources": [
                {"name": "answer", "function": "builtin:exact_numeric"},
                {"name": "judge", "genrm": True, "weight": 0.5},
            ]
        },
    }


@dataclass
class Kill:
    schedule: str
    role: str  # rollout, teacher, genrm, or "rollout prefill" / "rollout decode"
    back_s: float | None = None
    steps_meanwhile: int = 0
    regenerated: float = 0.0
    logprob_diff_max: float | None = None
    note: str = ""


class Job:
    """``relax-launch run`` of one schedule's config; its gateway, metrics and engines."""

    def __init__(self, schedule: str, logs: Path) -> None:
        self.run_dir = logs / schedule
        self.run_dir.mkdir(parents=True, exist_ok=True)
        config = self.run_dir / "job.yaml"
        config.write_text(yaml.safe_dump(job_config(schedule), sort_keys=False))
        cli = Path(sys.executable).with_name("relax-launch")
        args = [f"logging.dir={self.run_dir}", f"checkpoint.dir={self.run_dir / 'ck'}"]
        self.console = open(self.run_dir / "console.txt", "w")  # noqa: SIM115 - kept open
        self.process = subprocess.Popen(
            [str(cli), "run", str(config), *args, *SCHEDULES[schedule]],
            stdout=self.console,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.gateway = ""

    def alive(self) -> None:
        if self.process.poll() is not None:
            tail = (self.run_dir / "console.txt").read_text()[-3000:]
            raise RuntimeError(f"the job ended (exit {self.process.returncode}):\n{tail}")

    def rows(self) -> list[dict]:
        path = self.run_dir / "metrics.jsonl"
        complete = path.read_text().split("\n")[:-1] if path.is_file() else []
        return [json.loads(line) for line in complete]

    def wait(self, what: str, condition, timeout_s: float) -> None:
        """Poll ``condition`` while the job runs; an error naming ``what`` after ``timeout_s``."""

        def holds() -> bool:
            self.alive()
            return bool(condition())

        if not wait_until(holds, timeout_s, POLL_S):
            raise TimeoutError(f"{what}: not within {timeout_s:.0f} s")

    def wait_for_steps(self, steps: int, timeout_s: float = UP_TIMEOUT_S) -> None:
        self.wait(f"{steps} steps", lambda: len(self.rows()) >= steps, timeout_s)

    def wait_for_gateway(self) -> None:
        record = self.run_dir / "gateway.json"
        self.wait("the gateway", record.is_file, UP_TIMEOUT_S)
        self.gateway = json.loads(record.read_text())["url"]

    def engines(self, role: str) -> list[dict]:
        """The role's routable engine records (a pair once, as its decode engine)."""
        try:
            reply = httpx.get(f"{self.gateway}/{role}/engines", timeout=10).json()
        except httpx.HTTPError:
            return []
        return [
            e
            for model in reply.get("models", {}).values()
            for e in model["engines"]
            if e["state"] == "READY" and e["direct_eligible"]
        ]

    def stop(self) -> int:
        (self.run_dir / "STOP").touch()
        try:
            return self.process.wait(timeout=180)
        finally:
            if self.process.poll() is None:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
            self.console.close()


def server_at(url: str) -> psutil.Process:
    """The SGLang server process listening at ``url``'s port."""
    port = url.rsplit(":", 1)[1].split("/")[0]
    for p in psutil.process_iter(["cmdline"]):
        command = p.info["cmdline"] or []
        if any(SERVER_MODULE in c for c in command) and port in command:
            return p
    raise LookupError(f"no SGLang server listens at {url}")


def kill_one(job: Job, schedule: str, role: str, half: str | None = None) -> Kill:
    """Kill the role's first engine (or its pair's ``half``) and measure its return."""
    kill = Kill(schedule, f"{role} {half}" if half else role)
    found: list[dict] = []

    def routable_now() -> list[dict]:  # none while a sync runs: the model is closed then
        found[:] = job.engines(role)
        return found

    job.wait(f"a routable {role} engine", routable_now, BACK_TIMEOUT_S)
    target = found[0]
    url = target["prefill"]["base_url"] if half == "prefill" else target["base_url"]
    victim = server_at(url)
    steps_before, began = len(job.rows()), time.monotonic()
    os.killpg(os.getpgid(victim.pid), signal.SIGKILL)

    def routed() -> bool:
        return any(e["engine_id"] == target["engine_id"] for e in job.engines(role))

    try:
        job.wait(f"{kill.role} engine leaving routing", lambda: not routed(), 60)
    except TimeoutError:
        kill.note = "never left routing"
    job.wait(f"{kill.role} engine serving again", routed, BACK_TIMEOUT_S)
    kill.back_s = time.monotonic() - began
    steps_back = len(job.rows())
    job.wait_for_steps(steps_back + 2)
    rows = job.rows()
    kill.steps_meanwhile = steps_back - steps_before
    kill.regenerated = sum(
        value
        for row in rows[steps_before:]
        for key, value in row.items()
        if ("regenerat" in key or "rerouted" in key) and isinstance(value, int | float)
    )
    after = rows[steps_back + 1] if len(rows) > steps_back + 1 else rows[-1]
    kill.logprob_diff_max = after.get("logprob_diff_max")
    return kill


def run_schedule(schedule: str, logs: Path) -> tuple[list[Kill], str]:
    """One job: a kill of each role in turn. Returns the kills and the job's verdict."""
    job = Job(schedule, logs)
    kills: list[Kill] = []
    try:
        job.wait_for_gateway()
        job.wait_for_steps(2)
        halves = [("rollout", "prefill"), ("rollout", None)] if schedule == "pd" else []
        for role, half in halves or [("rollout", None)]:
            kills.append(kill_one(job, schedule, role, half))
        for role in ("teacher", "genrm"):
            kills.append(kill_one(job, schedule, role))
    except Exception as exc:  # noqa: BLE001 - the table says what failed
        kills.append(Kill(schedule, "-", note=f"{type(exc).__name__}: {str(exc)[:300]}"))
    code = job.stop()
    steps = [row["step"] for row in job.rows()]
    whole = steps == list(range(1, len(steps) + 1))
    return kills, f"exit {code}, {len(steps)} steps, {'none' if whole else 'some'} lost"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--schedules", default=",".join(SCHEDULES))
    parser.add_argument("--logs", type=Path, default=None)
    args = parser.parse_args()
    logs = args.logs or Path(tempfile.mkdtemp(prefix="engine-kills-"))
    print(f"runs in {logs}")
    lines = [
        "| schedule | engine killed | serving again after | steps meanwhile | prompts "
        "regenerated | logprob_diff_max after | job |",
        "|---|---|---|---|---|---|---|",
    ]
    for schedule in args.schedules.split(","):
        kills, verdict = run_schedule(schedule, logs)
        for k in kills:
            back = f"{k.back_s:.1f} s" if k.back_s is not None else k.note
            diff = f"{k.logprob_diff_max:.1e}" if k.logprob_diff_max is not None else "-"
            lines.append(
                f"| {schedule} | {k.role} | {back} | {k.steps_meanwhile} | "
                f"{k.regenerated:g} | {diff} | {verdict} |"
            )
        print("\n".join(lines[-len(kills) :]), flush=True)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
