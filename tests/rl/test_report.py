"""The run's metric sinks and curves, read back with each library's own reader: TensorBoard's
EventAccumulator, W&B's ``wandb leet inspect`` on an offline run, matplotlib's Figure."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from pathlib import Path

import pytest
from pydantic import ValidationError

from relax_launch.rl.config import LoggingConfig
from relax_launch.rl.report import WANDB_RUN_ID, MetricsLog, ema, metric_sinks, plot_curves


def rows(steps: range, reward: float) -> list[dict[str, float]]:
    return [{"step": s, "reward": reward + s / 10, "time/step": 1.0} for s in steps]


def test_tensorboard_events_read_back_and_a_resume_hides_the_rerun_steps(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    settings = LoggingConfig(tensorboard=True)
    first = MetricsLog(tmp_path, sinks=metric_sinks(settings, tmp_path, 0, "job", {}))
    for row in rows(range(1, 4), 0.0):
        first.write(row | {"time/step": math.nan} if row["step"] == 1 else row)
    first.sinks[0].close()  # the crash after step 3; the checkpoint was at step 2
    resumed = MetricsLog(tmp_path, 2, sinks=metric_sinks(settings, tmp_path, 2, "job", {}))
    history = list(resumed.history)
    for row in rows(range(3, 5), 1.0):
        history.append(row)
        resumed.write(row)
    assert "curves:" in resumed.finish(history, tmp_path)  # closes the sinks

    events = EventAccumulator(str(tmp_path))
    events.Reload()
    reward = [(e.step, round(e.value, 4)) for e in events.Scalars("reward")]
    assert reward == [(1, 0.1), (2, 0.2), (3, 1.3), (4, 1.4)]  # step 3 once: the rerun's
    assert [e.step for e in events.Scalars("time/step")] == [2, 3, 4]  # NaN is not written
    assert "step" not in events.Tags()["scalars"]

    fresh = MetricsLog(tmp_path, sinks=metric_sinks(settings, tmp_path, 0, "job", {}))
    fresh.write(rows(range(1, 2), 5.0)[0])
    fresh.sinks[0].close()
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    assert [(e.step, round(e.value, 4)) for e in events.Scalars("reward")] == [(1, 5.1)]


def test_a_launch_from_step_0_hides_the_earlier_launchs_step_0(tmp_path):
    """A restart without a checkpoint writes step 0 (eval.before_training) again: shown once."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    settings = LoggingConfig(tensorboard=True)
    for value in (0.1, 0.7):
        log = MetricsLog(tmp_path, sinks=metric_sinks(settings, tmp_path, 0, "job", {}))
        log.write({"step": 0, "eval/reward": value})
        log.write({"step": 1, "eval/reward": value + 0.1})
        log.close()
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    shown = [(e.step, round(e.value, 4)) for e in events.Scalars("eval/reward")]
    assert shown == [(0, 0.7), (1, 0.8)]


def test_curves_have_a_titled_panel_per_metric_with_a_smoothed_line(tmp_path):
    history = [
        {
            "step": s,
            "reward": s / 10,
            "reward/answer": s / 20,
            "reward/answer/failed": 0,
            "reward/answer/timeouts": 1,  # a count, like failed: no panel of its own
            "reward/judge": math.nan,  # every judge reply failed: no panel
            "reverse_kl": 0.01 * s,
            "kl_ref": 0.02 * s,
            "time/rollout": 1.0,
            "time/train": 2.0 + s,
            "tokens_per_s": 100.0 * s,
        }
        for s in range(1, 6)
    ]
    path = tmp_path / "curves.png"
    figure = plot_curves(history, path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    panels = [(a.get_title(), a.get_xlabel(), a.get_ylabel()) for a in figure.axes]
    assert panels == [
        ("reward", "step", "mean reward"),
        ("reward: answer", "step", "mean reward"),
        ("KL", "step", "nats per token"),
        ("seconds per phase", "step", "seconds"),
        ("rollout throughput", "step", "tokens/s"),
    ]
    kl = figure.axes[2]
    assert [t.get_text() for t in kl.get_legend().get_texts()] == ["reverse_kl", "kl_ref"]
    raw, smooth = kl.get_lines()[:2]  # per curve: the raw points, then their EMA
    assert list(raw.get_ydata()) == pytest.approx([0.01 * s for s in range(1, 6)])
    assert list(smooth.get_ydata()) == pytest.approx(ema([0.01 * s for s in range(1, 6)]))
    assert ema([1.0, 1.0, 1.0]) == pytest.approx([1.0, 1.0, 1.0])  # debiased: no lag from 0
    assert ema([0.0, 1.0], weight=0.5) == pytest.approx([0.0, 2 / 3])


def wandb_records(run_dir: Path) -> list[dict]:
    """The records of an offline run's transaction log, through W&B's own inspector."""
    wandb_cli = Path(sys.executable).with_name("wandb")
    out = subprocess.run(
        [str(wandb_cli), "leet", "inspect", "--json", str(run_dir)],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def test_wandb_offline_run_holds_the_history_and_a_resume_rewinds_it(tmp_path, monkeypatch):
    for variable, folder in (("DIR", "."), ("CONFIG_DIR", "config"), ("CACHE_DIR", "cache")):
        monkeypatch.setenv(f"WANDB_{variable}", str(tmp_path / folder))
    monkeypatch.setenv("WANDB_MODE", "offline")
    settings = LoggingConfig(tensorboard=False, wandb={"project": "relax-test", "mode": "offline"})
    config = {"algorithm": {"num_steps": 4}}
    first = MetricsLog(tmp_path, sinks=metric_sinks(settings, tmp_path, 0, "tiny-job", config))
    for row in rows(range(1, 4), 0.0):
        first.write(row)
    first.sinks[0].close()
    time.sleep(1)  # wandb names a run's folder by its start, to the second: two folders
    run_id = (tmp_path / WANDB_RUN_ID).read_text()
    resumed = MetricsLog(tmp_path, 2, sinks=metric_sinks(settings, tmp_path, 2, "tiny-job", config))
    for row in rows(range(3, 5), 1.0):
        resumed.write(row)
    resumed.sinks[0].close()

    runs = {}
    for run_dir in sorted((tmp_path / "wandb").glob("offline-run-*")):
        records = wandb_records(run_dir)
        (run,) = [r["run"] for r in records if r["type"] == "run"]
        history = [r["history"]["item"] for r in records if r["type"] == "history"]
        runs["resumed" if "branch_point" in run else "first"] = (run, history)
    run, history = runs["first"]
    assert (run["run_id"], run["project"], run["display_name"]) == (
        run_id,
        "relax-test",
        "tiny-job",
    )
    assert [(h["_step"], h["reward"], h["time/step"]) for h in history] == [
        (1, 0.1, 1),
        (2, 0.2, 1),
        (3, pytest.approx(0.3), 1),
    ]
    assert run["config"]["update"]["algorithm"] == config["algorithm"]  # the job's config
    run, history = runs["resumed"]
    # the same run, rewound to the checkpoint's step: step 3 of the crashed launch is replaced
    assert run["branch_point"] == {"metric": "_step", "run": run_id, "value": 2}
    assert [(h["_step"], h["reward"]) for h in history] == [(3, 1.3), (4, 1.4)]


def test_wandb_without_the_package_is_a_config_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed
    with pytest.raises(ValidationError, match="wandb package is not installed"):
        LoggingConfig(wandb={"project": "p"})
    assert LoggingConfig().wandb is None  # off by default: no wandb needed
