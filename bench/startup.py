"""Benchmark: where a job's start-up goes, against the floor of one bare engine of its model.

Runs ``relax-launch run CONFIG algorithm.num_steps=1`` and times, from the command's start, the
"job is up" line (the first weight sync done); prints each rank's start-up phases from the
job's ``startup.json`` (seconds from the first rank process's start) and the critical path.
Then, on the now quiet machine, starts one bare SGLang server of the rollout model with the
config's engine arguments and times it to its first token: the floor a job cannot beat. Prints
time to up / floor. On the CPU the project's engines fork SGLang's subprocesses
(``platform/forked_sglang.py``); the same bare engine as SGLang ships it (spawned) is timed too.

Both are also measured in CPU work (the machine's busy core-seconds, from ``/proc/stat``, over
the same interval): a start-up that keeps every core busy cannot end before its CPU work divided
by the cores, so ``job CPU work / cores`` against ``1.3 x floor`` says whether the goal is
within reach of this machine at all, however the work is ordered.

Run: ``.venv/bin/python bench/startup.py configs/quickstart_cpu.yaml [key=value ...]``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from relax_launch.config import load_config
from relax_launch.config.job import JobConfig
from relax_launch.inference.server import SGLangServer
from relax_launch.models.build import ensure_model


def busy_seconds() -> float:
    """Core-seconds this machine has spent not idle since boot."""
    times = psutil.cpu_times()
    return sum(times) - times.idle - getattr(times, "iowait", 0.0)


def job_up(config: str, overrides: list[str], logs: Path) -> tuple[float, float, float]:
    """(seconds to the "job is up" line, seconds to the end, busy core-seconds until up) of one
    run."""
    cli = Path(sys.executable).with_name("relax-launch")
    command = [str(cli), "run", config, *overrides, "algorithm.num_steps=1", f"logging.dir={logs}"]
    start, busy, up, work = time.monotonic(), busy_seconds(), None, None
    job = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in job.stdout:
        if up is None and "job is up" in line:
            up, work = time.monotonic() - start, busy_seconds() - busy
            print(line.rstrip())
    if job.wait() != 0 or up is None:
        raise SystemExit(f"{' '.join(command)} failed ({job.returncode}); logs in {logs}")
    return up, time.monotonic() - start, work


class ShippedSGLangServer(SGLangServer):
    """The server as SGLang ships it: ``python -m sglang.launch_server``, subprocesses spawned."""

    def command(self) -> list[str]:
        command = super().command()
        command[command.index("-m") + 1] = "sglang.launch_server"
        return command


def bare_engine(
    job: JobConfig, logs: Path, server_class: type[SGLangServer] = SGLangServer
) -> tuple[float, float]:
    """(seconds, busy core-seconds) from launching one SGLang server of the rollout model to
    its first token."""
    engine = {**job.rollout.engine, "dtype": job.engine_dtype("rollout")}
    server = server_class(
        model_path=ensure_model(job.rollout_model()),
        device=job.cluster.device,
        log_path=logs / f"bare-engine-{server_class.__name__}.log",
        engine=engine,
    )
    start, busy = time.monotonic(), busy_seconds()
    server.start(timeout_s=job.cluster.startup_timeout_s)
    try:
        return time.monotonic() - start, busy_seconds() - busy
    finally:
        server.stop()


def main(argv: list[str]) -> int:
    config, overrides = argv[0], argv[1:]
    with tempfile.TemporaryDirectory() as directory:
        logs = Path(directory)
        up, total, work = job_up(config, overrides, logs)
        report = json.loads((logs / "startup.json").read_text())
        job = load_config(config, overrides)
        floor, floor_work = bare_engine(job, logs)
        shipped, shipped_work = bare_engine(job, logs, ShippedSGLangServer)
    print(f"\n{'rank':<6}{'roles':<34}{'phase':<30}{'took s':>8}{'end s':>8}")
    for rank, entry in report["ranks"].items():
        for phase in entry["phases"]:
            print(
                f"{rank:<6}{entry['label'][:33]:<34}{phase['phase']:<30}"
                f"{phase['took_s']:>8.2f}{phase['end_s']:>8.2f}"
            )
    critical = report["critical"]
    print(
        f"\ncritical path: rank {critical['rank']} {critical['phase']} at "
        f"{critical['end_s']:.1f} s; job up at {report['up_s']:.1f} s after the first rank "
        "process started"
    )
    print(f"command start -> job is up: {up:.1f} s (whole 1-step run {total:.1f} s)")
    print(f"floor, one bare engine of the rollout model to its first token: {floor:.1f} s")
    print(f"time to up / floor: {up / floor:.2f} (goal <= 1.3)")
    print(
        f"the same engine as SGLang ships it (subprocesses spawned): {shipped:.1f} s, "
        f"{shipped_work:.1f} core-s; time to up / it: {up / shipped:.2f}"
    )
    cores = len(os.sched_getaffinity(0))
    print(
        f"CPU work until up: job {work:.1f} core-s, bare engine {floor_work:.1f} core-s; on "
        f"{cores} cores the job cannot be up before {work / cores:.1f} s "
        f"({work / cores / floor:.2f} x floor)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
