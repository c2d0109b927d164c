"""A colocated job's roles under one ``LifecycleCoordinator``, registered from the plan.

The trainer's memory parts move by command on every trainer rank (``TrainerClient.offload`` /
``onload``); an inference role's by its ``InferenceManager`` (SGLang's release/resume of memory
tags, drained first). Every engine comes up loaded, so the coordinator starts by offloading them:
the trainer holds the ranks until the first batch asks for them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from relax_launch.runtime.lifecycle import TRAINER, LifecycleCoordinator
from relax_launch.runtime.session import Session

TRAINER_PARTS = ("params", "grads", "optimizer")
# An engine's parts and the SGLang memory tags behind each (graphs go with the KV cache).
ENGINE_TAGS = {"weights": ("weights",), "kv_cache": ("kv_cache", "cuda_graph")}
# The weight sync is the one moment two roles share a rank: the policy's two copies meet.
SYNC_WINDOW = ((TRAINER, "params"), ("rollout", "weights"))


def build_coordinator(
    session: Session, operation_timeout_s: float, log_path: Path
) -> LifecycleCoordinator:
    """Register the trainer and every inference role; offload the engines (confirmed)."""
    plan = session.plan
    coordinator = LifecycleCoordinator(
        operation_timeout_s=operation_timeout_s, co_resident=SYNC_WINDOW, log_path=log_path
    )
    coordinator.register(
        TRAINER,
        ranks=plan.trainer.ranks,
        parts=TRAINER_PARTS,
        onload=session.trainer.onload,
        offload=session.trainer.offload,
        inference=False,
        resident=TRAINER_PARTS,
    )
    managers = session.control_plane.managers if session.control_plane else {}
    for role, manager in managers.items():
        coordinator.register(
            role,
            ranks={rank for engine in plan.engines_of(role) for rank in engine.ranks},
            parts=tuple(ENGINE_TAGS),
            onload=lambda parts, m=manager: _engines(m.onload, parts),
            offload=lambda parts, m=manager: _engines(m.offload, parts),
            resident=tuple(ENGINE_TAGS),
        )
    for role in managers:
        coordinator.deactivate(role)
    if session.control_plane is not None:
        session.control_plane.coordinated_by(coordinator.state)
    return coordinator


def _engines(operation: Any, parts: tuple[str, ...]) -> dict[str, float]:
    operation([tag for part in parts for tag in ENGINE_TAGS[part]])
    return {}
