"""The engine's side of weight sync: the new weights land straight in the model's parameters.

SGLang's own receive allocates a fresh tensor per name for every sync and then copies every
byte again in ``model.load_weights``. This module is an SGLang plugin (entry point
``RECEIVER_PLUGIN`` of group ``sglang.srt.plugins`` in ``setup.py``; SGLang loads it in each of
its processes) that adds one ``load_format``, ``IN_PLACE``, to two update routes:

- ``update_weights_from_distributed`` (a broadcast from the trainer): a tensor whose name, shape
  and dtype are those of a parameter of this engine rank (the sender uses the engine's fused
  layout when the engine has one TP rank), or of one slice of it (``NAME[i]``: a routed
  expert of a MoE layer's stacked ``w13_weight``/``w2_weight``), is broadcast into the
  parameter itself: no allocation, no second copy. Any other tensor (dtype conversion, an
  engine TP shard, a layout SGLang must reshape or pad) is received into a staging buffer kept
  for the next sync and handed to ``load_weights`` under its checkpoint names
  (``checkpoint_names``). Tensors under ``PACK_BELOW`` bytes travel together in one broadcast
  per dtype (``broadcast_plan``) and are copied out of it.
- ``update_weights_from_tensor`` (trainer and engine on one host, ``split``/``defer``): the
  request names one bucket of the export, a CUDA tensor shared by IPC or a CPU file in
  ``/dev/shm`` (``colocated.py``); each tensor is copied out of the bucket into its parameter,
  or handed to ``load_weights`` where layouts differ.

Senders first ask each engine whether this plugin is loaded (``RECEIVER_PROBE``, a weight name
only it answers): without it an engine would misread the packed broadcasts and the buckets,
and crash. Every update answered this way carries a report (``RECEIVER_REPORT`` then JSON, in
the reply's message): tensors received straight into their parameter (``in_place``), copied into
it from a shared buffer (``copied``: the pack of small ones, a colocated bucket) or staged for
``load_weights`` (``staged``, with their bytes), the staging buffers this update allocated, and
the parameters that no longer sit where they sat at the first update (``moved``, always 0:
nothing here replaces a parameter's storage). The sender reads it: at every sync, the proof that
the weights went into the parameters.

Requests with any other ``load_format`` run SGLang's code unchanged, so the plugin is inert for
engines that are not relax-launch's.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from relax_launch import platform
from relax_launch.inference import policy_adapter
from relax_launch.weights import pipeline_stages

IN_PLACE = "relax_in_place"
RECEIVER_REPORT = "relax-launch receiver: "  # then the report, as JSON, in the reply's message
PACK_BELOW = 1 << 16  # bytes: smaller tensors share one broadcast
ABORT_KEY = "relax_launch/abort"  # set in a broadcast group's store when its sender gives up
WATCH_S = 1.0  # how often a waiting receive looks for it
RECEIVER_PROBE = "relax_launch.receiver"  # a weight name only this plugin answers
COMPONENTS = "sglang.srt.model_executor.model_runner_components"
UPDATER = f"{COMPONENTS}.weight_updater.WeightUpdater"
EXPORTER = f"{COMPONENTS}.weight_exporter.WeightExporter"


def register() -> None:
    """SGLang plugin entry point: wrap the update routes (applied by SGLang's registry); in an
    engine serving the LoRA policy as an adapter, that adapter as every request's default; on
    the CPU, what MoE models and prefill engines need there."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(f"{UPDATER}.receive_weights_from_distributed", receive, HookType.AROUND)
    HookRegistry.register(f"{UPDATER}.load_weights_from_distributed", reported, HookType.AROUND)
    HookRegistry.register(f"{UPDATER}.update_weights_from_tensor", load_bucket, HookType.AROUND)
    HookRegistry.register(f"{EXPORTER}.get_weights_by_name", answer_probe, HookType.AROUND)
    pipeline_stages.register()  # what pipeline-parallel engines need to take an update
    policy_adapter.register()  # engines that serve a LoRA policy as an adapter only
    platform.moe_engine_without_accelerator()
    platform.prefill_without_accelerator()


def answer_probe(original: Any, exporter: Any, name: str, *args: Any, **kwargs: Any) -> Any:
    """``/get_weights_by_name`` of ``RECEIVER_PROBE``: this plugin says it is loaded (a stock
    engine answers that it has no such weight). Senders ask before any update: an engine
    without the receiver would misread their packed broadcasts and buckets, and crash."""
    if name == RECEIVER_PROBE:
        return [RECEIVER_REPORT.strip(), "ready"]
    return original(exporter, name, *args, **kwargs)


def receive(original: Any, updater: Any, **request: Any) -> list:
    """Receive one update request's tensors; returns those ``load_weights`` must still apply."""
    if request.get("load_format") != IN_PLACE:
        return original(updater, **request)
    import torch

    group = updater._model_update_group[request["group_name"]]
    state = _receiver_state(updater)
    report = state.begin()
    names, dtypes, shapes = request["names"], request["dtypes"], request["shapes"]
    alone, packed = broadcast_plan(dtypes, shapes)
    staged, pending, packs = [], [], []
    elsewhere = 0
    for i in alone:
        dtype = getattr(torch, dtypes[i])
        destination = state.direct(names[i], dtype, shapes[i])
        if destination is None and state.elsewhere(names[i]):
            destination, elsewhere = state.discard(dtype, shapes[i], updater.device), elsewhere + 1
        elif destination is None:
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
        wait_unless_aborted(work, group)
    copied = 0
    for pack, indices in packs:
        offset = 0
        for i in indices:
            piece = pack[offset : offset + _numel(shapes[i])].view(shapes[i])
            offset += piece.numel()
            destination = state.direct(names[i], pack.dtype, shapes[i])
            if destination is None and state.elsewhere(names[i]):
                elsewhere += 1
            elif destination is None:
                staged.append((names[i], piece))
            else:
                destination.copy_(piece)
                copied += 1
    report.count(len(names) - elsewhere, staged, copied)
    report.fields["other_stage"] += elsewhere
    return for_load_weights(staged)


def wait_unless_aborted(work: Any, group: Any) -> None:
    """Wait for one broadcast, until the sender gives up the sync (it sets ``ABORT_KEY`` in the
    group's store, or is gone with it): then raise, so this engine is free again."""
    from datetime import timedelta

    from relax_launch.weights.broadcast_group import group_store

    store = group_store(group)
    while True:
        try:
            work.wait(timedelta(seconds=WATCH_S))
            return
        except RuntimeError:
            if work.is_completed():  # it failed, rather than timed out
                raise
        try:
            aborted = store.check([ABORT_KEY])
        except Exception as exc:  # noqa: BLE001 - the store went with the sender
            raise RuntimeError(f"the weight sender is gone: {exc}") from exc
        if aborted:
            raise RuntimeError("the weight sender gave up this sync")


def reported(original: Any, updater: Any, named_tensors: list) -> tuple[bool, str]:
    """``load_weights_from_distributed`` (the staged tensors), and this update's report."""
    success, message = original(updater, named_tensors)
    return success, _receiver_state(updater).finish(message)


def load_bucket(original: Any, updater: Any, **request: Any) -> tuple[bool, str]:
    """Load one bucket of a colocated update (``colocated.py``): the payload is the bucket (a
    CUDA tensor shared by IPC, or a CPU shared file's ``(path, size)``, mapped once) and its
    layout; each tensor is copied out of it into its parameter."""
    if request.get("load_format") != IN_PLACE:
        return original(updater, **request)
    import torch

    handle, entries = request["named_tensors"]
    state = _receiver_state(updater)
    bucket = handle if isinstance(handle, torch.Tensor) else state.mapping(*handle)
    report = state.begin()
    staged = []
    for name, dtype_name, shape, offset in entries:
        dtype = getattr(torch, dtype_name)
        source = bucket[offset : offset + nbytes(dtype_name, shape)].view(dtype).view(shape)
        destination = state.direct(name, dtype, shape)
        if destination is None and state.elsewhere(name):
            report.fields["other_stage"] += 1
            continue
        if destination is None:
            staged.append((name, source.to(updater.device)))
        else:
            destination.copy_(source, non_blocking=True)
    kept = len(entries) - report.fields["other_stage"]
    report.count(kept, staged, kept - len(staged))
    if staged:
        updater.get_model().load_weights(for_load_weights(staged))
    platform.synchronize(bucket.device)  # the trainer reuses the bucket once we answer
    return True, state.finish("Success")


def for_load_weights(staged: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """Staged tensors as ``load_weights`` reads them (``checkpoint_names``)."""
    return [pair for name, tensor in staged for pair in checkpoint_names(name, tensor)]


def checkpoint_names(name: str, tensor: Any) -> list[tuple[str, Any]]:
    """A tensor sent in the engine's fused layout that did not fit the parameter (the CPU
    engine pads some sizes, e.g. a shared expert's), as the checkpoint tensors ``load_weights``
    reads, which pads and shards them itself: a routed expert's slice ``experts.w13_weight[e]``
    as expert e's gate and up projections, ``w2_weight[e]`` as its down projection, a
    ``gate_up_proj`` as gate and up. Any other name as it is."""
    stem, _, index = name.partition("[")
    if stem.endswith("experts.w13_weight") and index:
        prefix = f"{stem.removesuffix('w13_weight')}{index[:-1]}."
        gate, up = tensor.chunk(2)
        return [(prefix + "gate_proj.weight", gate), (prefix + "up_proj.weight", up)]
    if stem.endswith("experts.w2_weight") and index:
        return [(f"{stem.removesuffix('w2_weight')}{index[:-1]}.down_proj.weight", tensor)]
    if name.endswith("gate_up_proj.weight"):
        gate, up = tensor.chunk(2)
        stem = name.removesuffix("gate_up_proj.weight")
        return [(stem + "gate_proj.weight", gate), (stem + "up_proj.weight", up)]
    return [(name, tensor)]


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


class _Report:
    """What one update did on this engine rank."""

    def __init__(self, state: _ReceiverState) -> None:
        self.state, self.allocated_before = state, state.allocated
        self.fields = {"in_place": 0, "copied": 0, "staged": 0, "staged_bytes": 0}
        self.fields["other_stage"] = 0  # received and dropped: another pipeline stage's

    def count(self, tensors: int, staged: list, copied: int) -> None:
        """``tensors`` of an update: ``copied`` of them from a shared buffer (a pack of small
        ones, a colocated bucket) into their parameter, ``staged`` ones to ``load_weights``,
        the rest received straight into their parameter."""
        self.fields["in_place"] += tensors - len(staged) - copied
        self.fields["copied"] += copied
        self.fields["staged"] += len(staged)
        self.fields["staged_bytes"] += sum(t.numel() * t.element_size() for _, t in staged)

    def render(self) -> str:
        fields = self.fields | {
            "allocated": self.state.allocated - self.allocated_before,
            "moved": self.state.moved(),
        }
        return RECEIVER_REPORT + json.dumps(fields)


class _ReceiverState:
    """Per engine rank: the parameters by name and where their storage sat when first seen
    (looked up once), the staging buffers, and the report of the update in progress."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.params = dict(model.named_parameters())
        self.modules = dict(model.named_modules())
        self.ties_head = bool(getattr(getattr(model, "config", None), "tie_word_embeddings", 0))
        self.addresses = {name: p.data.data_ptr() for name, p in self.params.items()}
        self.buffers: dict[str, Any] = {}
        self.files: dict[str, Any] = {}  # colocated buckets' shared files, mapped once
        self.allocated = 0  # staging buffers made so far
        self.report: _Report | None = None

    def begin(self) -> _Report:
        self.report = _Report(self)
        return self.report

    def finish(self, message: str) -> str:
        """``message`` with this update's report appended (once)."""
        report, self.report = self.report, None
        return message if report is None else f"{message}; {report.render()}"

    def mapping(self, path: str, size: int) -> Any:
        """A colocated bucket's shared file, mapped at its first use (kept after the trainer
        removes its name)."""
        import torch

        if path not in self.files or self.files[path].numel() < size:
            self.files[path] = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
        return self.files[path]

    def moved(self) -> int:
        """Parameters whose storage is no longer where it was at the first update."""
        current = dict(self.model.named_parameters())
        return sum(
            name not in current or current[name].data.data_ptr() != address
            for name, address in self.addresses.items()
        )

    def direct(self, name: str, dtype: Any, shape: list[int]) -> Any:
        """The storage tensor ``name`` lands in: a parameter, or ``NAME[i]`` the i-th slice of
        one (a routed expert of a layer's stacked experts); None when none fits exactly."""
        stacked, _, index = name.partition("[")
        param = self.params.get(stacked)
        if param is None or not param.data.is_contiguous():
            return None
        data = param.data
        if index:
            slot = int(index[:-1]) if index.endswith("]") and index[:-1].isdigit() else -1
            if not 0 <= slot < (data.shape[0] if data.dim() else 0):
                return None
            data = data[slot]
        if data.dtype != dtype or list(data.shape) != list(shape):
            return None
        return data

    def elsewhere(self, name: str) -> bool:
        """Whether another pipeline stage of this engine holds tensor ``name``: a decoder layer
        outside this stage's layers, or a module this stage holds as SGLang's placeholder (the
        embedding after the first stage, the final norm and head before the last). Every
        stage receives every tensor of the broadcast and keeps only its own."""
        inner = getattr(self.model, "model", None)
        start, end = getattr(inner, "start_layer", None), getattr(inner, "end_layer", None)
        if start is None or end is None:
            return False
        found = re.search(r"\.layers\.(\d+)\.", name)
        if found:
            return not start <= int(found.group(1)) < end
        stem = name.partition("[")[0]
        if stem in self.params or self.ties_head and "embed_tokens" in stem:
            return False  # the last stage's head is loaded from the tied embedding
        module = self.modules.get(stem.rpartition(".")[0])
        return type(module).__name__ == "PPMissingLayer"

    def discard(self, dtype: Any, shape: list[int], device: Any) -> Any:
        """Where another stage's tensor is received: one scratch buffer per dtype, grown to
        the largest such tensor (its contents are never read)."""
        numel = _numel(shape)
        key = f"other stages' {dtype}"
        if key not in self.buffers or self.buffers[key].numel() < numel:
            self.staging(key, dtype, [numel], device)
        return self.buffers[key][:numel].view(shape)

    def staging(self, name: str, dtype: Any, shape: list[int], device: Any) -> Any:
        import torch

        buffer = self.buffers.get(name)
        if buffer is None or buffer.dtype != dtype or list(buffer.shape) != list(shape):
            buffer = self.buffers[name] = torch.empty(shape, dtype=dtype, device=device)
            self.allocated += 1
        return buffer


_states: dict[int, _ReceiverState] = {}  # by engine rank's model (the updater is frozen)


def _receiver_state(updater: Any) -> _ReceiverState:
    model = updater.get_model()
    state = _states.get(id(model))
    if state is None or state.model is not model:
        state = _states[id(model)] = _ReceiverState(model)
    return state
