"""Offload one rank's trainer state to host memory and back, so colocated engines can use it.

Three parts, disjoint by storage (a storage belongs to the first part that names it):

- ``params``: the policy's parameters, and the frozen reference model's when the trainer has
  one (both are weights a colocated engine's phase does not need); under the distributed
  optimizer the trainable ones are views of DDP's contiguous param buffer, which moves whole;
- ``grads``: Megatron DDP's contiguous grad buffers (every ``main_grad`` and fp32-optimizer
  ``.grad`` is a view into them), plus any other ``.grad`` tensor (the mixed-precision
  optimizer's fp32 main grads);
- ``optimizer``: the optimizer's own state (Adam's ``exp_avg``, ``exp_avg_sq``, ``step``) and
  the fp32 main parameters of the mixed-precision optimizer (under the distributed optimizer,
  this rank's shards of both; its fp32 shards of fp32 weights are views of the params).

Offloading works on whole storages: the bytes are copied into a host buffer (pinned on CUDA, a
separate copy on the CPU) and the storage is resized to 0, which frees it while every tensor on
it — Megatron's views, the optimizer's references, DDP's hooks — stays the same object. Onloading
resizes the storage back and copies the bytes in, bit-exact. Grads are the exception: every
train step zeroes them before its backward pass, so they are freed without a copy and come back
as zeros (what Megatron's ``offload_grad_buffers``/``restore_grad_buffers`` do, for every grad).
Module buffers (RoPE frequencies), Megatron's attention scratch and the mixed-precision
optimizer's one-element flags stay resident; they are small. Only storages on the device move:
an offloaded optimizer's state (``trainer.optimizer_offload``) is in host memory already, so its
part moves nothing.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_map

from relax_launch import platform

PARTS = ("params", "grads", "optimizer")
DISCARDED = ("grads",)  # a train step zeroes them first: freed, not copied
CHANGED = "changed/"  # a move's reply key, one per part it moved: "changed/grads": 1.0


class OffloadedError(RuntimeError):
    """A trainer call needs a part of its state that is offloaded."""


@dataclass
class _Moved:
    """One offloaded storage: a tensor on it (to find it again), its size, and its bytes on the
    host (None for a discarded part)."""

    tensor: torch.Tensor
    nbytes: int
    host: torch.Tensor | None


def check_parts(parts: Iterable[str]) -> tuple[str, ...]:
    """``parts`` as a tuple of known part names; raises ValueError naming an unknown one."""
    parts = tuple(parts)
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        raise ValueError(f"unknown trainer state part(s) {unknown}; known: {list(PARTS)}")
    return parts


class StateOffloader:
    """Moves named parts of one rank's trainer state off the device and back.

    ``model``: the DDP-wrapped GPTModel; ``optimizer``: what ``get_megatron_optimizer`` built
    (chained or not); ``reference``: the frozen reference GPTModel, if any.
    """

    def __init__(self, model: Any, optimizer: Any, reference: Any = None) -> None:
        self.model, self.optimizer, self.reference = model, optimizer, reference
        self.device = next(model.parameters()).device
        self.moved: dict[str, list[_Moved]] = {}  # offloaded parts

    def resident(self, part: str) -> bool:
        """Whether ``part`` is on the device."""
        return check_parts([part])[0] not in self.moved

    def require(self, call: str, parts: Iterable[str]) -> None:
        """Raise OffloadedError if any of ``parts``, which ``call`` needs, is offloaded."""
        missing = [p for p in check_parts(parts) if p in self.moved]
        if missing:
            raise OffloadedError(
                f"trainer.{call} needs its {', '.join(missing)} on the device but they are "
                "offloaded; onload them first (Trainer.onload / OnloadTrainer)"
            )

    def offload(self, parts: Iterable[str] = PARTS) -> dict[str, int]:
        """Copy each part not yet offloaded to the host and free its device storage; returns the
        bytes moved per part (0 for a part already offloaded)."""
        parts, moved = check_parts(parts), {}
        tensors = self._tensors_by_part()
        for part in parts:
            if part in self.moved:
                moved[part] = 0
                continue
            saved = self.moved[part] = []  # filled as it goes: a failure loses no bytes
            for tensor in tensors[part]:
                flat, host = _bytes_of(tensor), None
                if part not in DISCARDED:
                    host = platform.host_buffer(flat)
                    host.copy_(flat, non_blocking=True)
                    platform.synchronize(self.device)  # it must land before the storage goes
                tensor.untyped_storage().resize_(0)
                saved.append(_Moved(tensor, flat.numel(), host))
            moved[part] = sum(s.nbytes for s in saved)
        platform.release_cached_memory(self.device)
        return moved

    def onload(self, parts: Iterable[str] = PARTS) -> dict[str, int]:
        """Reallocate each offloaded part's storages and copy its bytes back; returns the bytes
        moved per part (0 for a part already resident)."""
        moved = {}
        for part in check_parts(parts):
            saved = self.moved.get(part, [])
            for item in saved:  # a retry after a failure redoes restored storages, harmlessly
                item.tensor.untyped_storage().resize_(item.nbytes)
                if item.host is None:
                    _bytes_of(item.tensor).zero_()
                else:
                    _bytes_of(item.tensor).copy_(item.host, non_blocking=True)
            platform.synchronize(self.device)  # before the host buffers are dropped
            self.moved.pop(part, None)
            moved[part] = sum(s.nbytes for s in saved)
        return moved

    def _tensors_by_part(self) -> dict[str, list[torch.Tensor]]:
        """One tensor per device storage of each part; a storage shared by several parts counts
        only in the first (e.g. fp32 optimizer params are the model's params)."""
        seen: set[int] = set()
        found = {}
        for part, candidates in (
            ("params", self._params()),
            ("grads", self._grads()),
            ("optimizer", self._optimizer_state()),
        ):
            found[part] = []
            for tensor in candidates:
                storage = tensor.untyped_storage()
                # _cdata names the storage itself, whatever its size or the view on it
                if tensor.device != self.device or storage._cdata in seen:
                    continue
                seen.add(storage._cdata)
                if storage.nbytes() > 0:
                    found[part].append(tensor)
        return found

    def _params(self) -> list[torch.Tensor]:
        params = list(self.model.parameters())
        if self.reference is not None:
            params += list(self.reference.parameters())
        return params

    def _grads(self) -> list[torch.Tensor]:
        buffers = [*self.model.buffers, *getattr(self.model, "expert_parallel_buffers", [])]
        grads = [b.grad_data for b in buffers if b.grad_data is not None]
        for param in [*self.model.parameters(), *self._optimizer_params()]:
            grads += [g for g in (getattr(param, "main_grad", None), param.grad) if g is not None]
        return grads

    def _optimizer_params(self) -> list[torch.Tensor]:
        return [p for inner in self._inner() for g in inner.param_groups for p in g["params"]]

    def _optimizer_state(self) -> list[torch.Tensor]:
        state = [
            value
            for inner in self._inner()
            for per_param in inner.state.values()
            for value in per_param.values()
            if isinstance(value, torch.Tensor)
        ]
        return self._optimizer_params() + state

    def _inner(self) -> list[torch.optim.Optimizer]:
        """The torch optimizers inside Megatron's (chained) optimizer."""
        megatron = getattr(self.optimizer, "chained_optimizers", [self.optimizer])
        return [m.optimizer for m in megatron if getattr(m, "optimizer", None) is not None]


def move_parts(offloader: StateOffloader, action: str, parts: Iterable[str]) -> dict[str, float]:
    """``offloader``'s ``action`` ("offload" or "onload") of ``parts``, as a rank replies: the
    bytes moved, the seconds it took, and ``changed/<part>`` for each part this call moved (not
    one that was already where it was sent; an empty part moves 0 bytes but is one)."""
    start, parts = time.perf_counter(), check_parts(parts)
    changed = [p for p in parts if offloader.resident(p) == (action == "offload")]
    moved = getattr(offloader, action)(parts)
    reply = {"bytes": float(sum(moved.values())), "seconds": time.perf_counter() - start}
    return reply | {f"{CHANGED}{part}": 1.0 for part in changed}


def _bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    """A flat byte tensor over the whole storage under ``tensor`` (not just its view)."""
    return torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(tensor.untyped_storage())


def kept_on(saved: Any, device: torch.device | str) -> Any:
    """A host-memory (``torch.load`` to the CPU) optimizer state dict with the tensors the
    optimizer keeps as they are (Adam's per-parameter moments and steps) copied to ``device``,
    all of them, before the optimizer loads it (``load_state_dict`` takes them as its state):
    torch.load's storages cannot be resized, which is how offloading frees one. The main
    weights stay in host memory: Megatron copies them into its live ones, so the file's copy
    of them never reaches the device (as ``map_location=device`` would put it there)."""
    for part in saved if isinstance(saved, list) else [saved]:
        inner = part.get("optimizer", part)
        inner["state"] = tree_map(
            lambda v: v.to(device, copy=True) if isinstance(v, torch.Tensor) else v, inner["state"]
        )
    return saved
