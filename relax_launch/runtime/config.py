"""Config sections owned by the job runtime: checkpoints and logging."""

from __future__ import annotations

import importlib.util
from typing import Literal

from pydantic import Field, field_validator

from relax_launch.config.section import Section


class CheckpointConfig(Section):
    """Trainer state + step + data position, saved every K steps."""

    dir: str | None = Field(
        None,
        description="Checkpoint directory ({name} is the job name). Unset: a checkpoint is "
        "written only when the job is stopped, into {logging.dir}/checkpoints.",
    )
    every_steps: int = Field(
        0, ge=0, description="Save every K steps; 0 saves only at the end (always when dir is set)."
    )
    keep_last: int = Field(2, ge=0, description="Checkpoints kept in dir; 0 keeps every one.")
    resume: bool = Field(
        False,
        description="Continue from the newest complete checkpoint in dir (unset: in "
        "{logging.dir}/checkpoints): trainer state, step, prompt position; with none there "
        "yet, start from the beginning.",
    )


class WandbConfig(Section):
    """Weights & Biases logging of the per-step metrics (the run is named after the job)."""

    project: str = Field(description="W&B project the run is logged to.")
    mode: Literal["online", "offline"] = Field(
        "online",
        description="'online': stream to the W&B server (needs `wandb login` or WANDB_API_KEY); "
        "'offline': keep the run under {logging.dir}/wandb for `wandb sync` later.",
    )


class LoggingConfig(Section):
    """Where the job writes its logs and metrics."""

    dir: str = Field("runs/{name}", description="Output directory; {name} is the job name.")
    level: Literal["debug", "info", "warning", "error"] = Field(
        "info", description="Log level of every rank."
    )
    tensorboard: bool = Field(
        True,
        description="Also write TensorBoard event files into dir (`tensorboard --logdir DIR`).",
    )
    wandb: WandbConfig | None = Field(
        None,
        description="Also log the per-step metrics to Weights & Biases, e.g. "
        "{project: my-project, mode: offline}; unset: off.",
    )

    @field_validator("wandb")
    @classmethod
    def _wandb_installed(cls, wandb: WandbConfig | None) -> WandbConfig | None:
        if wandb is not None and importlib.util.find_spec("wandb") is None:
            raise ValueError(
                "logging.wandb is set but the wandb package is not installed: "
                "pip install -c requirements/pins.txt wandb (or unset logging.wandb)"
            )
        return wandb
