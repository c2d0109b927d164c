"""The job config: one pydantic schema for YAML files and the Python API.

Sections are owned by their consumers (``placement/config.py``, ``trainer/config.py``, ...) and
re-exported here so users import everything from one place.
"""

from relax_launch.config.errors import ConfigError
from relax_launch.config.job import JobConfig
from relax_launch.config.loading import (
    apply_overrides,
    build_config,
    load_config,
    with_overrides,
)
from relax_launch.inference.config import (
    GatewayConfig,
    GenRMConfig,
    InferenceRoleConfig,
    RolloutConfig,
    TeacherConfig,
)
from relax_launch.placement.config import ClusterConfig, PlacementConfig
from relax_launch.rl.config import (
    AlgorithmConfig,
    DataConfig,
    RewardConfig,
    RewardSource,
)
from relax_launch.runtime.config import CheckpointConfig, LoggingConfig
from relax_launch.trainer.config import TrainerConfig
from relax_launch.weights.config import WeightSyncConfig

__all__ = [
    "AlgorithmConfig",
    "CheckpointConfig",
    "ClusterConfig",
    "ConfigError",
    "DataConfig",
    "GatewayConfig",
    "GenRMConfig",
    "InferenceRoleConfig",
    "JobConfig",
    "LoggingConfig",
    "PlacementConfig",
    "RewardConfig",
    "RewardSource",
    "RolloutConfig",
    "TeacherConfig",
    "TrainerConfig",
    "WeightSyncConfig",
    "apply_overrides",
    "build_config",
    "load_config",
    "with_overrides",
]
