"""A run's learning curve from its metrics.jsonl: the training reward per step and the held-out
pass@1 at each evaluation (step 0: ``eval.before_training``) into a PNG, and the same as a
Markdown table on stdout (docs/benchmarks.md).

    .venv/bin/python bench/plot_curve.py RUN_DIR/metrics.jsonl OUT.png
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure


def rows(path: Path) -> list[dict[str, float]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot(history: list[dict[str, float]], out: Path) -> None:
    trained = [r for r in history if "reward" in r]
    evaluated = [r for r in history if "eval/pass@1" in r]
    figure = Figure(figsize=(7, 3.6), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    axes.plot(
        [r["step"] for r in trained],
        [r["reward"] for r in trained],
        "o-",
        ms=3,
        alpha=0.6,
        label="training reward (mean of the step's samples)",
    )
    axes.plot(
        [r["step"] for r in evaluated],
        [r["eval/pass@1"] for r in evaluated],
        "s-",
        color="C3",
        label="held-out accuracy (greedy pass@1)",
    )
    axes.set(xlabel="step", ylabel="fraction right", ylim=(0, 1))
    axes.grid(alpha=0.3)
    axes.legend(loc="upper left", fontsize="small")
    figure.savefig(out, dpi=100)


def table(history: list[dict[str, float]]) -> str:
    lines = ["| step | reward | held-out pass@1 | step s |", "|---|---|---|---|"]
    for r in history:
        held_out = f"{r['eval/pass@1']:.3f}" if "eval/pass@1" in r else ""
        reward = f"{r['reward']:.3f}" if "reward" in r else ""
        seconds = f"{r['time/step']:.1f}" if "time/step" in r else ""
        lines.append(f"| {int(r['step'])} | {reward} | {held_out} | {seconds} |")
    return "\n".join(lines)


if __name__ == "__main__":
    history = rows(Path(sys.argv[1]))
    plot(history, Path(sys.argv[2]))
    print(table(history))
