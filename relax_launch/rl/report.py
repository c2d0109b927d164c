"""What a run shows and leaves behind: a progress line per step, the metrics (metrics.jsonl,
TensorBoard, optionally Weights & Biases), a PNG of the curves and a one-screen summary."""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from relax_launch.rl.config import LoggingConfig, WandbConfig

if TYPE_CHECKING:
    from matplotlib.figure import Figure

PHASE_KEYS = (
    "rollout",
    "teacher",
    "reward",
    "train",
    "wait",
    "sync",
    "checkpoint",
    "eval",
    "other",
)
# A reward source's counts (reward/NAME/failed, /timeouts), not its mean reward: not shown.
COUNTS = ("/failed", "/timeouts")
# One panel per entry: title, y-axis label and the curves it draws (each only when the run has
# it); one panel per reward source follows "reward".
PANELS = (
    ("reward", "mean reward", ("reward",)),
    ("evaluation", "mean reward, pass@k", ()),  # its curves: the run's eval scores
    ("KL", "nats per token", ("reverse_kl", "kl_ref", "approx_kl")),
    ("policy loss", "loss", ("loss",)),
    ("gradient norm", "L2 norm", ("grad_norm",)),
    ("value model", "loss, explained variance", ("critic/value_loss", "critic/explained_variance")),
    ("seconds per phase", "seconds", tuple(f"time/{p}" for p in PHASE_KEYS)),
    ("rollout throughput", "tokens/s", ("tokens_per_s",)),
    ("response length", "tokens per sample", ("response_tokens",)),
    ("weight sync", "GB/s", ("sync/gb_per_s",)),
)
SMOOTHING = 0.6  # EMA weight of the previous smoothed value (TensorBoard's slider)
WANDB_RUN_ID = "wandb-run-id"  # in the run dir: the W&B run a resumed job continues


class MetricsSink(Protocol):
    """Somewhere each step's scalars go besides metrics.jsonl (TensorBoard, W&B)."""

    def write(self, step: int, scalars: dict[str, float]) -> None: ...

    def close(self) -> None: ...


class MetricsLog:
    """Appends one JSON object per step to ``{dir}/metrics.jsonl`` and hands its numbers to the
    sinks.

    ``resume_step`` keeps the rows of steps up to it from an earlier run (in ``history``) and
    drops later ones, which the resumed run writes again.
    """

    def __init__(
        self, log_dir: Path, resume_step: int = 0, sinks: Sequence[MetricsSink] = ()
    ) -> None:
        log_dir.mkdir(parents=True, exist_ok=True)
        self.path = log_dir / "metrics.jsonl"
        self.history: list[dict[str, float]] = []
        if resume_step and self.path.is_file():
            rows = [json.loads(line) for line in self.path.read_text().splitlines() if line]
            self.history = [r for r in rows if r.get("step", 0) <= resume_step]
        self.path.write_text("".join(json.dumps(r) + "\n" for r in self.history))
        self.sinks = list(sinks)

    def write(self, metrics: dict[str, float]) -> None:
        with self.path.open("a") as out:
            out.write(json.dumps(metrics) + "\n")
        scalars = {
            key: float(value)
            for key, value in metrics.items()
            if key != "step" and isinstance(value, int | float) and not math.isnan(value)
        }
        for sink in self.sinks:
            sink.write(int(metrics["step"]), scalars)

    def close(self) -> None:
        """Close the sinks (once; a W&B run keeps a service process until closed)."""
        sinks, self.sinks = self.sinks, []
        for sink in sinks:
            sink.close()

    def finish(self, history: list[dict[str, float]], log_dir: Path) -> str:
        """Close the sinks; the run's summary, after drawing its curves."""
        self.close()
        path = log_dir / "curves.png"
        plot_curves(history, path)
        return summary(history, self.path, path)


def metric_sinks(
    settings: LoggingConfig,
    log_dir: Path,
    resume_step: int,
    run_name: str,
    run_config: dict[str, Any],
) -> list[MetricsSink]:
    """The sinks ``logging`` asks for; ``run_config`` (the job's config) goes along to W&B."""
    sinks: list[MetricsSink] = []
    if settings.tensorboard:
        sinks.append(TensorBoardSink(log_dir, resume_step))
    if settings.wandb is not None:
        sinks.append(WandbSink(settings.wandb, log_dir, resume_step, run_name, run_config))
    return sinks


class TensorBoardSink:
    """Scalars in ``{log_dir}/events.out.tfevents.*``, a new file per launch. A launch resumed
    from a checkpoint at step S hides the events of earlier files from step S+1 on (TensorBoard's
    purge_step), so steps run again after a crash are not shown twice; a launch from step 0 hides
    all of them, step 0 (eval.before_training's row) included."""

    def __init__(self, log_dir: Path, resume_step: int) -> None:
        from torch.utils.tensorboard import SummaryWriter  # rank 0 only, when enabled

        # purge_step P hides the earlier files' events at steps >= P. A resumed launch writes
        # from S+1 on; a fresh one may write step 0 (eval.before_training), so it hides them all.
        self.writer = SummaryWriter(str(log_dir), purge_step=resume_step + 1 if resume_step else 0)

    def write(self, step: int, scalars: dict[str, float]) -> None:
        for tag, value in scalars.items():
            self.writer.add_scalar(tag, value, step)
        self.writer.flush()  # a crashed run keeps every step it wrote

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    """Each step logged to a W&B run whose files live under ``{log_dir}/wandb``. The run's id
    is kept in ``{log_dir}/wandb-run-id``: a job resumed at step S rewinds that run to S
    (W&B's ``resume_from``), so steps run again after a crash replace the earlier ones, as in
    metrics.jsonl; a fresh start begins a new run."""

    def __init__(
        self,
        settings: WandbConfig,
        log_dir: Path,
        resume_step: int,
        run_name: str,
        run_config: dict[str, Any],
    ) -> None:
        import wandb  # only when logging.wandb is set

        id_file = log_dir / WANDB_RUN_ID
        rewind = None
        if resume_step and id_file.is_file():
            rewind = f"{id_file.read_text().strip()}?_step={resume_step}"
        self.wandb = wandb
        self.run = wandb.init(
            project=settings.project,
            mode=settings.mode,
            dir=str(log_dir),
            name=run_name,
            config=run_config,
            settings=wandb.Settings(console="off"),  # the rank log already has the output
            resume_from=rewind,
        )
        id_file.write_text(self.run.id)

    def write(self, step: int, scalars: dict[str, float]) -> None:
        self.run.log(scalars, step=step)

    def close(self) -> None:
        self.run.finish()
        self.wandb.teardown()  # stops the wandb-core service this process started


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
            if k.startswith("reward/") and not k.endswith(COUNTS)
        ]
        if "reverse_kl" in m:
            parts.append(f"rev-KL {m['reverse_kl']:.4f}")
        if "kl_ref" in m:
            parts.append(f"KL-ref {m['kl_ref']:.4f}")
        if "critic/value_loss" in m:  # PPO's value model (advantage gae)
            v_loss, explained = m["critic/value_loss"], m["critic/explained_variance"]
            warming = " (critic warm-up)" if m.get("critic/warmup") else ""
            parts.append(f"V-loss {v_loss:.4f} EV {explained:.2f}{warming}")
        if m.get("staleness"):
            parts.append(f"stale {int(m['staleness'])}")
        if "agent/turns" in m:
            parts.append(f"turns {m['agent/turns']:.1f}")
        if "eval/reward" in m:
            scores = [
                f"{k.removeprefix('eval/')} {v:.3f}" for k, v in m.items() if is_eval_score(k)
            ]
            parts.append("eval " + " ".join(scores))
        parts.append(f"{m['tokens_per_s']:.0f} tok/s")
        parts.append(" ".join(f"{p} {m[f'time/{p}']:.1f}s" for p in PHASE_KEYS if f"time/{p}" in m))
        turns = [v for k, v in m.items() if k.startswith(("time/onload_", "time/offload_"))]
        if turns:  # split/defer: the roles' turns on the shared ranks
            moved = sum(m.get(f"memory/{k}_offloaded_gb", 0.0) for k in ("trainer", "engines"))
            parts.append(f"turns {sum(turns):.1f}s ({len(turns)} moves, {moved:.2f} GB off)")
        return "relax-launch: " + " | ".join(parts) + f" | ETA {self.eta()}"

    def eta(self) -> str:
        """The steps left times the mean step time so far."""
        mean = sum(self.step_seconds) / len(self.step_seconds)
        left = round(mean * (self.total - self.done))
        return f"{left // 60}:{left % 60:02d}"


def summary(history: list[dict[str, float]], metrics_path: Path, plot: Path) -> str:
    """First vs last rewards (means over the first and last quarter of the steps)."""
    trained = [r for r in history if "time/step" in r]  # not eval.before_training's row
    k = max(1, len(trained) // 4)

    def mean(rows: list[dict[str, float]], key: str) -> float:
        values = [r[key] for r in rows if key in r and not math.isnan(r[key])]
        return sum(values) / len(values) if values else float("nan")

    lines = [f"relax-launch: finished {len(trained)} steps"]
    for key in ("reward", "reverse_kl", "kl_ref", "critic/value_loss", "tokens_per_s", "time/step"):
        if any(key in r for r in history):
            lines.append(
                f"  {key:<14} first {k}: {mean(trained[:k], key):9.4f}   "
                f"last {k}: {mean(trained[-k:], key):9.4f}"
            )
    evaluated = [r for r in history if "eval/reward" in r]
    if evaluated:
        first, last = evaluated[0], evaluated[-1]
        scores = [k for k in last if is_eval_score(k)]
        lines.append(
            f"  {'eval':<14} step {int(first['step'])}: "
            + ", ".join(f"{k.removeprefix('eval/')} {first[k]:.4f}" for k in scores)
            + f"   step {int(last['step'])}: "
            + ", ".join(f"{k.removeprefix('eval/')} {last[k]:.4f}" for k in scores)
        )
    # Shares of the trained steps' time; eval.before_training's row has no time/step: its own line
    share = {p: sum(r.get(f"time/{p}", 0.0) for r in trained) for p in PHASE_KEYS}
    share["turns"] = sum(  # split/defer: onloads and offloads between the roles' phases
        v for r in trained for k, v in r.items() if k.startswith(("time/onload_", "time/offload_"))
    )
    total = sum(r["time/step"] for r in trained) or 1.0
    shares = "  ".join(f"{p} {v / total:.0%}" for p, v in share.items() if v)
    lines.append("  time share     " + shares)
    before = sum(r.get("time/eval", 0.0) for r in history if "time/step" not in r)
    if before:
        lines.append(f"  eval before    {before:.1f}s (before step 1, not in the shares)")
    if share["wait"] or any(r.get("staleness") for r in history):
        lines.append("                 (off-policy: rollout, teacher and reward overlap train)")
    lines.append(f"  metrics: {metrics_path}   curves: {plot}")
    return "\n".join(lines)


def is_eval_score(key: str) -> bool:
    """The evaluation's scores: its mean reward and each pass@k."""
    return key == "eval/reward" or key.startswith("eval/pass@")


def plot_curves(history: list[dict[str, float]], path: Path) -> Figure:
    """Draw ``PANELS`` (and a panel per reward source) against the step into ``path``: the raw
    points faint, an EMA over them solid. Returns the figure it saved."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # rank 0, once per run
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    panels = shown_panels(history)
    columns = 2 if len(panels) > 1 else 1
    rows = max(1, math.ceil(len(panels) / columns))
    figure = Figure(figsize=(6.5 * columns, 3.2 * rows), layout="constrained")
    FigureCanvasAgg(figure)  # no display: draw with Agg
    for index, (title, unit, keys) in enumerate(panels):
        axes = figure.add_subplot(rows, columns, index + 1)
        axes.set(title=title, xlabel="step", ylabel=unit)
        axes.grid(alpha=0.3)
        axes.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole
        for number, key in enumerate(keys):
            points = [(r["step"], r[key]) for r in history if key in r and not math.isnan(r[key])]
            steps, values = [s for s, _ in points], [v for _, v in points]
            color = f"C{number}"
            axes.plot(steps, values, color=color, alpha=0.3, marker="o", markersize=3)
            axes.plot(steps, ema(values), color=color, label=key.removeprefix("time/"))
        if len(keys) > 1:
            axes.legend(fontsize="small")
    if not panels:
        figure.text(0.5, 0.5, "no metrics", ha="center")
    figure.savefig(path, dpi=100)
    return figure


def shown_panels(history: list[dict[str, float]]) -> list[tuple[str, str, tuple[str, ...]]]:
    """The panels the run has points for, each with only the curves it has."""
    sources = sorted(
        {k for r in history for k in r if k.startswith("reward/") and not k.endswith(COUNTS)}
    )
    panels = []
    for title, unit, keys in PANELS:
        panels.append((title, unit, keys))
        if title == "evaluation":
            panels[-1] = (
                title,
                unit,
                tuple(sorted({k for r in history for k in r if is_eval_score(k)})),
            )
        if title == "reward":
            panels += [
                (f"reward: {k.removeprefix('reward/')}", "mean reward", (k,)) for k in sources
            ]
    has = [
        (
            title,
            unit,
            tuple(k for k in keys if any(not math.isnan(r.get(k, math.nan)) for r in history)),
        )
        for title, unit, keys in panels
    ]
    return [(title, unit, keys) for title, unit, keys in has if keys]


def ema(values: list[float], weight: float = SMOOTHING) -> list[float]:
    """Exponential moving average, debiased like TensorBoard's (the first point is itself)."""
    smoothed, last = [], 0.0
    for count, value in enumerate(values, 1):
        last = weight * last + (1 - weight) * value
        smoothed.append(last / (1 - weight**count))
    return smoothed
