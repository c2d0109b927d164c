"""The engine's side of weight sync: broadcasts land straight in the model's parameters.

SGLang's own receive allocates a fresh tensor per name for every sync and then copies every
byte again in ``model.load_weights``. This module is an SGLang plugin (entry point group
``sglang.srt.plugins`` in ``setup.py``; SGLang loads it in each of its processes) that adds one
``load_format``, ``IN_PLACE``, to ``update_weights_from_distributed``:

- a tensor whose name, shape and dtype are those of a parameter of this engine rank (the sender
  uses the engine's fused layout when the engine has one TP rank) is broadcast into the
  parameter itself: no allocation, no second copy;
- any other tensor (dtype conversion, an engine TP shard, a layout SGLang must reshape) is
  received into a staging buffer kept for the next sync and handed to ``load_weights`` as usual;
- tensors under ``PACK_BELOW`` bytes travel together in one broadcast per dtype
  (``broadcast_plan``) and are copied out of it.

For trainer and engine on one host (``split``, ``defer``), ``update_weights_from_tensor`` with
``load_format`` ``SHARED_FILE`` carries no tensors, only a shared file's path and layout
(``shared_memory.py``): the engine maps the file once and copies each tensor into its parameter.

Requests with any other ``load_format`` run SGLang's code unchanged, so the plugin is inert for
engines that are not relax-launch's.
"""

from __future__ import annotations

import math
from typing import Any

IN_PLACE = "relax_in_place"
PACK_BELOW = 1 << 16  # bytes: smaller tensors share one broadcast
SHARED_FILE = "relax_shared_file"
UPDATER = "sglang.srt.model_executor.model_runner_components.weight_updater.WeightUpdater"


def register() -> None:
    """SGLang plugin entry point: wrap the distributed receive (applied by SGLang's registry)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(f"{UPDATER}.receive_weights_from_distributed", receive, HookType.AROUND)
    HookRegistry.register(f"{UPDATER}.update_weights_from_tensor", load_shared, HookType.AROUND)


def receive(original: Any, updater: Any, **request: Any) -> list:
    """Receive one update request's tensors; returns those ``load_weights`` must still apply."""
    if request.get("load_format") != IN_PLACE:
        return original(updater, **request)
    import torch

    group = updater._model_update_group[request["group_name"]]
    state = _receiver_state(updater)
    names, dtypes, shapes = request["names"], request["dtypes"], request["shapes"]
    alone, packed = broadcast_plan(dtypes, shapes)
    staged, pending, packs = [], [], []
    for i in alone:
        dtype = getattr(torch, dtypes[i])
        destination = state.direct(names[i], dtype, shapes[i])
        if destination is None:
            destination = state.staging(names[i], dtype, shapes[i], updater.device)
            staged.append((names[i], destination))
        pending.append(destination)
    for dtype_name, indices in packed.items():
        numel = sum(_numel(shapes[i]) for i in indices)
        dtype = getattr(torch, dtype_name)
        pack = state.staging(f"packed {dtype_name}", dtype, [numel], updater.device)
        pending.append(pack)
        packs.append((pack, indices))
    # Every receive is posted before any is waited on: the sender never waits for this process
    # to get round to the next tensor.
    works = [torch.distributed.broadcast(t, src=0, group=group, async_op=True) for t in pending]
    for work in works:
        work.wait()
    for pack, indices in packs:
        offset = 0
        for i in indices:
            piece = pack[offset : offset + _numel(shapes[i])].view(shapes[i])
            offset += piece.numel()
            destination = state.direct(names[i], pack.dtype, shapes[i])
            if destination is None:
                staged.append((names[i], piece))
            else:
                destination.copy_(piece)
    return staged


def broadcast_plan(dtypes: list[str], shapes: list[list[int]]) -> tuple[list[int], dict]:
    """The order of one update's broadcasts, the same on sender and engine: the manifest's
    tensors of ``PACK_BELOW`` bytes or more one by one, in order, then the smaller ones (norms,
    biases) concatenated into one broadcast per dtype, so each costs no collective of its own."""
    alone, packed = [], {}
    for i, (dtype, shape) in enumerate(zip(dtypes, shapes, strict=True)):
        if nbytes(dtype, shape) >= PACK_BELOW:
            alone.append(i)
        else:
            packed.setdefault(dtype, []).append(i)
    return alone, dict(sorted(packed.items()))


def _numel(shape: list[int]) -> int:
    return math.prod(shape)


def nbytes(dtype: str, shape: list[int]) -> int:
    """Bytes of a tensor of ``dtype`` (torch's name, e.g. "bfloat16") and ``shape``."""
    import torch

    return getattr(torch, dtype).itemsize * _numel(shape)


def load_shared(original: Any, updater: Any, **request: Any) -> tuple[bool, str]:
    """Load one update from a shared file (``shared_memory.py``): its payload is the file's
    path and layout; each tensor is copied from the file into its parameter."""
    if request.get("load_format") != SHARED_FILE:
        return original(updater, **request)
    import torch

    path, entries = request["named_tensors"]
    state = _receiver_state(updater)
    region = state.mapping(path, entries)
    staged = []
    for name, dtype_name, shape, offset in entries:
        dtype = getattr(torch, dtype_name)
        source = region[offset : offset + nbytes(dtype_name, shape)].view(dtype).view(shape)
        destination = state.direct(name, dtype, shape)
        if destination is None:
            staged.append((name, source.to(updater.device)))
        else:
            destination.copy_(source)
    if staged:
        updater.get_model().load_weights(staged)
    return True, "Success"


class _ReceiverState:
    """Per engine rank: the parameters by name (looked up once) and the staging buffers."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.params = dict(model.named_parameters())
        self.buffers: dict[str, Any] = {}
        self.files: dict[str, Any] = {}  # shared files mapped once, kept after they are unlinked

    def direct(self, name: str, dtype: Any, shape: list[int]) -> Any:
        param = self.params.get(name)
        if param is None or param.dtype != dtype or list(param.shape) != list(shape):
            return None
        return param.data if param.data.is_contiguous() else None

    def mapping(self, path: str, entries: list) -> Any:
        import torch

        if path not in self.files:
            _, dtype, shape, offset = entries[-1]  # the layout is in file order
            size = offset + nbytes(dtype, shape)
            self.files[path] = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
        return self.files[path]

    def staging(self, name: str, dtype: Any, shape: list[int], device: Any) -> Any:
        import torch

        buffer = self.buffers.get(name)
        if buffer is None or buffer.dtype != dtype or list(buffer.shape) != list(shape):
            buffer = self.buffers[name] = torch.empty(shape, dtype=dtype, device=device)
        return buffer


_states: dict[int, _ReceiverState] = {}  # by engine rank's model (the updater is frozen)


def _receiver_state(updater: Any) -> _ReceiverState:
    model = updater.get_model()
    state = _states.get(id(model))
    if state is None or state.model is not model:
        state = _states[id(model)] = _ReceiverState(model)
    return state
