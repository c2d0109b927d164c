"""Checkpoints of a run: the trainer's state per (TP, PP) shard and the controller's position.

Layout under ``checkpoint.dir``::

    step_000012/trainer_tp0_pp0.pt   model + optimizer of one shard (written by its DP-0 rank)
    step_000012/controller.json      RL step, prompt cursor, counters (written by rank 0)
    step_000012/COMPLETE             written last: a directory without it is ignored

A crash while saving leaves an incomplete directory that resume skips and ``keep_last`` does not
count. Every file is written durably (``write_durably``: written under a temporary name, fsynced,
renamed, the directory fsynced), and the marker only after them all, so a checkpoint marked
complete survives a power loss or a node that dies right after. Stdlib only; the trainer ranks
write their shards themselves (``Trainer.save``), rank 0 writes the rest.
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

    def complete_steps(self) -> list[tuple[int, Path]]:
        """Every complete checkpoint (step, directory), oldest first."""
        return sorted(
            (int(d.name[5:]), d)
            for d in self.directory.glob("step_*")
            if d.name[5:].isdigit() and (d / COMPLETE).is_file()
        )

    def newest(self) -> tuple[int, Path] | None:
        """The newest complete checkpoint (step, directory), or None."""
        complete = self.complete_steps()
        return complete[-1] if complete else None

    def prepare(self, step: int) -> Path:
        """An empty directory for ``step`` (a leftover incomplete one is cleared)."""
        target = self.step_dir(step)
        if target.exists():
            shutil.rmtree(target)
        target.mkdir(parents=True)
        return target

    def complete(self, step: int, controller: dict[str, Any]) -> Path:
        """Write the controller's state and the marker, then drop the complete checkpoints
        beyond ``keep_last`` (0 keeps all) and the incomplete ones older than this one."""
        target = self.step_dir(step)
        write_durably(target / CONTROLLER, json.dumps(controller, indent=1).encode())
        write_durably(target / COMPLETE, str(step).encode())  # its directory fsync covers the
        # trainer shards' renames too (each shard's data was fsynced by the rank that wrote it)
        complete = self.complete_steps()
        dropped = complete[: -self.keep_last] if self.keep_last else []
        for _, directory in dropped:
            shutil.rmtree(directory, ignore_errors=True)
        for d in self.directory.glob("step_*"):  # left by a crash while saving
            if d.name[5:].isdigit() and int(d.name[5:]) < step and not (d / COMPLETE).exists():
                shutil.rmtree(d, ignore_errors=True)
        return target

    @staticmethod
    def controller_state(directory: Path) -> dict[str, Any]:
        return json.loads((directory / CONTROLLER).read_text())


def write_durably(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path``: all of it or nothing, and on disk before this returns (fsync
    of the file, then of its directory after the rename)."""
    partial = path.with_name(path.name + ".partial")
    with open(partial, "wb") as file:
        file.write(data)
        file.flush()
        os.fsync(file.fileno())
    os.replace(partial, path)
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)
