"""A stand-in for ``relax_launch.launch`` under torchrun, for the launcher's restart loop
(``test_restarts.py``): rank 0 plays the job's part in the run directory as ``$FAKE_JOB_ACTIONS``
(a JSON list, one entry per run) says for this run, the n-th since ``$FAKE_JOB_RUNS`` (a file
of one line per run: its arguments) was empty; other ranks exit 0.

An entry: ``{"steps": S, "checkpoint": C, "exit": E}``: metrics rows of steps 1..S (a resumed
run keeps those up to its checkpoint, as the real job does), a complete checkpoint of step C
(none when absent), with ``"stop": 1`` the run directory's STOP file, then exit E (0 writes
the end record ``completed``)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from relax_launch.config import load_config
from relax_launch.run_dir import write_end_record


def main() -> int:
    if os.environ["RANK"] != "0":
        return 0
    job = load_config(sys.argv[1], sys.argv[2:])
    runs = Path(os.environ["FAKE_JOB_RUNS"])
    done = runs.read_text().splitlines() if runs.is_file() else []
    with runs.open("a") as out:
        out.write(json.dumps(sys.argv[1:]) + "\n")
    action = json.loads(os.environ["FAKE_JOB_ACTIONS"])[len(done)]
    job.log_dir.mkdir(parents=True, exist_ok=True)
    rows = "".join(json.dumps({"step": s}) + "\n" for s in range(1, action.get("steps", 0) + 1))
    (job.log_dir / "metrics.jsonl").write_text(rows)
    if "checkpoint" in action:
        step_dir = job.checkpoint_dir / f"step_{action['checkpoint']:06d}"
        step_dir.mkdir(parents=True, exist_ok=True)
        (step_dir / "COMPLETE").write_text(str(action["checkpoint"]))
    if action.get("stop"):  # the operator asked it to stop meanwhile
        (job.log_dir / "STOP").write_text("relax-launch stop\n")
    if action["exit"] == 0:
        write_end_record(job.log_dir, "completed", "every step ran")
    return action["exit"]


if __name__ == "__main__":
    sys.exit(main())
