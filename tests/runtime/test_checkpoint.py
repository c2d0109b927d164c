"""Checkpoint directory bookkeeping and resumed metrics (unit; the real save/resume of a job
runs in tests/rl/test_rl_job.py)."""

from __future__ import annotations

import json

from relax_launch.rl.checkpoints import COMPLETE, Checkpoints
from relax_launch.rl.report import MetricsLog


def test_newest_ignores_incomplete_and_keep_last_prunes(tmp_path):
    store = Checkpoints(tmp_path, keep_last=2)
    assert store.newest() is None
    for step in (1, 2, 3):
        store.prepare(step)
        store.complete(step, {"step": step})
    assert sorted(d.name for d in tmp_path.iterdir()) == ["step_000002", "step_000003"]
    store.prepare(4)  # a save that crashed before its marker
    assert store.newest() == (3, tmp_path / "step_000003")
    assert Checkpoints.controller_state(tmp_path / "step_000003") == {"step": 3}
    assert (tmp_path / "step_000003" / COMPLETE).read_text() == "3"
    store.prepare(3)  # saving a step again starts from an empty directory
    assert store.newest() == (2, tmp_path / "step_000002")


def test_keep_last_counts_only_complete_checkpoints(tmp_path):
    """Incomplete directories (a save cut short) never push a complete checkpoint out."""
    store = Checkpoints(tmp_path, keep_last=2)
    store.prepare(1)
    store.complete(1, {"step": 1})
    for crashed in (2, 3):
        store.prepare(crashed)  # no marker: the job died while saving
    store.prepare(4)
    store.complete(4, {"step": 4})
    assert [step for step, _ in store.complete_steps()] == [1, 4]
    assert sorted(d.name for d in tmp_path.iterdir()) == ["step_000001", "step_000004"]
    assert not list(tmp_path.glob("step_*/*.partial"))  # written whole, then renamed


def test_resumed_metrics_keep_the_steps_up_to_the_checkpoint(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": s, "reward": s / 10}) + "\n" for s in (1, 2, 3))
    )
    log = MetricsLog(tmp_path, resume_step=2)
    assert [r["step"] for r in log.history] == [1, 2]
    log.write({"step": 3, "reward": 0.9})
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows == [
        {"step": 1, "reward": 0.1},
        {"step": 2, "reward": 0.2},
        {"step": 3, "reward": 0.9},
    ]
    assert MetricsLog(tmp_path).history == []  # a fresh run starts a fresh file
    assert (tmp_path / "metrics.jsonl").read_text() == ""
