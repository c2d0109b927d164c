"""Benchmark: a colocated job (split or defer) against the same job decoupled, same rank count.

Runs ``relax-launch run`` twice, one after the other: CONFIG as written (placement split or
defer), then the same roles decoupled (``--decoupled key=value ...`` gives each role its own
ranks there; off-policy stays off, so both run the same synchronous step). While each runs, the
memory of every rank's process tree (the rank and the engines it started) is sampled with psutil
every second as PSS (shared pages split between the processes sharing them, so the sum over
processes is the job's real footprint). Prints, per run: mean seconds per phase and per step
(first step skipped as warm-up), and the peak memory of the whole job and of its largest rank —
the figure that has to fit one device when ranks are GPUs.

Run: ``.venv/bin/python bench/colocation.py configs/defer_cpu.yaml algorithm.num_steps=4
--decoupled cluster.nproc_per_node=4 trainer.ranks=1 rollout.ranks=1``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path

import psutil


def main(argv: list[str]) -> int:
    split_at = argv.index("--decoupled") if "--decoupled" in argv else len(argv)
    config, shared, decoupled = argv[0], argv[1:split_at], argv[split_at + 1 :]
    runs = {
        "colocated": shared,
        "decoupled": [*shared, "placement.mode=decoupled", *decoupled],
    }
    results = {name: run(config, overrides) for name, overrides in runs.items()}
    for name, (steps, memory) in results.items():
        report(name, runs[name], steps, memory)
    return 0


def run(config: str, overrides: list[str]) -> tuple[list[dict], dict[str, float]]:
    with tempfile.TemporaryDirectory() as logs:
        cli = Path(sys.executable).with_name("relax-launch")
        command = [str(cli), "run", config, *overrides, f"logging.dir={logs}"]
        job = subprocess.Popen(command)
        memory = {"job": 0.0}
        sampler = threading.Thread(target=sample, args=(job, memory), daemon=True)
        sampler.start()
        if job.wait() != 0:
            raise SystemExit(f"{' '.join(command)} failed ({job.returncode})")
        sampler.join(5)
        lines = (Path(logs) / "metrics.jsonl").read_text().splitlines()
        return [json.loads(line) for line in lines], memory


def sample(job: subprocess.Popen, peaks: dict[str, float]) -> None:
    """Peak PSS of the job and of each rank's tree, in bytes, until the job ends."""
    root = psutil.Process(job.pid)
    while job.poll() is None:
        per_rank: dict[str, float] = defaultdict(float)
        try:
            for process in root.children(recursive=True):
                per_rank[rank_of(process)] += process.memory_full_info().pss
        except psutil.Error:
            pass  # a process ended between listing and reading it
        for rank, pss in per_rank.items():
            peaks[rank] = max(peaks.get(rank, 0.0), pss)
        peaks["job"] = max(peaks["job"], sum(per_rank.values()))
        time.sleep(1.0)


def rank_of(process: psutil.Process) -> str:
    """The torchrun rank a process belongs to (its own RANK, inherited by engines)."""
    try:
        return f"rank {process.environ().get('RANK', '-')}"
    except psutil.Error:
        return "rank -"


def report(name: str, overrides: list[str], steps: list[dict], memory: dict[str, float]) -> None:
    measured = steps[1:] or steps
    phases = sorted({k for s in measured for k in s if k.startswith("time/")})
    step_s = sum(s["time/step"] for s in measured) / len(measured)
    print(f"\n{name} ({' '.join(overrides) or 'as written'}): {len(measured)} steps measured")
    for phase in phases:
        seconds = sum(s.get(phase, 0.0) for s in measured) / len(measured)
        print(f"  {phase:<40} {seconds:8.3f} s  {seconds / step_s:6.1%}")
    ranks = {k: v for k, v in memory.items() if k.startswith("rank ") and k != "rank -"}
    largest = max(ranks, key=ranks.get) if ranks else "-"
    print(
        f"  peak memory (PSS): job {memory['job'] / 1e9:.2f} GB; largest rank ({largest}) "
        f"{ranks.get(largest, 0.0) / 1e9:.2f} GB"
    )
    rewards = [s["reward"] for s in steps]
    print(f"  reward first 3 {mean(rewards[:3]):.3f}, last 3 {mean(rewards[-3:]):.3f}")


def mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
