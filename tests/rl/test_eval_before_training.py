"""``eval.before_training``: the starting weights are evaluated before the first step, as the
run's step-0 row, so a run's held-out score before and after training sit side by side."""

from __future__ import annotations

import io
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from rich.console import Console

from relax_launch.config import ConfigError, load_config
from relax_launch.rl import runner
from relax_launch.rl.context import StepResult
from relax_launch.rl.data import PromptCursor
from relax_launch.rl.report import MetricsLog, summary
from relax_launch.runtime.stop import StopRequest

TINY = Path(__file__).parent / "reasoning_gym_tiny.yaml"


class CountingEvaluation:
    """Scores that rise with each evaluation, and the config's ``before_training``."""

    def __init__(self, before_training: bool, every_steps: int = 0) -> None:
        self.config = SimpleNamespace(before_training=before_training, every_steps=every_steps)
        self.calls = 0

    def due(self, step: int, num_steps: int) -> bool:
        return step == num_steps

    def run(self, engines, rewards) -> dict[str, float]:
        self.calls += 1
        return {"eval/reward": 0.25 * self.calls, "eval/pass@1": 0.25 * self.calls}


class Steps:
    def step(self, step):
        metrics = {"step": step + 1, "reward": 0.5, "tokens_per_s": 1.0}
        return StepResult(metrics, PromptCursor(), {"train": 1.0})

    def close(self):
        pass


def context(tmp_path: Path) -> SimpleNamespace:
    return SimpleNamespace(
        log=MetricsLog(tmp_path),
        job=SimpleNamespace(
            console=Console(file=io.StringIO()),
            stop=StopRequest(0, tmp_path),
            engines=SimpleNamespace(cancel_all=lambda why: None),
        ),
        rewards=None,
        feed=SimpleNamespace(position=PromptCursor),
        checkpoint_every=None,
        exports=None,
        guard=None,
        control=None,
    )


def rows(tmp_path: Path) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]


def test_the_starting_weights_are_evaluated_as_step_0(tmp_path):
    evaluation = CountingEvaluation(before_training=True)
    runner.run(context(tmp_path), Steps(), 2, tmp_path, evaluation=evaluation)
    written = rows(tmp_path)
    assert [r["step"] for r in written] == [0, 1, 2]
    assert written[0]["eval/pass@1"] == 0.25 and "time/eval" in written[0]
    assert "reward" not in written[0]  # no training in the step-0 row
    assert written[2]["eval/pass@1"] == 0.5  # after the last step
    assert evaluation.calls == 2


def test_without_it_or_when_resumed_no_step_0_row(tmp_path):
    runner.run(
        context(tmp_path / "a"), Steps(), 2, tmp_path / "a", evaluation=CountingEvaluation(False)
    )
    assert [r["step"] for r in rows(tmp_path / "a")] == [1, 2]
    resumed = CountingEvaluation(True)
    runner.run(
        context(tmp_path / "b"), Steps(), 2, tmp_path / "b", start_step=1, evaluation=resumed
    )
    assert [r["step"] for r in rows(tmp_path / "b")] == [2] and resumed.calls == 1


def test_the_summary_counts_trained_steps_and_shows_the_eval_before_and_after(tmp_path):
    ctx = context(tmp_path)
    history = runner.run(ctx, Steps(), 3, tmp_path, evaluation=CountingEvaluation(True))
    text = ctx.log.finish(history, tmp_path)
    assert "finished 3 steps" in text
    assert "step 0: reward 0.2500, pass@1 0.2500   step 3: reward 0.5000" in text


def test_time_shares_are_of_the_trained_steps_and_the_eval_before_has_its_own_line(tmp_path):
    history = [
        {"step": 0, "eval/reward": 0.2, "time/eval": 30.0},  # longer than all the steps
        {"step": 1, "reward": 0.5, "time/train": 8.0, "time/other": 2.0, "time/step": 10.0},
        {"step": 2, "reward": 0.5, "time/train": 6.0, "time/eval": 4.0, "time/step": 10.0},
    ]
    text = summary(history, tmp_path / "metrics.jsonl", tmp_path / "curves.png")
    assert "time share     train 70%  eval 20%  other 10%" in text
    assert "eval before    30.0s" in text
    assert "eval before" not in summary(history[1:], tmp_path / "m", tmp_path / "c")


def test_colocated_placements_refuse_it():
    assert load_config(TINY, ["eval.before_training=true"]).eval.before_training
    with pytest.raises(ConfigError, match="eval.before_training .* placement defer"):
        load_config(TINY, ["eval.before_training=true", "placement.mode=defer"])


def test_fully_asynchronous_runs_refuse_it():
    # the continuous rollout starts before the step-0 eval and would share the engines with it
    with pytest.raises(ConfigError, match="eval.before_training with algorithm.max_staleness=1"):
        load_config(TINY, ["eval.before_training=true", "algorithm.max_staleness=1"])
