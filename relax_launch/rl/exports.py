"""Hugging Face exports of the policy during a run, and what a checkpoint records so that
``relax-launch export`` can convert it later.

An export is ``{export dir}/step_000012/``: the trainer's pipeline stages write their shards
straight from the weights (``Trainer.export_hf``: the same HF conversion the weight sync uses,
LoRA merged), then rank 0 completes the folder (index, config, tokenizer, model card;
``trainer/hf_dir.py``). Written under ``.partial`` and renamed when whole, so a folder named
``step_N`` always loads.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from relax_launch.console import operator_log
from relax_launch.trainer.hf_dir import copy_side_files, finish, model_card

if TYPE_CHECKING:
    from relax_launch.rl.context import RLContext

MODEL_RECORD = "model.json"  # in a checkpoint: the base model and the trainer's shape
MODEL_FILES = "model"  # in a checkpoint: the base model's config and tokenizer


@dataclass(frozen=True)
class PolicyExports:
    """Where and when the run exports its policy, and what describes it."""

    directory: Path
    every_steps: int
    at_end: bool
    dtype: str
    model_dir: Path  # the base model: config and tokenizer files come from it
    config: dict[str, Any]  # the job's config, for the model card and checkpoints

    def due(self, step: int, num_steps: int) -> bool:
        return (self.at_end and step == num_steps) or (
            self.every_steps > 0 and step % self.every_steps == 0
        )

    def describe(self, checkpoint: Path) -> None:
        """Record in ``checkpoint`` what its export needs: the base model's directory and files
        (config, tokenizer) and the trainer's section (its sharding, dtype, LoRA)."""
        record = {"model_dir": str(self.model_dir), "job": self.config}
        (checkpoint / MODEL_RECORD).write_text(json.dumps(record, indent=1))
        (checkpoint / MODEL_FILES).mkdir(exist_ok=True)
        copy_side_files(self.model_dir, checkpoint / MODEL_FILES)


def export_policy(ctx: RLContext, step: int, metrics: dict[str, float]) -> Path:
    """Export the policy as it is after ``step`` (whose metrics go on the model card) into
    ``step_{step}`` of the export directory."""
    exports = ctx.exports
    target = exports.directory / f"step_{step:06d}"
    partial = target.with_name(target.name + ".partial")
    for stale in (partial, target):
        shutil.rmtree(stale, ignore_errors=True)
    partial.mkdir(parents=True)
    weight_map = ctx.job.export_trainer(str(partial), exports.dtype)
    card = model_card(
        f"{exports.config['name']}, step {step}",
        str(exports.model_dir),
        {f"Metrics of step {step}": metrics, "Run config": exports.config},
    )
    finish(partial, weight_map, exports.model_dir, exports.dtype, card)
    partial.rename(target)
    operator_log().info(f"relax-launch: Hugging Face export of step {step} in {target}")
    return target
