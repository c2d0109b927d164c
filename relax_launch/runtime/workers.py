"""The role workers of one rank: what it builds from the plan and the commands it answers.

A trainer rank holds a ``Trainer`` (and, on a pipeline stage's tp0/dp0 rank, a ``WeightSender``);
an engine head holds an ``SGLangServer``; an engine follower only holds its device. Handlers are
named ``<role>.<command>``.
"""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

from relax_launch import platform
from relax_launch.inference.config import InferenceRoleConfig
from relax_launch.inference.server import SGLangServer, free_port
from relax_launch.placement.plan import EnginePlan, PlacementPlan
from relax_launch.trainer.batch import TokenBatch
from relax_launch.trainer.config import TrainerConfig
from relax_launch.trainer.losses import LossSpec
from relax_launch.weights.shared_memory import SharedMemorySender
from relax_launch.weights.sync import TensorSpec, WeightSender
from relax_launch.weights.update_session import EngineTarget


def node_address(plan: PlacementPlan) -> str:
    """Address other nodes reach this one at (loopback on a single node)."""
    return "127.0.0.1" if plan.nnodes == 1 else socket.gethostbyname(socket.gethostname())


class TrainerWorker:
    """This rank's share of the trainer, plus weight sending on a stage's source rank."""

    def __init__(
        self,
        *,
        section: TrainerConfig,
        model_dir: Path,
        pgc: Any,
        device: platform.Device,
        plan: PlacementPlan,
        reference: bool = False,
    ) -> None:
        from relax_launch.trainer.trainer import Trainer  # torch + Megatron: trainer ranks only

        self.trainer = Trainer(
            section=section, model_dir=model_dir, pgc=pgc, device=device, reference=reference
        )
        self.plan, self.device = plan, device
        self.sender: WeightSender | None = None
        self.fused = False
        self.manifest: list[TensorSpec] = []

    def handlers(self) -> dict[str, Any]:
        return {
            "trainer.train_step": lambda batch, spec=None: self._changing_weights(
                self.trainer.train_step, TokenBatch(**batch), LossSpec(**spec) if spec else None
            ),
            "trainer.logprobs": lambda batch: self.trainer.logprobs(TokenBatch(**batch)),
            "trainer.save": lambda directory: self.trainer.save(Path(directory)),
            "trainer.load": lambda directory: self._changing_weights(
                self.trainer.load, Path(directory)
            ),
            "weights.connect": self.connect,
            "weights.send": self.send,
            "weights.commit": lambda: self.sender and self.sender.commit(),
            "weights.restore": lambda weight_version, seconds_left: bool(
                self.sender and self.sender.restore(weight_version, seconds_left)
            ),
        }

    def _changing_weights(self, method: Any, *args: Any) -> Any:
        """Run a command that changes the parameters once the last sync's rollback copy, which
        reads them in the background, is done."""
        if self.sender is not None:
            self.sender.wait_for_rollback_copy()
        return method(*args)

    def connect(
        self,
        pp_rank: int,
        targets: list[tuple[str, int, str]],
        world_size: int,
        fused: bool,
        colocated: bool,
        seconds_left: float,
    ) -> None:
        """Form this stage's broadcast group with every rollout engine worker. ``fused``: the
        engines hold q/k/v and gate/up fused (one engine TP rank), so they are sent that way.
        ``colocated``: the engines share this rank's host (split, defer), so the platform may
        choose a transport that skips the network."""
        self.fused = fused
        self.manifest = [TensorSpec(*spec) for spec in self.trainer.export_manifest(fused)]
        host = node_address(self.plan)
        shared = colocated and platform.colocated_weight_transport(self.device) == "shared_memory"
        self.sender = (SharedMemorySender if shared else WeightSender)(
            targets=[EngineTarget(*t) for t in targets],
            world_size=world_size,
            group_name=f"relax-weights-pp{pp_rank}",
            host=host,
            port=free_port(host),
            backend=platform.dist_backend(self.device),
        )
        self.sender.connect(seconds_left)

    def send(self, weight_version: int, seconds_left: float) -> dict[str, Any] | None:
        """Export this stage's weights (all of DP replica 0 gathers TP); the source streams them
        into the update session the controller opened."""
        named = self.trainer.export_hf_weights(self.fused)
        if self.sender is None:
            for _ in named:  # take part in the TP gathers
                pass
            return None
        return self.sender.send(named, self.manifest, weight_version, seconds_left).__dict__

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()


class EngineWorker:
    """The head rank of one SGLang engine: starts, reports and stops its server."""

    def __init__(
        self,
        *,
        engine: EnginePlan,
        section: InferenceRoleConfig,
        dtype: str,
        log_level: str,
        model_dir: Path,
        device: platform.Device,
        local_rank: int,
        log_dir: Path,
        host: str,
    ) -> None:
        self.engine = engine
        self.server = SGLangServer(
            model_path=model_dir,
            device=device,
            host=host,
            log_path=log_dir / f"{engine.role}-engine{engine.index}.log",
            tp_size=engine.tp_size,
            pp_size=engine.pp_size,
            base_gpu_id=platform.engine_base_device(device, local_rank),
            engine={"log_level": log_level, **section.engine, "dtype": dtype},
        )

    def start(self, timeout_s: float) -> None:
        self.server.start(timeout_s)

    def handlers(self) -> dict[str, Any]:
        role, index = self.engine.role, self.engine.index
        return {f"{role}.engine{index}.url": lambda: self.server.url}

    def close(self) -> None:
        self.server.stop()
