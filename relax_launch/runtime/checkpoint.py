"""Checkpoints of a run: the trainer's state per (TP, PP) shard and the controller's position.

Layout under ``checkpoint.dir``::

    step_000012/trainer_tp0_pp0.pt   model + optimizer of one shard (written by its DP-0 rank)
    step_000012/controller.json      RL step, prompt cursor, counters (written by rank 0)
    step_000012/COMPLETE             written last: a directory without it is ignored

A crash while saving leaves an incomplete directory that resume skips. Stdlib only; the trainer
ranks write their shards themselves (``Trainer.save``), rank 0 writes the rest.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

COMPLETE = "COMPLETE"
CONTROLLER = "controller.json"


class Checkpoints:
    """The checkpoint directory of one run: where a step goes, what is newest, what to prune."""

    def __init__(self, directory: Path, keep_last: int) -> None:
        self.directory, self.keep_last = directory, keep_last

    def step_dir(self, step: int) -> Path:
        return self.directory / f"step_{step:06d}"

    def newest(self) -> tuple[int, Path] | None:
        """The newest complete checkpoint (step, directory), or None."""
        complete = [
            (int(d.name[5:]), d)
            for d in self.directory.glob("step_*")
            if d.name[5:].isdigit() and (d / COMPLETE).is_file()
        ]
        return max(complete) if complete else None

    def prepare(self, step: int) -> Path:
        """An empty directory for ``step`` (a leftover incomplete one is cleared)."""
        target = self.step_dir(step)
        if target.exists():
            shutil.rmtree(target)
        target.mkdir(parents=True)
        return target

    def complete(self, step: int, controller: dict[str, Any]) -> Path:
        """Write the controller's state and the marker, then drop checkpoints beyond
        ``keep_last`` (0 keeps all)."""
        target = self.step_dir(step)
        _write_atomically(target / CONTROLLER, json.dumps(controller, indent=1))
        _write_atomically(target / COMPLETE, str(step))
        if self.keep_last:
            steps = sorted(
                int(d.name[5:]) for d in self.directory.glob("step_*") if d.name[5:].isdigit()
            )
            for old in steps[: -self.keep_last]:
                shutil.rmtree(self.step_dir(old), ignore_errors=True)
        return target

    @staticmethod
    def controller_state(directory: Path) -> dict[str, Any]:
        return json.loads((directory / CONTROLLER).read_text())


def _write_atomically(path: Path, text: str) -> None:
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text)
    os.replace(partial, path)
