"""A trainer checkpoint as a Hugging Face model, or a LoRA run's as a PEFT adapter: what
``relax-launch export`` writes.

A checkpoint holds one Megatron state dict per (TP, PP) rank. Each stage's TP shards are joined
along their split dimension and converted by the function the weight sync and the live export use
(``hf_conversion.megatron_to_hf``). A LoRA checkpoint holds the adapters alone: the base comes
from the model directory it records, sharded as the trainer shards it (``hf_to_megatron``), and
each shard merges its adapters (``lora.merged``) before the join, as in training.
"""

from __future__ import annotations

import itertools
import json
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from relax_launch.models.registry import is_vision_language_config
from relax_launch.rl.checkpoints import COMPLETE, Checkpoints
from relax_launch.rl.exports import MODEL_FILES, MODEL_RECORD
from relax_launch.run_dir import JOB_RECORD
from relax_launch.trainer.config import LoraConfig
from relax_launch.trainer.hf_conversion import (
    hf_to_megatron,
    is_expert,
    local_experts,
    megatron_to_hf,
    stage_layers,
    tp_split_dim,
)
from relax_launch.trainer.hf_dir import (
    DTYPES,
    copy_side_files,
    finish,
    model_card,
    read_weights,
    write_shards,
)
from relax_launch.trainer.lora import COLUMN, SPLIT, merged, peft_config, peft_tensors
from relax_launch.trainer.model_shape import ModelShape
from relax_launch.trainer.trainer import shard_name
from relax_launch.trainer.vlm_conversion import (
    VLShape,
    vlm_hf_to_megatron,
    vlm_megatron_to_hf,
    vlm_tp_split_dim,
)


class ExportError(ValueError):
    """A checkpoint that cannot be exported as asked; the message says what to do."""


def find_checkpoint(path: Path) -> Path:
    """``path`` itself when it is a complete checkpoint, else the newest complete one of the run
    directory ``path`` (its ``checkpoints/``, or the ``checkpoint.dir`` its config names)."""
    if (path / COMPLETE).is_file():
        return path
    if path.name.startswith("step_") and path.is_dir():
        raise ExportError(f"{path} is an incomplete checkpoint (no {COMPLETE} marker)")
    places = [path / "checkpoints"]
    record = path / JOB_RECORD
    if record.is_file():  # the run directory records where its checkpoints went
        job = json.loads(record.read_text())
        directory = (job.get("checkpoint") or {}).get("dir")
        if directory:
            places.insert(0, Path(directory.format(name=job.get("name", ""))))
    for place in places:
        newest = Checkpoints(place, 0).newest() if place.is_dir() else None
        if newest is not None:
            return newest[1]
    hf = sorted((path / "hf").glob("step_*")) if (path / "hf").is_dir() else []
    hint = f"; the run's final policy is already exported in {hf[-1]}" if hf else ""
    raise ExportError(
        f"{path}: no complete checkpoint there (looked in {', '.join(map(str, places))}){hint}"
    )


@dataclass(frozen=True)
class CheckpointModel:
    """The policy a checkpoint holds, with what its conversion needs."""

    directory: Path
    model_dir: Path  # the base model the run started from
    shape: ModelShape
    tp_size: int
    pp_size: int
    ep_size: int
    dtype: str
    lora: LoraConfig | None
    job: dict  # the config of the run that saved it
    vision: VLShape | None = None  # a vision-language model's (shape: its language model's)

    @classmethod
    def open(cls, directory: Path) -> CheckpointModel:
        record_path = directory / MODEL_RECORD
        if not record_path.is_file():
            raise ExportError(
                f"{directory} has no {MODEL_RECORD}: it was written by a relax-launch that did not "
                "record its model; export it with the version that wrote it"
            )
        record = json.loads(record_path.read_text())
        trainer = record["job"]["trainer"]
        config = json.loads((directory / MODEL_FILES / "config.json").read_text())
        lora = LoraConfig(**trainer["lora"]) if trainer.get("lora") else None
        vision = None
        if is_vision_language_config(config):
            vision = VLShape.from_hf_config(config)
        model = cls(
            directory=directory,
            model_dir=Path(record["model_dir"]),
            shape=vision.text if vision else ModelShape.from_hf_config(config),
            tp_size=trainer["tp_size"],
            pp_size=trainer["pp_size"],
            ep_size=trainer.get("ep_size", 1),
            dtype=trainer["dtype"],
            lora=lora,
            job=record["job"],
            vision=vision,
        )
        for tp, pp, ep in itertools.product(
            range(model.tp_size), range(model.pp_size), range(model.ep_size)
        ):
            if not model.shard_path(tp, pp, ep).is_file():
                raise ExportError(f"{model.shard_path(tp, pp, ep)} is missing from the checkpoint")
        return model

    def shard_path(self, tp_rank: int, pp_rank: int, ep_rank: int = 0) -> Path:
        return self.directory / shard_name(tp_rank, pp_rank, ep_rank)

    def saved(self, pp_rank: int, ep_rank: int = 0) -> list[dict[str, torch.Tensor]]:
        """The model state saved by each TP rank of stage ``pp_rank`` (and EP rank)."""
        return [
            torch.load(self.shard_path(tp, pp_rank, ep_rank), map_location="cpu", mmap=True)[
                "model"
            ]
            for tp in range(self.tp_size)
        ]

    def merged_stage(self, pp_rank: int, base: dict[str, torch.Tensor] | None) -> list[dict]:
        """Each TP rank's full Megatron state of stage ``pp_rank``; a LoRA checkpoint's is the
        base (``base``: the HF tensors) sharded like the trainer's, with the adapters merged."""
        saved = self.saved(pp_rank)
        if self.lora is None:
            return saved
        stages = []
        for tp_rank, adapters in enumerate(saved):
            if self.vision is not None:  # the language model sharded, the tower whole
                state = vlm_hf_to_megatron(base, self.vision, tp_rank=tp_rank, tp_size=self.tp_size)
            else:
                state = hf_to_megatron(
                    base,
                    self.shape,
                    tp_rank=tp_rank,
                    tp_size=self.tp_size,
                    pp_rank=pp_rank,
                    pp_size=self.pp_size,
                )
            for name in (k for k in adapters if k.endswith(".lora_a")):
                linear = name.removesuffix(".lora_a")
                state[f"{linear}.weight"] = merged(
                    state[f"{linear}.weight"],
                    adapters[name],
                    adapters[f"{linear}.lora_b"],
                    self.lora.scale,
                )
            stages.append(state)
        return stages

    def hf_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The whole model under Hugging Face names (LoRA merged), stage by stage; the experts
        of each EP rank from its own shards, the rest from EP rank 0's."""
        base = load_base(self.model_dir) if self.lora is not None else None
        if self.vision is not None:  # one stage, no experts (config/vlm_rules.py)
            shards = self.merged_stage(0, base)
            for name in (n for n in shards[0] if not n.endswith("._extra_state")):
                whole = self._joined(shards, name, vlm_tp_split_dim(name))
                yield from vlm_megatron_to_hf(name, whole, self.vision, tp_size=self.tp_size)
            return
        for pp_rank in range(self.pp_size):
            offset = stage_layers(self.shape, pp_rank, self.pp_size).start
            for ep_rank in range(self.ep_size):
                shards = (
                    self.saved(pp_rank, ep_rank) if ep_rank else self.merged_stage(pp_rank, base)
                )
                experts = local_experts(self.shape, ep_rank, self.ep_size)
                for name in shards[0]:
                    if name.endswith("._extra_state") or (ep_rank and not is_expert(name)):
                        continue
                    yield from megatron_to_hf(
                        name,
                        self._joined(shards, name, tp_split_dim(name)),
                        self.shape,
                        tp_size=self.tp_size,
                        layer_offset=offset,
                        expert_offset=experts.start,
                    )

    def adapter_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The adapters under PEFT's names (``lora.peft_tensors``), stage by stage."""
        for pp_rank in range(self.pp_size):
            shards = self.saved(pp_rank)
            offset = stage_layers(self.shape, pp_rank, self.pp_size).start
            for name in (k for k in shards[0] if k.endswith(".lora_a")):
                linear = name.removesuffix(".lora_a")
                column = SPLIT[linear.rsplit(".", 1)[-1]] == COLUMN
                a = self._joined(shards, name, None if column else 1)
                b = self._joined(shards, f"{linear}.lora_b", 0 if column else None)
                yield from peft_tensors(linear, a, b, self.shape, self.tp_size, offset)

    def _joined(self, shards: list[dict], name: str, dim: int | None) -> torch.Tensor:
        if dim is None or self.tp_size == 1:
            return shards[0][name]
        return torch.cat([s[name] for s in shards], dim=dim)


def load_base(model_dir: Path) -> dict[str, torch.Tensor]:
    """The base model's tensors a LoRA checkpoint's adapters merge into."""
    try:
        return read_weights(model_dir)
    except FileNotFoundError:
        raise ExportError(
            f"{model_dir}: the base model of this LoRA checkpoint is not there (a LoRA checkpoint "
            "holds only the adapters); restore the model directory or export with the adapters "
            "alone (without --merge-lora)"
        ) from None


def export_checkpoint(
    path: Path, out: Path, dtype: str | None = None, merge_lora: bool = False
) -> Path:
    """Write the checkpoint at ``path`` (or a run directory's newest) into the new directory
    ``out``: a Hugging Face model, or for a LoRA checkpoint a PEFT adapter (``merge_lora``: the
    merged model). ``dtype``: "float32" or "bfloat16" (unset: the trainer's). Returns ``out``."""
    checkpoint = CheckpointModel.open(find_checkpoint(path))
    if merge_lora and checkpoint.lora is None:
        raise ExportError(
            f"{checkpoint.directory} is a full fine-tune, not LoRA: drop --merge-lora"
        )
    if checkpoint.lora is not None and checkpoint.vision is not None and not merge_lora:
        raise ExportError(
            f"{checkpoint.directory} holds LoRA adapters of a vision-language model, which "
            "export merged only (no PEFT adapter form yet): add --merge-lora"
        )
    if out.exists() and any(out.iterdir()):
        raise ExportError(f"{out} exists and is not empty: choose a new --out directory")
    dtype = dtype or checkpoint.dtype
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    source = checkpoint.directory / MODEL_FILES
    card = model_card(
        f"{checkpoint.job.get('name', 'relax-launch run')}, {checkpoint.directory.name}",
        str(checkpoint.model_dir),
        {"Run config": checkpoint.job},
    )
    if checkpoint.lora is not None and not merge_lora:
        write_adapter(checkpoint, partial, DTYPES[dtype], source, card)
    else:
        weight_map = write_shards(partial, "model", checkpoint.hf_tensors(), DTYPES[dtype])
        finish(partial, weight_map, source, dtype, card)
    if out.exists():
        out.rmdir()
    partial.rename(out)
    return out


def write_adapter(
    checkpoint: CheckpointModel, out: Path, dtype: torch.dtype, source: Path, card: str
) -> None:
    """PEFT's layout: ``adapter_model.safetensors`` and ``adapter_config.json``, with the
    tokenizer files and a model card."""
    from safetensors.torch import save_file

    tensors = {k: v.to(dtype).contiguous() for k, v in checkpoint.adapter_tensors()}
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = peft_config(checkpoint.lora, str(checkpoint.model_dir))
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2))
    copy_side_files(source, out)
    (out / "config.json").unlink(missing_ok=True)  # an adapter folder is not a model folder
    (out / "README.md").write_text(card)
