"""The job config: one pydantic schema for YAML files and the Python API.

Sections are owned by their consumers (``placement/config.py``, ``trainer/config.py``, ...) and
re-exported here so users import everything from one place. The re-exports resolve on first
use, so a section module can import ``relax_launch.config.section`` without a cycle.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "ConfigError": "relax_launch.config.errors",
    "JobConfig": "relax_launch.config.job",
    "apply_overrides": "relax_launch.config.loading",
    "build_config": "relax_launch.config.loading",
    "load_config": "relax_launch.config.loading",
    "with_overrides": "relax_launch.config.loading",
    "AutoscaleConfig": "relax_launch.inference.config",
    "GatewayConfig": "relax_launch.inference.config",
    "GenRMConfig": "relax_launch.inference.config",
    "InferenceRoleConfig": "relax_launch.inference.config",
    "PrefillConfig": "relax_launch.inference.config",
    "RolloutConfig": "relax_launch.inference.config",
    "RolloutAutoscaleConfig": "relax_launch.inference.config",
    "TeacherConfig": "relax_launch.inference.config",
    "ClusterConfig": "relax_launch.placement.config",
    "PlacementConfig": "relax_launch.placement.config",
    "AlgorithmConfig": "relax_launch.rl.config",
    "DataConfig": "relax_launch.rl.data_config",
    "EvalConfig": "relax_launch.rl.data_config",
    "RewardConfig": "relax_launch.rl.config",
    "RewardSource": "relax_launch.rl.config",
    "CheckpointConfig": "relax_launch.rl.config",
    "LoggingConfig": "relax_launch.rl.config",
    "TrainerConfig": "relax_launch.trainer.config",
    "WeightSyncConfig": "relax_launch.weights.config",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'relax_launch.config' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
