"""A colocated job's roles under one ``LifecycleCoordinator``, registered from the plan.

The trainer's memory parts move by command on every trainer rank (``TrainerClient.offload`` /
``onload``); an inference role's by its ``InferenceManager`` (SGLang's release/resume of memory
tags, drained first), counted in the bytes SGLang reports each tag holding. Every engine comes
up loaded, so the coordinator starts by offloading them: the trainer holds the ranks until the
first batch asks for them.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from relax_launch.inference.engine import EngineHandle
from relax_launch.inference.manager import InferenceManager
from relax_launch.placement.plan import PlacementPlan
from relax_launch.runtime.lifecycle import TRAINER, LifecycleCoordinator
from relax_launch.runtime.trainer_client import TrainerClient
from relax_launch.trainer.offload import PARTS

if TYPE_CHECKING:
    from relax_launch.inference.control_plane import ControlPlane

# An engine's parts and the SGLang memory tags behind each (graphs go with the KV cache).
ENGINE_TAGS = {"weights": ("weights",), "kv_cache": ("kv_cache", "cuda_graph")}
# The weight sync is the one moment two roles share a rank: the policy's two copies meet.
SYNC_WINDOW = ((TRAINER, "params"), ("rollout", "weights"))


def build_coordinator(
    plan: PlacementPlan,
    trainer: TrainerClient,
    control_plane: ControlPlane | None,
    operation_timeout_s: float,
    log_path: Path,
) -> LifecycleCoordinator:
    """Register the trainer and every inference role of ``plan``; offload the engines
    (confirmed)."""
    coordinator = LifecycleCoordinator(
        operation_timeout_s=operation_timeout_s, co_resident=SYNC_WINDOW, log_path=log_path
    )
    coordinator.register(
        TRAINER,
        ranks=plan.trainer.ranks,
        parts=PARTS,
        onload=trainer.onload,
        offload=trainer.offload,
        inference=False,
        resident=PARTS,
    )
    managers = control_plane.managers if control_plane else {}
    for role, manager in managers.items():
        moves = EngineMoves(manager)
        coordinator.register(
            role,
            ranks={rank for engine in plan.engines_of(role) for rank in engine.ranks},
            parts=tuple(ENGINE_TAGS),
            onload=moves.onload,
            offload=moves.offload,
            resident=tuple(ENGINE_TAGS),
        )
    for role in managers:
        coordinator.deactivate(role)
    if control_plane is not None:
        control_plane.coordinated_by(coordinator.state)
    return coordinator


class EngineMoves:
    """A role's onload/offload through its manager, with the bytes each moved: per engine and
    tag, SGLang's own accounting (``/get_server_info`` memory usage, read once per engine)."""

    def __init__(self, manager: InferenceManager) -> None:
        self.manager = manager
        self.sizes: dict[str, dict[str, float]] = {}

    def onload(self, parts: tuple[str, ...]) -> dict[str, float]:
        tags = _tags(parts)
        moving = [(e, set(tags) - e.loaded) for e in self.manager.engines]
        self.manager.onload(tags)
        return {"bytes": self._bytes(moving)}

    def offload(self, parts: tuple[str, ...]) -> dict[str, float]:
        tags = _tags(parts)
        moving = [(e, set(tags) & e.loaded) for e in self.manager.engines]
        self.manager.offload(tags)
        return {"bytes": self._bytes(moving)}

    def _bytes(self, moving: list[tuple[EngineHandle, set[str]]]) -> float:
        return sum(self._size(engine)[tag] for engine, tags in moving for tag in tags)

    def _size(self, engine: EngineHandle) -> dict[str, float]:
        if engine.engine_id not in self.sizes:
            usage = engine.info("/get_server_info")["internal_states"][0]["memory_usage"]
            self.sizes[engine.engine_id] = {
                "weights": usage["weight"] * 1e9,
                "kv_cache": usage["kvcache"] * 1e9,
                "cuda_graph": sum(usage["graph"].values()) * 1e9,
            }
        return self.sizes[engine.engine_id]


def _tags(parts: tuple[str, ...]) -> list[str]:
    return [tag for part in parts for tag in ENGINE_TAGS[part]]
