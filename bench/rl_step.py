"""Benchmark: where an RL step's time goes, from a real run of a config (default the quickstart).

Runs ``relax-launch run CONFIG`` (pass overrides after the config), reads its metrics.jsonl and
prints the mean seconds per phase (rollout, teacher, reward, train, wait, sync), the rest of the
step (batching, advantages, bookkeeping) and its share of the step time (target <= 5%), skipping
the first step (warm-up). With ``algorithm.off_policy_steps=1`` rollout, teacher and reward run
in the background during train, so their shares overlap it; ``wait`` is the time the sync waited
for them. Run: ``.venv/bin/python bench/rl_step.py [CONFIG] [key=value ...]``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

PHASES = ("rollout", "teacher", "reward", "train", "wait", "sync", "other")
BACKGROUND = ("rollout", "teacher", "reward")  # with off_policy_steps=1


def main(argv: list[str]) -> int:
    config = argv[0] if argv else "configs/quickstart_cpu.yaml"
    with tempfile.TemporaryDirectory() as logs:
        cli = Path(sys.executable).with_name("relax-launch")
        run = subprocess.run([str(cli), "run", config, *argv[1:], f"logging.dir={logs}"])
        if run.returncode != 0:
            return run.returncode
        steps = [
            json.loads(line) for line in (Path(logs) / "metrics.jsonl").read_text().splitlines()
        ]
    measured = steps[1:] or steps
    step_s = sum(s["time/step"] for s in measured) / len(measured)
    print(f"\n{config}: {len(measured)} steps measured (first skipped), {step_s:.2f} s per step")
    overlapped = any("time/wait" in s for s in steps)
    for phase in PHASES:
        seconds = sum(s.get(f"time/{phase}", 0.0) for s in measured) / len(measured)
        note = "  (background, overlaps train)" if overlapped and phase in BACKGROUND else ""
        print(f"  {phase:<8} {seconds:8.3f} s  {seconds / step_s:6.1%}{note}")
    other = sum(s["time/other"] for s in measured) / len(measured)
    print(f"  outside the phases: {other / step_s:.2%} of the step (target <= 5%)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
