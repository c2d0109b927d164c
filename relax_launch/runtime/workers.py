"""The role workers of one rank: what it builds from the plan and the commands it answers.

A trainer rank holds a ``Trainer`` (and, on a pipeline stage's tp0/dp0 rank, a ``WeightSender``);
an engine head holds an ``SGLangServer``; an engine follower only holds its device. A worker's
``handlers`` map each command's route (``runtime/rank_commands.py``) to the method that answers it.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

from relax_launch import platform
from relax_launch.inference.config import InferenceRoleConfig
from relax_launch.inference.policy_adapter import POLICY_ADAPTER_ENV
from relax_launch.inference.process import free_port
from relax_launch.inference.server import SGLangServer
from relax_launch.placement.plan import EnginePlan
from relax_launch.runtime.control import Handler
from relax_launch.runtime.distributed import ShardChannel
from relax_launch.runtime.rank_commands import (
    ConnectWeights,
    EngineUrl,
    ExportAdapter,
    ExportTrainer,
    LoadTrainer,
    Logprobs,
    OffloadTrainer,
    OnloadTrainer,
    SaveTrainer,
    SendWeights,
    StartEngine,
    StopEngine,
    TrainStep,
)
from relax_launch.trainer.config import LoraConfig
from relax_launch.weights.colocated import BucketSender
from relax_launch.weights.engine_shards import EngineShards
from relax_launch.weights.sync import TensorSpec, WeightSender


class TrainerWorker:
    """This rank's share of the trainer, plus weight sending on a stage's source rank."""

    def __init__(
        self,
        *,
        trainer: Any,
        shards: ShardChannel,
        device: platform.Device,
        host: str,
        colocated: bool = False,
    ) -> None:
        self.trainer, self.shards, self.device, self.host = trainer, shards, device, host
        self.sender: WeightSender | None = None
        self.fused = False
        # Colocated engines get released weights back as zeros: each sync sends the whole model
        # (elsewhere a LoRA sync, its targeted weights). Known on all TP ranks: they all gather.
        self.changed_only = not colocated
        self.manifest: list[TensorSpec] = []

    def handlers(self) -> dict[str, Handler]:
        return {
            TrainStep.op: self.train_step,
            Logprobs.op: self.logprobs,
            SaveTrainer.op: lambda c: self.trainer.save(Path(c.directory)),
            LoadTrainer.op: lambda c: self.trainer.load(Path(c.directory)),
            ExportTrainer.op: lambda c: self.trainer.export_hf(Path(c.directory), c.dtype),
            ExportAdapter.op: lambda c: self.trainer.export_adapter(Path(c.directory)),
            OffloadTrainer.op: lambda c: self.trainer.offload(c.parts),
            OnloadTrainer.op: lambda c: self.trainer.onload(c.parts),
            ConnectWeights.op: self.connect,
            SendWeights.op: self.send,
        }

    def train_step(self, command: TrainStep) -> dict[str, float]:
        shard = self.shards.receive(command.shapes[self.shards.dp_rank])
        return self.trainer.train_step(shard, command.spec)

    def logprobs(self, command: Logprobs) -> None:
        """This shard's per-token logprobs go to rank 0 over the shard channel, not the reply."""
        shape = command.shapes[self.shards.dp_rank]
        shard = self.shards.receive(shape)
        rows = None
        try:
            rows = self.trainer.logprobs(shard)
        finally:  # rank 0 waits for them whatever happened
            self.shards.send_result(rows, shape)

    def connect(self, command: ConnectWeights) -> None:
        """Form this stage's broadcast group with every rollout engine worker. With
        ``engine_tp_size`` the tensors go in the engines' fused layout (q/k/v, gate/up, the
        experts' stacks), each engine TP rank its own slice (``weights/engine_shards.py``).
        ``colocated``: the engines share this rank's host and device (split, defer): the
        weights go by ``torch.multiprocessing`` handles instead (``weights/colocated.py``)."""
        self.fused = command.engine_tp_size > 0
        shards = None
        if self.fused and not command.colocated:  # buckets carry whole tensors
            shape = self.trainer.shape
            pads = platform.engine_pads_for_tp(self.device)
            shards = EngineShards(command.engine_tp_size, shape.num_heads, shape.num_kv_heads, pads)
        manifest = self.trainer.export_manifest(self.fused, changed_only=self.changed_only)
        self.manifest = [TensorSpec(*spec) for spec in manifest]
        if self.sender is not None:  # engines died or came back: the old group goes
            self.sender.close()
        self.sender = (BucketSender if command.colocated else WeightSender)(
            targets=list(command.targets),
            world_size=command.world_size,
            group_name=f"relax-weights-pp{command.pp_rank}-ep{command.ep_rank}-"
            f"{command.generation}",
            host=self.host,
            port=free_port(self.host),
            backend=platform.weight_sync_backend(self.device),
            shards=shards,
        )
        self.sender.bucketing = platform.sync_bucketing(self.device)
        self.sender.connect(command.seconds_left)

    def send(self, command: SendWeights) -> dict[str, Any] | None:
        """Export this stage's weights (all of the exporting replica gathers TP; outside
        colocation a LoRA policy's targeted weights only, merged; with EP, this EP rank's
        experts); the source streams them into the update session the controller opened."""
        named = self.trainer.export_hf_weights(self.fused, changed_only=self.changed_only)
        if self.sender is None:
            for _ in named:  # take part in the TP gathers
                pass
            return None
        return self.sender.send(
            named, self.manifest, command.weight_version, command.seconds_left
        ).__dict__

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()


class EngineWorker:
    """The head rank of one SGLang engine (or, for an engine spanning nodes, its first rank on
    one node): starts, reports and stops its server process."""

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
        threads: int,
        colocated: bool = False,
        node_rank: int = 0,
        rendezvous: str | None = None,
        policy_adapter: LoraConfig | None = None,
    ) -> None:
        self.engine, self.node_rank, self.rendezvous = engine, node_rank, rendezvous
        self.scratch, scratch_env = _memory_saver_scratch(colocated)
        self.running = False  # launched, and not stopped on purpose (a scale-in)
        self.server = SGLangServer(
            model_path=model_dir,
            device=device,
            host=host,
            log_path=log_dir / _log_name(engine, node_rank),
            tp_size=engine.tp_size,
            pp_size=engine.pp_size,
            base_gpu_id=platform.engine_base_device(device, local_rank),
            nnodes=len(engine.nodes),
            node_rank=node_rank,
            dist_init_addr=rendezvous,
            engine={"log_level": log_level, **section.engine, "dtype": dtype}
            | _memory_saver(engine.role, colocated)
            | _lora_serving(policy_adapter, device),
            extra_env=scratch_env
            | platform.thread_env(device, threads, _ranks_here(engine), len(engine.ranks))
            | _lora_env(policy_adapter),
            disaggregation_half=engine.disaggregation,
        )

    def launch(self) -> None:
        """Start the server's process; ``wait_ready`` waits for its first token."""
        self.running = True
        self.server.launch()

    def wait_ready(self, timeout_s: float) -> None:
        self.server.wait_ready(timeout_s)

    @property
    def process(self) -> Any:
        """The server's process (its launcher's ``Popen``) while it is meant to run: None for a
        reserved engine not started, or stopped by a scale-in (no death to watch for)."""
        return self.server.process if self.running else None

    def handlers(self) -> dict[str, Handler]:
        if self.node_rank != 0:  # the engine is reached at its head's server only
            return {}
        role, index = self.engine.role, self.engine.index
        handlers = {EngineUrl(role, index).route: lambda c: self.server.url}
        if self.engine.reserved:
            handlers[StartEngine(role, index, 0).route] = self.start
            handlers[StopEngine(role, index).route] = lambda c: self.stop()
        return handlers

    def start(self, command: StartEngine) -> str:
        """A scale-out: start the server (new ports if it served before) and wait for its
        first token; a server that fails is stopped and the rank waits again."""
        if self.running:
            raise RuntimeError(f"{self.engine.label} runs already (at {self.server.url})")
        if self.server.served:
            self.server.choose_ports()
            self.server.served = False
        self.server.launch()  # not watched while it starts: a failure here is the answer
        try:
            self.wait_ready(command.timeout_s)
        except BaseException:
            self.stop()
            raise
        self.running = True
        return self.server.url

    def stop(self) -> None:
        """A scale-in: stop the server by its PID (not watched from now on)."""
        self.running = False
        self.server.stop()

    def close(self) -> None:
        self.server.stop()
        if self.scratch is not None:
            shutil.rmtree(self.scratch, ignore_errors=True)


def _ranks_here(engine: EnginePlan) -> int:
    """The engine's ranks on one of its nodes (whole nodes, when it spans several)."""
    return len(engine.ranks) // len(engine.nodes)


def _log_name(engine: EnginePlan, node_rank: int) -> str:
    """``rollout-engine1-prefill-node1.log``: the half of a disaggregated role, and the node
    of an engine spanning nodes, when they apply."""
    half = f"-{engine.disaggregation}" if engine.disaggregation else ""
    node = f"-node{node_rank}" if node_rank else ""
    return f"{engine.role}-engine{engine.index}{half}{node}.log"


def _lora_serving(lora: LoraConfig | None, device: platform.Device) -> dict[str, Any]:
    """SGLang's LoRA serving for an engine that serves the policy as an adapter: room for two
    versions at once (the new one loads before the old one goes)."""
    if lora is None:
        return {}
    return {
        "enable_lora": True,
        "max_lora_rank": lora.rank,
        "lora_target_modules": lora.hf_target_modules,
        "max_loras_per_batch": 2,
        "lora_backend": platform.lora_backend(device),
    }


def _lora_env(lora: LoraConfig | None) -> dict[str, str]:
    """The engine's plugin serves the policy adapter by default (``inference/policy_adapter``)."""
    return {POLICY_ADAPTER_ENV: "1"} if lora is not None else {}


def _memory_saver_scratch(colocated: bool) -> tuple[Path | None, dict[str, str]]:
    """A colocated engine's directory for the backups of a released static model, and the
    engine's environment naming it: the worker owns it and removes it when the engine stops,
    whatever state the engine was stopped in."""
    if not colocated:
        return None, {}
    scratch = Path(tempfile.mkdtemp(prefix="relax-memory-saver-"))
    return scratch, {platform.MEMORY_SAVER_DIR_ENV: str(scratch)}


def _memory_saver(role: str, colocated: bool) -> dict[str, bool]:
    """Colocated (split, defer) engines give their memory back between phases through SGLang's
    memory saver; a static model keeps a backup of its weights, while rollout's come back with
    the next weight sync."""
    if not colocated:
        return {}
    return {"enable_memory_saver": True, "enable_weights_cpu_backup": role != "rollout"}
