"""``relax-launch top``'s header read from a run directory: the step and the time left."""

from __future__ import annotations

import io
import json
from pathlib import Path

from rich.console import Console

from relax_launch.commands.top import read_frame, render


def run_dir(tmp_path: Path, rows: list[dict]) -> Path:
    (tmp_path / "job.json").write_text(json.dumps({"name": "job", "algorithm": {"num_steps": 4}}))
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return tmp_path


def shown(frame) -> str:
    console = Console(file=io.StringIO(), width=200)
    console.print(render(frame))
    return console.file.getvalue()


def test_no_eta_while_only_the_step_0_eval_row_is_written(tmp_path):
    # eval.before_training's row has no time/step: while step 1 runs there is no mean yet
    frame = read_frame(
        run_dir(tmp_path, [{"step": 0, "eval/reward": 0.2, "time/eval": 5.0}]), None, None
    )
    assert frame.header["step"] == 0 and "eta_s" not in frame.header
    assert "step 0/4" in shown(frame) and "ETA" not in shown(frame)


def test_the_eta_is_the_mean_trained_step_times_the_steps_left(tmp_path):
    rows = [
        {"step": 0, "eval/reward": 0.2, "time/eval": 50.0},
        {"step": 1, "reward": 0.5, "time/step": 10.0},
        {"step": 2, "reward": 0.6, "time/step": 20.0},
    ]
    frame = read_frame(run_dir(tmp_path, rows), None, None)
    assert frame.header["eta_s"] == 15.0 * 2
    assert "ETA 0:00:30" in shown(frame)
