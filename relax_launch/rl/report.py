"""What a run shows and leaves behind: a progress line per step, metrics.jsonl, a PNG of the
curves and a one-screen summary."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

from PIL import Image, ImageDraw
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from relax_launch.rl.tensorboard import EventWriter

PHASE_KEYS = ("rollout", "teacher", "reward", "train", "wait", "sync", "checkpoint", "other")
# One panel per row: its title and the curves it draws (each only when the run has it).
PANELS = (
    ("reward", ("reward",)),
    ("KL", ("reverse_kl", "kl_ref")),
    ("seconds per phase", tuple(f"time/{p}" for p in PHASE_KEYS)),
)
COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#17becf", "#7f7f7f")


class MetricsLog:
    """Appends one JSON object per step to ``{dir}/metrics.jsonl`` (and TensorBoard scalars).

    ``resume_step`` keeps the rows of steps up to it from an earlier run (in ``history``) and
    drops later ones, which the resumed run writes again.
    """

    def __init__(self, log_dir: Path, tensorboard: bool = False, resume_step: int = 0) -> None:
        log_dir.mkdir(parents=True, exist_ok=True)
        self.path = log_dir / "metrics.jsonl"
        self.history: list[dict[str, float]] = []
        if resume_step and self.path.is_file():
            rows = [json.loads(line) for line in self.path.read_text().splitlines() if line]
            self.history = [r for r in rows if r.get("step", 0) <= resume_step]
        self.path.write_text("".join(json.dumps(r) + "\n" for r in self.history))
        self.events = EventWriter(log_dir) if tensorboard else None

    def write(self, metrics: dict[str, float]) -> None:
        with self.path.open("a") as out:
            out.write(json.dumps(metrics) + "\n")
        if self.events is not None:
            self.events.add(int(metrics["step"]), metrics)

    def finish(self, history: list[dict[str, float]], log_dir: Path) -> str:
        """The run's summary, after drawing its curves."""
        return summary(history, self.path, plot_curves(history, log_dir / "curves.png"))


class StepProgress:
    """One line per step on the operator's console, ending with the time left; on a terminal,
    a live bar with the ETA stays below the lines."""

    def __init__(self, console: Console, total: int, done: int) -> None:
        self.total, self.done = total, done
        self.step_seconds: list[float] = []  # this run's steps (a resumed run's only)
        self.bar = Progress(
            TextColumn("relax-launch"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("ETA"),
            TimeRemainingColumn(),
            console=console,
            disable=not console.is_terminal,
        )
        self.task = self.bar.add_task("steps", total=total, completed=done)

    def __enter__(self) -> StepProgress:
        self.bar.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.bar.stop()

    def step(self, metrics: dict[str, float]) -> None:
        self.done = int(metrics["step"])
        self.step_seconds.append(metrics["time/step"])
        self.bar.update(self.task, completed=self.done)
        line = self.line(metrics)
        self.bar.console.print(line, markup=False, highlight=False, soft_wrap=True)
        logging.getLogger(__name__).info(line)  # the rank's log keeps the console's record

    def line(self, m: dict[str, float]) -> str:
        parts = [f"step {int(m['step'])}/{self.total}", f"reward {m['reward']:.3f}"]
        parts += [
            f"{k.split('/')[1]} {v:.3f}"
            for k, v in m.items()
            if k.startswith("reward/") and not k.endswith("/failed")
        ]
        if "reverse_kl" in m:
            parts.append(f"rev-KL {m['reverse_kl']:.4f}")
        if "kl_ref" in m:
            parts.append(f"KL-ref {m['kl_ref']:.4f}")
        if m.get("staleness"):
            parts.append(f"stale {int(m['staleness'])}")
        parts.append(f"{m['tokens_per_s']:.0f} tok/s")
        parts.append(" ".join(f"{p} {m[f'time/{p}']:.1f}s" for p in PHASE_KEYS if f"time/{p}" in m))
        return "relax-launch: " + " | ".join(parts) + f" | ETA {self.eta()}"

    def eta(self) -> str:
        """The steps left times the mean step time so far."""
        mean = sum(self.step_seconds) / len(self.step_seconds)
        left = round(mean * (self.total - self.done))
        return f"{left // 60}:{left % 60:02d}"


def summary(history: list[dict[str, float]], metrics_path: Path, plot: Path) -> str:
    """First vs last rewards (means over the first and last quarter of the steps)."""
    k = max(1, len(history) // 4)

    def mean(rows: list[dict[str, float]], key: str) -> float:
        values = [r[key] for r in rows if key in r and not math.isnan(r[key])]
        return sum(values) / len(values) if values else float("nan")

    lines = [f"relax-launch: finished {len(history)} steps"]
    for key in ("reward", "reverse_kl", "kl_ref", "tokens_per_s", "time/step"):
        if any(key in r for r in history):
            lines.append(
                f"  {key:<14} first {k}: {mean(history[:k], key):9.4f}   "
                f"last {k}: {mean(history[-k:], key):9.4f}"
            )
    share = {p: sum(r.get(f"time/{p}", 0.0) for r in history) for p in PHASE_KEYS}
    total = sum(r["time/step"] for r in history) or 1.0
    shares = "  ".join(f"{p} {v / total:.0%}" for p, v in share.items() if v)
    lines.append("  time share     " + shares)
    if share["wait"] or any(r.get("staleness") for r in history):
        lines.append(
            "                 (one step off-policy: rollout, teacher and reward overlap train)"
        )
    lines.append(f"  metrics: {metrics_path}   curves: {plot}")
    return "\n".join(lines)


def plot_curves(history: list[dict[str, float]], path: Path) -> Path:
    """One panel per row of ``PANELS`` (reward, KL, seconds per phase) against the step."""
    width, panel = 720, 200
    shown = [(title, [k for k in keys if any(k in r for r in history)]) for title, keys in PANELS]
    shown = [(title, keys) for title, keys in shown if keys]
    image = Image.new("RGB", (width, panel * max(1, len(shown))), "white")
    draw = ImageDraw.Draw(image)
    for row, (title, keys) in enumerate(shown):
        series = {
            key: [(r["step"], r[key]) for r in history if key in r and not math.isnan(r[key])]
            for key in keys
        }
        values = [v for points in series.values() for _, v in points]
        top, left, right, bottom = row * panel + 24, 60, width - 20, (row + 1) * panel - 24
        draw.rectangle([left, top, right, bottom], outline="#999999")
        if not values:
            draw.text((left, top - 18), title, fill="black")
            continue
        steps = [s for points in series.values() for s, _ in points]
        lo, hi = min(values), max(values)
        hi = hi if hi > lo else lo + 1.0
        first, span = min(steps), (max(steps) - min(steps)) or 1
        legend = left
        draw.text((legend, top - 18), f"{title}:", fill="black")
        legend += 8 * len(title) + 12
        for i, (key, points) in enumerate(series.items()):
            color = COLORS[i % len(COLORS)]
            name = key.removeprefix("time/")
            draw.text((legend, top - 18), name, fill=color)
            legend += 7 * len(name) + 12
            pixels = [
                (
                    left + (right - left) * (step - first) / span,
                    bottom - (bottom - top) * (value - lo) / (hi - lo),
                )
                for step, value in points
            ]
            if len(pixels) > 1:
                draw.line(pixels, fill=color, width=2)
            for x, y in pixels:
                draw.ellipse([x - 2, y - 2, x + 2, y + 2], fill=color)
        draw.text((4, top), f"{hi:.3g}", fill="black")
        draw.text((4, bottom - 12), f"{lo:.3g}", fill="black")
    image.save(path)
    return path
