"""Weight sync of a LoRA policy served as an adapter (``trainer.lora.engines: adapter``): the
engines keep the base model and load each version's adapter, a few MB, from a directory both
sides reach (the run directory).

Each pipeline stage's first trainer rank writes its adapters, whole over TP and under PEFT's
names (``Trainer.export_adapter``); rank 0 joins them into one PEFT adapter directory
(``publish``) and asks every rollout engine to load it as ``policy-v{N}``
(``load_everywhere``), which then serves every request that names no adapter
(``inference/policy_adapter.py``); the version before is unloaded and its directory removed.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from relax_launch.inference.engine import EngineControl, EngineRequestError
from relax_launch.inference.policy_adapter import POLICY_PREFIX, adapter_name
from relax_launch.weights.update_session import EngineTarget, WeightSyncError

ADAPTER_FILE = "adapter_model.safetensors"


def publish(directory: Path, stage_files: list[str], config: dict[str, Any]) -> int:
    """Join the stages' adapter files in ``directory`` into PEFT's ``adapter_model.safetensors``
    with ``adapter_config.json``; returns the adapter's bytes."""
    from safetensors.torch import load_file, save_file

    tensors = {}
    for name in sorted(set(stage_files)):
        tensors.update(load_file(str(directory / name)))
    save_file(tensors, str(directory / ADAPTER_FILE), metadata={"format": "pt"})
    for name in set(stage_files):
        (directory / name).unlink()
    (directory / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return sum(t.nbytes for t in tensors.values())


def load_everywhere(
    control: EngineControl,
    targets: list[EngineTarget],
    directory: Path,
    weight_version: int,
    timeout_s: float,
) -> None:
    """Every engine loads the adapter in ``directory`` as ``policy-v{weight_version}`` and
    reports that version; a refusal raises ``WeightSyncError`` naming the engine."""
    name = adapter_name(weight_version)
    unload_everywhere(control, targets, weight_version, timeout_s)  # sent again after a failure
    for target in targets:
        body = {"lora_name": name, "lora_path": str(directory)}
        try:
            reply = control.post(target.url, "/load_lora_adapter", body, timeout_s)
            if not reply.get("success", False):
                raise EngineRequestError(reply.get("error_message") or str(reply))
            version = {"new_version": str(weight_version), "abort_all_requests": False}
            control.post(target.url, "/update_weight_version", version, timeout_s)
        except EngineRequestError as exc:
            raise WeightSyncError(
                f"{target.label} did not load the policy adapter of version {weight_version} "
                f"from {directory}: {exc}"
            ) from exc


def unload_everywhere(
    control: EngineControl, targets: list[EngineTarget], weight_version: int, timeout_s: float
) -> None:
    """Every engine unloads ``policy-v{weight_version}`` (a newer version serves by then); an
    engine that no longer holds it is fine."""
    for target in targets:
        try:
            control.post(
                target.url,
                "/unload_lora_adapter",
                {"lora_name": adapter_name(weight_version)},
                timeout_s,
            )
        except EngineRequestError:
            pass  # never loaded there (an engine restarted since); nothing to free


def remove_older(root: Path, keep: Path) -> None:
    """Adapter directories of earlier versions under ``root``: only ``keep`` stays."""
    for directory in root.glob(POLICY_PREFIX + "*"):
        if directory != keep:
            shutil.rmtree(directory, ignore_errors=True)
