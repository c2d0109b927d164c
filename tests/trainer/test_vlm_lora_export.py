"""``relax-launch export`` of a vision-language LoRA checkpoint: merged only (the PEFT adapter
form under Qwen2.5-VL's module names is not built); without ``--merge-lora`` it is refused
naming the flag, before anything is written. The merged export itself runs in
``tests/rl/test_vlm_job.py`` (slow)."""

from __future__ import annotations

import json

import pytest

from relax_launch.commands.export import ExportError, export_checkpoint
from relax_launch.models.build import ensure_model
from relax_launch.rl.checkpoints import COMPLETE
from relax_launch.rl.exports import MODEL_FILES, MODEL_RECORD, PolicyExports
from relax_launch.trainer.trainer import shard_name


def test_a_vlm_lora_checkpoint_exports_merged_only(tmp_path):
    model_dir = ensure_model("builtin:tiny-qwen2.5-vl")
    checkpoint = tmp_path / "step_000001"
    checkpoint.mkdir()
    trainer = {"tp_size": 1, "pp_size": 1, "dtype": "float32", "lora": {"rank": 8}}
    PolicyExports(tmp_path, 0, False, "float32", model_dir, {"trainer": trainer}).describe(
        checkpoint
    )
    (checkpoint / shard_name(0, 0)).write_bytes(b"")  # never read: refused before
    (checkpoint / COMPLETE).write_text("1")
    assert json.loads((checkpoint / MODEL_RECORD).read_text())["job"]["trainer"]["lora"]
    assert (checkpoint / MODEL_FILES / "config.json").is_file()
    with pytest.raises(ExportError, match="vision-language model.*add --merge-lora"):
        export_checkpoint(checkpoint, tmp_path / "out")
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()
