"""HFExport: one pipeline stage's weights under Hugging Face names, as the weight sync and the
export read them: TP shards gathered (asynchronously, a few ahead), Megatron's fused layouts
converted (``hf_conversion.megatron_to_hf``), a LoRA policy's adapters merged into their weights.

With expert parallelism each EP rank exports its own experts (numbered globally), and EP rank 0
also the rest of the stage: no rank gathers every expert.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from relax_launch.trainer.hf_conversion import (
    is_expert,
    local_experts,
    megatron_to_hf,
    stage_layers,
    tp_split_dim,
)
from relax_launch.trainer.lora import COLUMN, SPLIT, is_adapter, merged, peft_tensors
from relax_launch.trainer.model_shape import ModelShape

GATHERS_IN_FLIGHT = 2  # TP gathers of the export started ahead of the tensor being sent

Gathered = Callable[[], torch.Tensor]  # a TP gather in flight: call it for the whole tensor


class HFExport:
    """The weights of the GPTModel ``module`` (this rank's stage and TP shard) under HF names.
    ``lora``: {weight name: linear carrying an adapter} (``lora.targets_of``)."""

    def __init__(self, module: Any, shape: ModelShape, pgc: Any, lora: dict[str, Any]) -> None:
        self.module, self.shape, self.pgc, self.lora = module, shape, pgc, lora

    def weights(self, fused: bool, changed_only: bool) -> Iterator[tuple[str, torch.Tensor]]:
        """This stage's weights, TP-gathered; yields on the stage's tp0 rank of data-parallel
        replica 0 (with EP, of each EP rank: its experts, and on EP rank 0 the rest).

        Every rank of that replica must iterate it to the end (TP gathers); other replicas
        yield nothing. ``fused``: q/k/v, gate/up and the experts in the engine's layout.
        ``changed_only``: only what training can change (a LoRA policy's targeted weights; the
        rest is the model directory's, which the engines loaded), for the weight sync.
        """
        if not self.exports:
            return
        gathering: deque[tuple[str, Gathered]] = deque()  # TP gathers in flight, in order
        for name, local in self._local(changed_only):
            gathering.append((name, self._start_gather(local, self.split_dim(name))))
            if len(gathering) > GATHERS_IN_FLIGHT:  # the next ones gather while it is sent
                yield from self._converted(*gathering.popleft(), fused)
        while gathering:
            yield from self._converted(*gathering.popleft(), fused)

    @property
    def exports(self) -> bool:
        """Whether this rank takes part in the export: the first replica of its experts (of
        every weight, for a dense model)."""
        return self.pgc.expt_dp.rank() == 0

    @property
    def _offsets(self) -> dict[str, int]:
        """``megatron_to_hf``'s numbering of this rank's layers and experts."""
        pp, ep = self.pgc.pp, self.pgc.ep
        return {
            "layer_offset": stage_layers(self.shape, pp.rank(), pp.size()).start,
            "expert_offset": local_experts(self.shape, ep.rank(), ep.size()).start,
        }

    def manifest(self, fused: bool, changed_only: bool) -> list[tuple[str, str, tuple[int, ...]]]:
        """(name, dtype, shape) of every tensor ``weights(fused, changed_only)`` yields, in
        order, computed on shapes alone (meta tensors): no gather, no memory."""
        tp_size = self.pgc.tp.size()
        manifest = []
        for name, param in self._params(changed_only):
            shape, dim = list(param.shape), self.split_dim(name)
            if dim is not None:
                shape[dim] *= tp_size
            full = torch.empty(shape, dtype=param.dtype, device="meta")
            for hf_name, tensor in self.to_hf(name, full, fused):
                manifest.append(
                    (hf_name, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape))
                )
        return manifest

    def adapters(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The stage's LoRA adapters under PEFT's names (``lora.peft_tensors``), whole over TP;
        yields on the stage's tp0/dp0 rank (every rank of DP replica 0 iterates to the end)."""
        if self.pgc.dp.rank() != 0:
            return
        offset = stage_layers(self.shape, self.pgc.pp.rank(), self.pgc.pp.size()).start
        for name, linear in self.lora.items():
            column = SPLIT[name.rsplit(".", 2)[-2]] == COLUMN
            a = self._start_gather(linear.lora_a.detach(), None if column else 1)()
            b = self._start_gather(linear.lora_b.detach(), 0 if column else None)()
            if self.pgc.tp.rank() == 0:
                linear_name = name.removesuffix(".weight")
                yield from peft_tensors(linear_name, a, b, self.shape, self.pgc.tp.size(), offset)

    def _params(self, changed_only: bool) -> Iterator[tuple[str, torch.Tensor]]:
        """The weights the export covers: not the adapters themselves, with ``changed_only``
        only the ones training changes, and past EP rank 0 only this rank's experts."""
        experts_only = self.pgc.ep.rank() > 0
        for name, param in self.module.named_parameters():
            if is_adapter(name) or (changed_only and self.lora and name not in self.lora):
                continue
            if experts_only and not is_expert(name):
                continue
            yield name, param

    def _local(self, changed_only: bool) -> Iterator[tuple[str, torch.Tensor]]:
        """(Megatron name, this rank's shard) of each exported weight, adapters merged."""
        for name, param in self._params(changed_only):
            linear = self.lora.get(name)
            if linear is None:
                yield name, param.detach()
            else:
                a, b = linear.lora_a.detach(), linear.lora_b.detach()
                yield name, merged(param.detach(), a, b, linear.lora_adapter.scale)

    def _start_gather(self, local: torch.Tensor, dim: int | None) -> Gathered:
        """Start joining ``local`` over the TP ranks along ``dim`` (an asynchronous all-gather;
        None: it is whole already); calling the result waits for the whole tensor. Every TP
        rank must start the same gathers in the same order."""
        tp = self.pgc.tp
        if dim is None or tp.size() == 1:
            return lambda: local
        parts = [torch.empty_like(local) for _ in range(tp.size())]
        work = dist.all_gather(parts, local.contiguous(), group=tp, async_op=True)

        def whole() -> torch.Tensor:
            work.wait()
            return torch.cat(parts, dim=dim)

        return whole

    def _converted(
        self, name: str, gathered: Gathered, fused: bool
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Parameter ``name`` in HF layout, once its gather is done (on TP rank 0 only)."""
        full = gathered()
        if self.pgc.tp.rank() == 0:
            yield from self.to_hf(name, full, fused)

    def split_dim(self, name: str) -> int | None:
        """The dimension parameter ``name`` is split along over TP (None: whole)."""
        return tp_split_dim(name)

    def to_hf(
        self, name: str, full: torch.Tensor, fused: bool
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """The HF tensors of parameter ``name``, whole over TP."""
        return megatron_to_hf(
            name, full, self.shape, tp_size=self.pgc.tp.size(), fused=fused, **self._offsets
        )
