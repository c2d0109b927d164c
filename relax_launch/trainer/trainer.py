"""Trainer: one rank's share of the Megatron-core policy — train steps, logprobs, HF weights.

Every trainer rank runs the same calls in lockstep (the controller sends them to all trainer
ranks). Each call takes this data-parallel rank's shard of the batch (the runtime sends each DP
rank only its own), split here into micro-batches; results live on the last pipeline stage.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from relax_launch import platform
from relax_launch.trainer import micro_batches, sharded_optimizer
from relax_launch.trainer.batch import TokenBatch
from relax_launch.trainer.config import TrainerConfig
from relax_launch.trainer.forward import forward_step
from relax_launch.trainer.hf_dir import DTYPES, write_shards
from relax_launch.trainer.hf_export import HFExport
from relax_launch.trainer.lora import adapters_off, is_adapter, targets_of
from relax_launch.trainer.losses import LossSpec
from relax_launch.trainer.model import build_optimizer
from relax_launch.trainer.moe import compare_only, moe_routing
from relax_launch.trainer.offload import PARTS, StateOffloader, kept_on, move_parts
from relax_launch.trainer.policy import bare_module, build_policy
from relax_launch.trainer.step_metrics import batch_metrics, beyond_bounds
from relax_launch.trainer.vlm_batches import add_vision_inputs
from relax_launch.trainer.vlm_model import VisionLayout
from relax_launch.trainer.vlm_policy import VLMExport


class Trainer:
    """The policy on this rank: build from an HF checkpoint, then step, score and export.

    With ``reference`` it also keeps a frozen copy of the initial policy, which scores each
    batch for the KL penalty (``LossSpec.kl_coef``); a LoRA policy needs no copy: the initial
    policy is itself with its adapters off.

    With ``section.lora`` only the adapters train (``trainer/lora.py``); the export, and so the
    weight sync, yields the merged weights, and checkpoints hold the adapters alone.
    """

    def __init__(
        self,
        *,
        section: TrainerConfig,
        model_dir: Path,
        pgc: Any,
        device: platform.Device,
        reference: bool = False,
    ) -> None:
        self.section, self.pgc = section, pgc
        torch.manual_seed(section.seed)
        self.torch_device = platform.torch_device(device, int(os.environ.get("LOCAL_RANK", "0")))
        # a vision-language policy also has its VLShape (``self.vision``; None: text only)
        self.model, self.shape, self.vision = build_policy(
            section, pgc, self.torch_device, model_dir
        )
        self.lora = targets_of(self.model.module)  # {weight name: linear with an adapter}
        self.moe = moe_routing(self.model.module, self.shape, pgc, self.torch_device)
        self.hf = (
            HFExport(self.model.module, self.shape, pgc, self.lora)
            if self.vision is None
            else VLMExport(self.model.module, self.vision, pgc, self.lora)
        )
        self.reference = None
        self.wants_reference = reference
        if reference and not self.lora:
            shape = self.vision or self.shape
            self.reference = bare_module(shape, section, pgc, self.torch_device, model_dir)
            self.reference.load_state_dict(self.model.module.state_dict())  # no second read
            self.reference.requires_grad_(False).eval()
            if self.moe is not None:
                self.moe.add(self.reference)
        self.optimizer = build_optimizer(self.model, section, pgc)
        self.offloader = StateOffloader(self.model, self.optimizer, self.reference)
        self.step = 0

    @property
    def is_last_stage(self) -> bool:
        return self.pgc.pp.rank() == self.pgc.pp.size() - 1

    def offload(self, parts: Iterable[str] = PARTS) -> dict[str, float]:
        """Move ``parts`` of this rank's state ("params" — with the reference model's —,
        "grads", "optimizer"; see ``trainer/offload.py``) to host memory, freeing the device
        storage. Returns the bytes moved, the seconds it took and the parts moved
        (``offload.move_parts``); offloaded parts are skipped."""
        return move_parts(self.offloader, "offload", parts)

    def onload(self, parts: Iterable[str] = PARTS) -> dict[str, float]:
        """Bring offloaded ``parts`` back to the device, bit-exact; same reply as ``offload``."""
        return move_parts(self.offloader, "onload", parts)

    def resident(self, part: str) -> bool:
        """Whether state ``part`` is on the device (not offloaded)."""
        return self.offloader.resident(part)

    def train_step(self, shard: TokenBatch, spec: LossSpec | None = None) -> dict[str, float]:
        """One optimizer step on this DP rank's ``shard``: PPO-clip (``spec``) when the batch
        has old logprobs, else -sum(weight * mask * logprob) / sum(mask), both over the batch
        as a whole (every micro-batch of every DP rank; see ``micro_batch_loss``).

        Returns the grad norm, and on the last pipeline stage the global batch's loss (and, for
        PPO, the clipped fraction, the approximate KL to the sampling policy and to the
        reference). A batch beyond ``spec.withhold_above`` leaves the weights as they were
        (``update_withheld``: the mismatch guard's ``skip``).
        """
        self.offloader.require("train_step", PARTS)
        spec = spec or LossSpec()
        micro_batches = self._micro_batches(shard)
        if self.moe is not None and not spec.routing_replay:  # the control has not turned it on
            compare_only(micro_batches)
        if spec.kl_coef > 0:
            self._add_reference_logprobs(micro_batches)
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        outputs = self._schedule(self.model, micro_batches, forward_only=False, spec=spec)
        # the loss exists only where the logits are
        metrics = batch_metrics(outputs, self.pgc.dp) if self.is_last_stage else {}
        if spec.withhold_above and beyond_bounds(
            metrics, spec.withhold_above, self.is_last_stage, self.pgc.trainer, self.torch_device
        ):
            self.optimizer.zero_grad()
            metrics |= {"grad_norm": 0.0, "update_withheld": 1.0}
        else:
            update_ok, grad_norm, _ = self.optimizer.step()
            if not update_ok:
                raise RuntimeError(f"trainer step {self.step}: optimizer skipped the update")
            self.step += 1
            metrics |= {"grad_norm": float(grad_norm or 0.0), "update_withheld": 0.0}
        if self.moe is not None:  # every rank: the routers are spread over DP and PP ranks
            groups = [self.pgc.dp, self.pgc.cp, self.pgc.pp, self.pgc.tp]
            metrics |= self.moe.monitor.metrics(groups)
        return metrics

    @property
    def shard_name(self) -> str:
        """This rank's file in a checkpoint directory (data-parallel replicas share one)."""
        return shard_name(self.pgc.tp.rank(), self.pgc.pp.rank(), self.pgc.ep.rank())

    def save(self, directory: Path) -> str | None:
        """Write this shard's model and optimizer state (on the first data-parallel replica of
        its experts, the other replicas holding the same state; under the distributed optimizer
        every other DP rank writes its optimizer shard too). Returns the file written, if any."""
        self.offloader.require("save", ("params", "optimizer"))
        sharded = self.section.distributed_optimizer  # every DP rank saves its optimizer shard
        if not (self.hf.exports or sharded):
            return None
        state = sharded_optimizer.checkpoint(self.optimizer, self.pgc, sharded)
        state["step"] = self.step
        own = sharded_optimizer.dp_shard_name(self.pgc)
        path = directory / (self.shard_name if self.hf.exports else own)
        if self.hf.exports:
            model = self.model.module.state_dict()
            if self.lora:  # the frozen base is the model directory's, unchanged
                model = {k: v for k, v in model.items() if is_adapter(k)}
            state["model"] = model
        return save_durably(state, path)

    def load(self, directory: Path) -> int:
        """Restore this shard's model and optimizer from ``directory``; returns the optimizer
        steps the checkpoint had taken."""
        self.offloader.require("load", ("params", "optimizer"))
        path = directory / self.shard_name
        if not path.is_file():
            raise FileNotFoundError(
                f"{path} is missing: the checkpoint was saved with other trainer.tp_size, "
                "pp_size or ep_size than this job's (resume with the sizes it was saved with)"
            )
        sharded = self.section.distributed_optimizer
        if sharded:  # the model on the host: the shard copies what it needs to the device
            return self._load_sharded(directory, path)
        # mapped from the file, not read whole onto the device: the model's tensors reach it only
        # as the copies into their live places; the optimizer's Adam state (moments, steps) is
        # copied to it whole by kept_on before load_state_dict takes it as the live state
        state = torch.load(path, map_location="cpu", mmap=True, weights_only=False)
        sharded_optimizer.check_resumable(state, False, self.pgc, path)
        self._load_model_state(state["model"], path)
        self.optimizer.load_state_dict(kept_on(state["optimizer"], self.torch_device))
        self.step = int(state["step"])
        return self.step

    def _load_sharded(self, directory: Path, path: Path) -> int:
        """``load`` under the distributed optimizer: the model from the shard file, this rank's
        optimizer shard from its own file (the same one on the replica that wrote the model)."""
        state = torch.load(path, map_location="cpu", mmap=True, weights_only=False)
        sharded_optimizer.check_resumable(state, True, self.pgc, path)
        own = state
        if not self.hf.exports:
            own_path = directory / sharded_optimizer.dp_shard_name(self.pgc)
            own = torch.load(own_path, map_location="cpu", mmap=True, weights_only=False)
        self._load_model_state(state["model"], path)
        sharded_optimizer.load(self.optimizer, own["optimizer"])
        self.step = int(state["step"])
        return self.step

    def _load_model_state(self, state: dict[str, torch.Tensor], path: Path) -> None:
        """Copy a checkpoint's model state into the parameters: all of them, or a LoRA run's
        adapters (refusing a checkpoint of the other kind)."""
        adapters = [k for k in state if is_adapter(k)]
        if bool(self.lora) != (len(adapters) == len(state) > 0):
            kinds = ("full fine-tuning", "LoRA adapters")
            raise ValueError(
                f"{path} holds {kinds[bool(adapters)]} but this trainer trains "
                f"{kinds[bool(self.lora)]}: resume with the trainer.lora setting it was saved with"
            )
        result = self.model.module.load_state_dict(state, strict=not self.lora)
        if result.unexpected_keys or any(is_adapter(k) for k in result.missing_keys):
            raise ValueError(
                f"{path} does not fit this trainer's adapters (trainer.lora.rank or "
                f"target_modules changed?): missing {result.missing_keys[:4]}, unexpected "
                f"{result.unexpected_keys[:4]}"
            )

    @torch.no_grad()
    def logprobs(self, shard: TokenBatch) -> list[list[float]] | None:
        """Per-token logprobs of ``tokens[1:]`` for this DP rank's ``shard`` (last stage; else
        None). Dropout is off: the same batch always scores the same."""
        self.offloader.require("logprobs", ("params",))
        batches = self._micro_batches(shard)
        with evaluating(self.model) as model:
            outputs = self._schedule(model, batches, forward_only=True, spec=LossSpec())
        if not self.is_last_stage:
            return None
        rows: list[list[float]] = [[] for _ in shard.tokens]
        for batch, output in zip(batches, outputs, strict=True):
            # an empty micro-batch (``split_to``) has a row of padding and no order
            for i, row in zip(batch["order"].tolist(), output["logprobs"].tolist(), strict=False):
                rows[i] = row[: len(shard.tokens[i]) - 1]
        return rows

    def _add_reference_logprobs(self, micro_batches: list[dict[str, torch.Tensor]]) -> None:
        """Score the micro-batches with the frozen initial policy; the loss reads the result
        (on the last pipeline stage, where it is computed)."""
        if not self.wants_reference:
            raise RuntimeError(
                "kl_coef > 0 but this trainer was built without a reference model; the runtime "
                "builds one when algorithm.kl_coef > 0"
            )
        reference = self.reference
        with torch.no_grad(), contextlib.ExitStack() as scope:
            if reference is None:  # LoRA: the policy with its adapters off
                reference = scope.enter_context(evaluating(self.model))
                scope.enter_context(adapters_off(self.lora))
            outputs = self._schedule(reference, micro_batches, forward_only=True, spec=LossSpec())
        if self.is_last_stage:
            for micro_batch, output in zip(micro_batches, outputs, strict=True):
                micro_batch["ref_logprobs"] = output["logprobs"]

    def _micro_batches(self, shard: TokenBatch) -> list[dict[str, torch.Tensor]]:
        """This data-parallel rank's ``shard`` as micro-batches (``trainer/micro_batches.py``):
        grouped by count or token budget, padded or packed, this CP rank's slice."""
        section, pgc = self.section, self.pgc
        micro = section.sequences_per_micro_batch
        if len(shard) % micro:
            raise ValueError(
                f"a data-parallel shard of {len(shard)} sequences does not split into "
                f"micro_batch_size={micro}"
            )
        # sequence parallelism splits each CP rank's slice over the TP ranks
        multiple = pgc.cp.size() * (pgc.tp.size() if self.model.config.sequence_parallel else 1)
        groups = micro_batches.group_sequences(
            [len(t) - 1 for t in shard.tokens],
            micro_batch_size=micro,
            max_tokens=section.max_tokens_per_micro_batch,
            packed=section.pack_sequences,
            multiple=multiple,
        )
        # experts exchange tokens in every micro-batch: EP ranks run as many as the most (fixed
        # micro-batches of equal shards always agree)
        budgeted = section.max_tokens_per_micro_batch is not None
        if budgeted and self.moe is not None and pgc.ep.size() > 1:
            count = torch.tensor(len(groups), device=self.torch_device)
            dist.all_reduce(count, op=dist.ReduceOp.MAX, group=pgc.dp)
            groups = micro_batches.split_to(groups, int(count))
        built = micro_batches.build(
            shard,
            groups,
            packed=section.pack_sequences,
            multiple=multiple,
            cp=(pgc.cp.rank(), pgc.cp.size()),
        )
        if self.vision is not None:
            add_vision_inputs(built, shard, self.vision)
        device = self.torch_device  # a VLM's sequence_spans stay a list, read on the CPU
        return [{k: _to(v, device) for k, v in b.items()} for b in built]

    def _schedule(
        self,
        model: Any,
        micro_batches: list[dict[str, torch.Tensor]],
        forward_only: bool,
        spec: LossSpec,
    ) -> list[dict[str, Any]]:
        """Megatron's forward(-backward) schedule over the micro-batches; per micro-batch
        outputs on the last pipeline stage."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        # shapes of the first micro-batch; stages exchange each one's (variable_seq_lengths)
        micro, seq = micro_batches[0]["inputs"].shape
        extra = {}
        if self.pgc.pp.size() > 1:
            from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

            extra["p2p_communicator"] = P2PCommunicator(pp_group=self.pgc.pp, config=model.config)
        return get_forward_backward_func(pp_size=self.pgc.pp.size(), vp_size=None)(
            forward_step_func=functools.partial(
                forward_step, spec=spec, moe=self.moe, train=not forward_only, cp=self.pgc.cp
            ),
            data_iterator=iter(micro_batches),
            model=[model],
            num_microbatches=len(micro_batches),
            seq_length=seq * self.pgc.cp.size(),
            micro_batch_size=micro,
            forward_only=forward_only,
            pg_collection=self.pgc,
            **extra,
        )

    def export_hf_weights(
        self, fused: bool = False, changed_only: bool = False
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """This stage's weights under HF names (``HFExport.weights``: TP-gathered, LoRA merged;
        every rank of DP replica 0 iterates it to the end)."""
        self.offloader.require("export_hf_weights", ("params",))  # now, not at the first next()
        return self.hf.weights(fused, changed_only)

    def export_manifest(
        self, fused: bool = False, changed_only: bool = False
    ) -> list[tuple[str, str, tuple[int, ...]]]:
        """(name, dtype, shape) of every tensor ``export_hf_weights`` yields, in order."""
        return self.hf.manifest(fused, changed_only)

    def export_adapter(self, directory: Path) -> dict[str, str]:
        """Write this stage's LoRA adapters under PEFT's names into ``directory`` (on the
        stage's tp0/dp0 rank); returns {name: file}. Rank 0 joins the stages' files
        (``weights/adapter_sync.py``)."""
        self.offloader.require("export_adapter", ("params",))
        prefix = f"adapter-stage{self.pgc.pp.rank():03d}"
        dtype = DTYPES[self.section.dtype]
        return write_shards(Path(directory), prefix, self.hf.adapters(), dtype)

    def export_hf(self, directory: Path, dtype: str) -> dict[str, str]:
        """Write this stage's weights (merged, for LoRA) as safetensors shards in ``dtype`` into
        ``directory`` (on the stage's tp0 rank of each EP rank; the others take part in the
        gathers);
        returns {HF name: file}. ``relax_launch.trainer.hf_dir.finish`` completes the folder."""
        prefix = f"stage{self.pgc.pp.rank():03d}-ep{self.pgc.ep.rank():03d}"
        return write_shards(Path(directory), prefix, self.export_hf_weights(), DTYPES[dtype])


def save_durably(state: dict[str, Any], path: Path) -> str:
    """``torch.save`` of ``state`` to ``path``, on disk before this returns (rank 0 marks the
    checkpoint complete after every rank's reply) and whole or absent; returns the path."""
    partial = path.with_name(path.name + ".partial")
    with open(partial, "wb") as file:
        torch.save(state, file)
        file.flush()
        os.fsync(file.fileno())
    partial.replace(path)
    return str(path)


def shard_name(tp_rank: int, pp_rank: int, ep_rank: int = 0) -> str:
    """A trainer rank's file in a checkpoint directory (EP ranks past 0 hold other experts)."""
    return f"trainer_tp{tp_rank}_pp{pp_rank}{f'_ep{ep_rank}' if ep_rank else ''}.pt"


@contextlib.contextmanager
def evaluating(model: Any) -> Iterator[Any]:
    """``model`` in eval mode (no dropout) for the duration."""
    model.eval()
    try:
        yield model
    finally:
        model.train()


def _to(value: Any, device: torch.device) -> Any:
    """A micro-batch's tensor (or a VLM's ``VisionLayout``, or its images' patches: a tuple of
    views of the received shard, already there) on ``device``; anything else (a list read on
    the CPU) as it is."""
    if isinstance(value, tuple):
        return tuple(_to(part, device) for part in value)
    return value.to(device) if isinstance(value, torch.Tensor | VisionLayout) else value
