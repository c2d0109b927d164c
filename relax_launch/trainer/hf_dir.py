"""A Hugging Face model directory, written the way ``from_pretrained`` reads it: safetensors
shards and their index, ``config.json`` with the written dtype, ``generation_config.json``, the
tokenizer files, and a model card.

Writers run where the tensors are: each pipeline stage's first rank writes its own shards
(``write_shards``, during training) or one process writes them all (``relax-launch export``);
then one process names the shards in order, writes the index and the rest (``finish``).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

MAX_SHARD_BYTES = 2 * 2**30
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".msgpack", ".h5")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# a model's own files that are not its weights (config, tokenizer, chat template...), copied
MAX_SIDE_FILE_BYTES = 64 * 2**20


def read_weights(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors files in ``directory``; FileNotFoundError when none."""
    from safetensors.torch import load_file

    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{directory}: no *.safetensors files")
    tensors: dict[str, torch.Tensor] = {}
    for path in files:
        tensors.update(load_file(str(path)))
    return tensors


def write_shards(
    directory: Path,
    prefix: str,
    tensors: Iterable[tuple[str, torch.Tensor]],
    dtype: torch.dtype,
    max_bytes: int = MAX_SHARD_BYTES,
) -> dict[str, str]:
    """Write ``tensors`` (cast to ``dtype``) as ``{prefix}-{k}.safetensors`` files of at most
    ``max_bytes`` each; returns {tensor name: file name}. Writes nothing for no tensors."""
    from safetensors.torch import save_file

    weight_map: dict[str, str] = {}
    pending: dict[str, torch.Tensor] = {}
    size = 0

    def flush() -> None:
        nonlocal pending, size
        if pending:
            file = f"{prefix}-{len(set(weight_map.values())):05d}.safetensors"
            save_file(pending, str(directory / file), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(pending, file))
        pending, size = {}, 0

    for name, tensor in tensors:
        tensor = tensor.detach().to("cpu", dtype).contiguous()
        if tensor.untyped_storage().nbytes() != tensor.nbytes:  # a view: safetensors wants its own
            tensor = tensor.clone()
        if size and size + tensor.nbytes > max_bytes:
            flush()
        pending[name] = tensor
        size += tensor.nbytes
    flush()
    return weight_map


def finish(
    directory: Path,
    weight_map: dict[str, str],
    source: Path,
    dtype: str,
    card: str,
) -> None:
    """Name the shards model-0000k-of-0000n (in the writers' prefix order), write the index
    (none for a single file, which becomes model.safetensors), config.json with ``dtype`` and
    every non-weight file of the model directory ``source`` (tokenizer, generation config), and
    README.md with ``card``."""
    files = sorted(set(weight_map.values()))
    if len(files) == 1:
        names = {files[0]: "model.safetensors"}
    else:
        names = {
            f: f"model-{k + 1:05d}-of-{len(files):05d}.safetensors" for k, f in enumerate(files)
        }
    for old, new in names.items():
        (directory / old).replace(directory / new)
    if len(files) > 1:
        total = sum((directory / f).stat().st_size for f in names.values())
        index = {
            "metadata": {"total_size": total},
            "weight_map": {k: names[v] for k, v in sorted(weight_map.items())},
        }
        (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    copy_side_files(source, directory)
    config = json.loads((source / "config.json").read_text())
    config["torch_dtype"] = config["dtype"] = dtype
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    if not (directory / "generation_config.json").exists():
        from transformers import GenerationConfig, PretrainedConfig

        generation = GenerationConfig.from_model_config(PretrainedConfig.from_dict(config))
        generation.save_pretrained(directory)
    (directory / "README.md").write_text(card)


def copy_side_files(source: Path, directory: Path) -> None:
    """Every small non-weight file of the model directory ``source`` (config, tokenizer, chat
    template, generation config), not the index of its own weights."""
    for path in sorted(source.iterdir()):
        if (
            path.is_file()
            and not path.name.endswith(WEIGHT_SUFFIXES)
            and not path.name.endswith(".index.json")
            and path.name != "README.md"
            and path.stat().st_size <= MAX_SIDE_FILE_BYTES
        ):
            shutil.copy2(path, directory / path.name)


def model_card(title: str, base: str, details: dict[str, Any]) -> str:
    """A model card: what the model is, its base, and the run's config and final metrics."""
    lines = [
        "---",
        "library_name: transformers",
        "tags: [relax-launch, reinforcement-learning]",
        "---",
        f"# {title}",
        "",
        f"Trained with relax-launch from `{base}`.",
        "",
    ]
    for heading, value in details.items():
        lines += [f"## {heading}", "", "```json", json.dumps(value, indent=1, default=str), "```"]
        lines.append("")
    return "\n".join(lines)
