"""An environment's dataset as the job's prompts (``rollout.environment``): the environment is
loaded in a worker process (``environment_worker.py check``) under its own interpreter, which
prints the rows and exits. This is the check before any process of the job starts
(``rl/inputs.py``), and rank 0's prompts; errors name the field at fault."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from relax_launch.rl.data import Prompt
from relax_launch.rl.environment_config import EnvironmentConfig

WORKER = Path(__file__).with_name("environment_worker.py")
ROW = "environment_row"  # a prompt's row in the environment's dataset (its meta)


class EnvironmentProblem(ValueError):
    """The environment cannot be loaded; ``field`` is the rollout.environment field at fault."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = f"rollout.environment.{field}"


def command(config: EnvironmentConfig, mode: str) -> list[str]:
    python = config.python or sys.executable
    return [python, str(WORKER), mode, config.module, json.dumps(config.args)]


def environment_prompts(config: EnvironmentConfig) -> list[Prompt]:
    """The environment's dataset as prompts, loaded in a worker that then exits: the check
    before any process of the job starts (``rl/inputs.py``) and rank 0's prompts."""
    try:
        done = subprocess.run(
            command(config, "check"),
            capture_output=True,
            text=True,
            timeout=config.load_timeout_s,
        )
    except subprocess.TimeoutExpired:
        raise EnvironmentProblem(
            "load_timeout_s", f"{config.module} did not load within {config.load_timeout_s} s"
        ) from None
    except OSError as exc:
        python = command(config, "check")[0]
        raise EnvironmentProblem("python", f"cannot run {python}: {exc}") from None
    lines = done.stdout.strip().splitlines()
    if not lines:
        tail = done.stderr.strip()[-600:]
        raise EnvironmentProblem(
            "python", f"the environment's worker exited {done.returncode}: {tail}"
        )
    reply = json.loads(lines[-1])
    if "error" in reply:
        raise EnvironmentProblem(reply["field"], f"{config.module}: {reply['error']}")
    return [
        Prompt(i, tuple(row["prompt"]), row["answer"], row["task"], {ROW: i})
        for i, row in enumerate(reply["rows"])
    ]
