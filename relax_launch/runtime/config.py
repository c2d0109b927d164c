"""Config sections owned by the job runtime: checkpoints and logging."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from relax_launch.config.section import Section


class CheckpointConfig(Section):
    """Trainer state + step + data position, saved every K steps."""

    dir: str | None = Field(None, description="Checkpoint directory; unset disables saving.")
    every_steps: int = Field(0, ge=0, description="Save every K steps; 0 saves only at the end.")
    resume: bool = Field(False, description="Continue from the newest checkpoint in dir.")


class LoggingConfig(Section):
    """Where the job writes its logs and metrics."""

    dir: str = Field("runs/{name}", description="Output directory; {name} is the job name.")
    level: Literal["debug", "info", "warning", "error"] = Field(
        "info", description="Log level of every rank."
    )
    tensorboard: bool = Field(True, description="Also write TensorBoard event files.")
