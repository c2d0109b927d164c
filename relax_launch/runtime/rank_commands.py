"""The commands rank 0 sends to the role workers of the ranks (``runtime/workers.py``): one
small typed record each, routed by its ``op`` (or its own ``route``). Batches are not in them: a
trainer rank receives its data-parallel shard through the ``ShardChannel``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from relax_launch.runtime.control import Command
from relax_launch.trainer.batch import ShardShape
from relax_launch.trainer.losses import LossSpec
from relax_launch.weights.update_session import EngineTarget


@dataclass(frozen=True)
class TrainStep(Command):
    """One optimizer step on the batch whose DP shards have these shapes (sent alongside)."""

    op: ClassVar[str] = "trainer.train_step"
    shapes: tuple[ShardShape, ...]
    spec: LossSpec | None = None


@dataclass(frozen=True)
class Logprobs(Command):
    op: ClassVar[str] = "trainer.logprobs"
    shapes: tuple[ShardShape, ...]


@dataclass(frozen=True)
class SaveTrainer(Command):
    op: ClassVar[str] = "trainer.save"
    directory: str


@dataclass(frozen=True)
class ExportTrainer(Command):
    """Write the policy's weights as Hugging Face safetensors shards into ``directory``."""

    op: ClassVar[str] = "trainer.export_hf"
    directory: str
    dtype: str


@dataclass(frozen=True)
class ExportAdapter(Command):
    """Write the policy's LoRA adapters under PEFT's names into ``directory``."""

    op: ClassVar[str] = "trainer.export_adapter"
    directory: str


@dataclass(frozen=True)
class LoadTrainer(Command):
    op: ClassVar[str] = "trainer.load"
    directory: str


@dataclass(frozen=True)
class OffloadTrainer(Command):
    """Move these parts of every trainer rank's state ("params", "grads", "optimizer") to host
    memory, freeing the device for a colocated role."""

    op: ClassVar[str] = "trainer.offload"
    parts: tuple[str, ...]


@dataclass(frozen=True)
class OnloadTrainer(Command):
    """Bring these offloaded parts of every trainer rank's state back to the device."""

    op: ClassVar[str] = "trainer.onload"
    parts: tuple[str, ...]


@dataclass(frozen=True)
class ConnectWeights(Command):
    """Form a pipeline stage's broadcast group (one per expert-parallel rank) with every
    rollout engine worker (see ``TrainerWorker.connect``)."""

    op: ClassVar[str] = "weights.connect"
    pp_rank: int
    targets: tuple[EngineTarget, ...]
    world_size: int
    engine_tp_size: int  # the engines' shared TP size; 0: they differ (whole tensors)
    colocated: bool
    seconds_left: float
    generation: int = 1  # the job's n-th group of this stage: a re-formed group gets a new name
    ep_rank: int = 0


@dataclass(frozen=True)
class SendWeights(Command):
    op: ClassVar[str] = "weights.send"
    weight_version: int
    seconds_left: float


@dataclass(frozen=True)
class EngineUrl(Command):
    """The URL of an engine's server, once it has generated a token."""

    op: ClassVar[str] = "engine.url"
    role: str
    index: int

    @property
    def route(self) -> str:  # one rank may head engines of several roles (defer)
        return f"{self.role}.engine{self.index}.url"


@dataclass(frozen=True)
class StartEngine(Command):
    """Start a reserved engine's server (a scale-out) and return its URL once it has generated
    a token, within ``timeout_s``; a server that fails is stopped and the rank waits again."""

    op: ClassVar[str] = "engine.start"
    role: str
    index: int
    timeout_s: float

    @property
    def route(self) -> str:
        return f"{self.role}.engine{self.index}.start"


@dataclass(frozen=True)
class StopEngine(Command):
    """Stop a scaled-out engine's server by its PID (a scale-in); the rank waits again."""

    op: ClassVar[str] = "engine.stop"
    role: str
    index: int

    @property
    def route(self) -> str:
        return f"{self.role}.engine{self.index}.stop"
