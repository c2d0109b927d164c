"""Model references: builtin:NAME or a directory, and the shape facts preflight checks.

Facts of builtin models are tabled here so that ``relax-launch plan`` can check them without
building the model (which needs torch). ``relax_launch.models.build`` makes the directories.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

BUILTIN_PREFIX = "builtin:"


@dataclass(frozen=True)
class ModelFacts:
    """The parts of a Hugging Face config that placement and weight sync depend on."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    has_architectures: bool = True


BUILTIN_MODELS = {
    "smollm2-135m-instruct": ModelFacts(
        num_layers=30,
        hidden_size=576,
        num_attention_heads=9,
        num_key_value_heads=3,
        vocab_size=49152,
    ),
    # The first 4 of SmolLM2's 30 layers with its embeddings and tokenizer: a distillation student.
    "smollm2-student": ModelFacts(
        num_layers=4,
        hidden_size=576,
        num_attention_heads=9,
        num_key_value_heads=3,
        vocab_size=49152,
    ),
    "tiny-llama": ModelFacts(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=320,
    ),
}


def cache_dir() -> Path:
    """Where built models are cached: $RELAX_LAUNCH_CACHE or ~/.cache/relax-launch."""
    return Path(os.environ.get("RELAX_LAUNCH_CACHE") or Path.home() / ".cache" / "relax-launch")


def builtin_name(ref: str) -> str | None:
    """The builtin model name of ``ref``, or None when ``ref`` is a directory."""
    return ref[len(BUILTIN_PREFIX) :] if ref.startswith(BUILTIN_PREFIX) else None


def model_dir(ref: str) -> Path:
    """The directory ``ref`` names (a builtin model's cache directory, built or not)."""
    name = builtin_name(ref)
    return cache_dir() / "models" / name if name is not None else Path(ref).expanduser()


def model_facts(ref: str) -> ModelFacts | None:
    """Shape facts of ``ref``; None when it is a directory without a readable config.json."""
    name = builtin_name(ref)
    if name is not None:
        return BUILTIN_MODELS.get(name)
    path = model_dir(ref) / "config.json"
    if not path.is_file():
        return None
    cfg = json.loads(path.read_text())
    heads = cfg.get("num_attention_heads", 0)
    return ModelFacts(
        num_layers=cfg.get("num_hidden_layers", 0),
        hidden_size=cfg.get("hidden_size", 0),
        num_attention_heads=heads,
        num_key_value_heads=cfg.get("num_key_value_heads") or heads,
        vocab_size=cfg.get("vocab_size", 0),
        has_architectures=bool(cfg.get("architectures")),
    )
