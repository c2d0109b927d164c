"""The engine's side of weight sync: the new weights land straight in the model's parameters.

SGLang's own receive allocates a fresh tensor per name for every sync and then copies every
byte again in ``model.load_weights``. This module is an SGLang plugin (entry point
``RECEIVER_PLUGIN`` of group ``sglang.srt.plugins`` in ``setup.py``; SGLang loads it in each of
its processes) that adds one ``load_format``, ``IN_PLACE`` (a broadcast's carries the sender's
bucketing after it: ``in_place_format``), to two update routes:

- ``update_weights_from_distributed`` (a broadcast from the trainer): a tensor whose name, shape
  and dtype are those of a parameter of this engine rank (the sender sends each TP rank its own
  slice of the engine's fused layout, ``engine_shards.py``), or of one slice of it
  (``NAME[i]``: a routed expert of a MoE layer's stacked ``w13_weight``/``w2_weight``), is
  broadcast into the parameter itself: no allocation, no second copy. Any other tensor (dtype
  conversion, a layout SGLang must reshape or pad) is received into the update's one bounded
  staging buffer (``staging.py``, freed after the update) and handed to ``load_weights`` under
  its checkpoint names (``checkpoint_names``). Small tensors travel in buckets per dtype
  (``broadcast_plan``, sized by ``platform.sync_bucketing``), received into at most two
  buffers at a time and copied out of them (``staging.Receives``).
- ``update_weights_from_tensor`` (trainer and engine on one host, ``split``/``defer``): the
  request names one bucket of the export, a CUDA tensor shared by IPC or a CPU file in
  ``/dev/shm`` (``colocated.py``); each tensor is copied out of the bucket into its parameter,
  or handed to ``load_weights`` where layouts differ.

Senders first ask each engine whether this plugin is loaded (``RECEIVER_PROBE``, a weight name
only it answers): without it an engine would misread the packed broadcasts and the buckets,
and crash. Every update answered this way carries a report (``RECEIVER_REPORT`` then JSON, in
the reply's message): tensors received straight into their parameter (``in_place``), copied into
it from a shared buffer (``copied``: a bucket of small ones, a colocated bucket) or staged for
``load_weights`` (``staged``, with their bytes), the most bytes its receive buffers held at once
(``peak_staging_bytes``: buckets and staging), the staging buffers this update allocated, and
the parameters that no longer sit where they sat at the first update (``moved``, always 0:
nothing here replaces a parameter's storage). The sender reads it: at every sync, the proof that
the weights went into the parameters.

Requests with any other ``load_format`` run SGLang's code unchanged, so the plugin is inert for
engines that are not relax-launch's.
"""

from __future__ import annotations

import json
import re
from typing import Any

from relax_launch import platform
from relax_launch.inference import policy_adapter
from relax_launch.weights import pipeline_stages
from relax_launch.weights.broadcast_group import group_store
from relax_launch.weights.collective_wait import wait_for
from relax_launch.weights.engine_caches import forget_image_features
from relax_launch.weights.staging import ALIGN as STAGING_ALIGN
from relax_launch.weights.staging import NAME as STAGING
from relax_launch.weights.staging import Receives, Staging, for_load_weights, largest_bucket
from relax_launch.weights.update_plan import (
    IN_PLACE,
    Broadcast,
    broadcast_plan,
    bucketing,
    nbytes,
    stacked_slice,
)

RECEIVER_REPORT = "relax-launch receiver: "  # then the report, as JSON, in the reply's message
ABORT_KEY = "relax_launch/abort"  # set in a broadcast group's store when its sender gives up
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
    platform.weight_sync_backend("cpu")  # registers the CPU's sync backend: a sender may name it


def answer_probe(original: Any, exporter: Any, name: str, *args: Any, **kwargs: Any) -> Any:
    """``/get_weights_by_name`` of ``RECEIVER_PROBE``: this plugin says it is loaded (a stock
    engine answers that it has no such weight). Senders ask before any update: an engine
    without the receiver would misread their packed broadcasts and buckets, and crash."""
    if name == RECEIVER_PROBE:
        return [RECEIVER_REPORT.strip(), "ready"]
    return original(exporter, name, *args, **kwargs)


def receive(original: Any, updater: Any, **request: Any) -> list:
    """Receive one update request's tensors; returns those ``load_weights`` must still apply."""
    buckets = bucketing(request.get("load_format"))
    if buckets is None:
        return original(updater, **request)
    state = _receiver_state(updater)
    report = state.begin()
    names, dtypes, shapes = request["names"], request["dtypes"], request["shapes"]
    group = updater._model_update_group[request["group_name"]]
    plan = state.plan(names, dtypes, shapes, buckets)
    largest = largest_bucket(plan, dtypes, shapes)
    receives = Receives(state, group, names, shapes, largest, updater.device, wait_unless_aborted)
    capacity = _staging_needed(state, plan, names, dtypes, shapes)
    staging = Staging.of_update(state, min(buckets[1], capacity), updater)
    wholes: dict[int, Any] = {}  # a tensor received in parts: where it goes (None: dropped)
    for item in plan:
        if not item.bucket:
            receives.post(item, _destination(state, staging, receives, item, wholes))
        elif (in_place := _stacked_destination(state, item, names, shapes)) is not None:
            receives.post(item, in_place)  # consecutive experts, straight into their slices
        else:
            receives.post(item, *receives.bucket_buffer(item))
    receives.complete_all()
    staged, elsewhere = receives.staged + staging.pending, receives.elsewhere
    report.count(len(names) - elsewhere - staging.num_loaded, staged, receives.copied)
    report.add_staging(staging, receives.buffer_bytes())
    report.fields["other_stage"] += elsewhere
    return for_load_weights(staged)


def _destination(
    state: _ReceiverState, staging: Staging, receives: Receives, item: Broadcast, wholes: dict
) -> Any:
    """Where a tensor sent alone (or one part of it, ``item.rows``) is received: its parameter;
    the staging buffer, whole, for ``load_weights``; or room for this broadcast alone, never
    read, for another pipeline stage's."""
    import torch

    (i,) = item.indices
    name, shape, dtype = receives.names[i], receives.shapes[i], getattr(torch, item.dtype)
    if item.rows is None or item.rows[0] == 0:  # the tensor's first broadcast
        target = state.direct(name, dtype, shape)
        if target is None and state.elsewhere(name):
            receives.elsewhere += 1
        elif target is None:
            target = staging.take(name, dtype, shape, receives.complete_all, keep=True)
        wholes[i] = target
    target = wholes.pop(i) if item.rows is None or item.rows[1] == shape[0] else wholes[i]
    if target is None:
        part = shape if item.rows is None else [item.rows[1] - item.rows[0], *shape[1:]]
        return staging.take(name, dtype, part, receives.complete_all, keep=False)
    return target if item.rows is None else target[item.rows[0] : item.rows[1]]


def _stacked_destination(
    state: _ReceiverState, item: Broadcast, names: list[str], shapes: list[list[int]]
) -> Any:
    """A bucket of consecutive slices of one stacked parameter: those slices of it, where they
    fit exactly (else None: the bucket is received into a buffer and copied out)."""
    import torch

    if item.stacked is None or any(shapes[i] != shapes[item.indices[0]] for i in item.indices):
        return None
    first, last = (stacked_slice(names[i])[1] for i in (item.indices[0], item.indices[-1]))
    shape = [len(item.indices), *shapes[item.indices[0]]]
    return state.direct(f"{item.stacked}[{first}:{last + 1}]", getattr(torch, item.dtype), shape)


def _staging_needed(
    state: _ReceiverState,
    plan: list[Broadcast],
    names: list[str],
    dtypes: list[str],
    shapes: list[list[int]],
) -> int:
    """Bytes of the tensors sent alone that fit no parameter here (with their alignment)."""
    import torch

    alone = {i for item in plan if not item.bucket for i in item.indices}
    return sum(
        nbytes(dtypes[i], shapes[i]) + STAGING_ALIGN
        for i in alone
        if state.direct(names[i], getattr(torch, dtypes[i]), shapes[i]) is None
    )


def wait_unless_aborted(work: Any, group: Any) -> None:
    """Wait for one broadcast (``collective_wait``: polled, never ``wait(timeout)``, which
    aborts an NCCL group) until the sender gives up the sync (it sets ``ABORT_KEY`` in the
    group's store, or is gone with it): then raise, so this engine is free again. No deadline
    of its own: the group's timeout (the sync's) ends a receive whose sender is stuck."""
    store = group_store(group)

    def sender_still_sending() -> None:
        try:
            aborted = store.check([ABORT_KEY])
        except Exception as exc:  # noqa: BLE001 - the store went with the sender
            raise RuntimeError(f"the weight sender is gone: {exc}") from exc
        if aborted:
            raise RuntimeError("the weight sender gave up this sync")

    wait_for(work, None, "a weight broadcast", sender_still_sending)


def reported(original: Any, updater: Any, named_tensors: list) -> tuple[bool, str]:
    """``load_weights_from_distributed`` (the staged tensors), and this update's report."""
    success, message = original(updater, named_tensors)
    forget_image_features(name for name, _ in named_tensors)
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
    forget_image_features(name for name, *_ in entries)
    return True, state.finish("Success")


class _Report:
    """What one update did on this engine rank."""

    def __init__(self, state: _ReceiverState) -> None:
        self.state, self.allocated_before = state, state.allocated
        self.fields = {"in_place": 0, "copied": 0, "staged": 0, "staged_bytes": 0}
        self.fields["other_stage"] = 0  # received and dropped: another pipeline stage's
        self.fields["peak_staging_bytes"] = 0  # receive buffers held at once (bucket, staging)

    def count(self, tensors: int, staged: list, copied: int) -> None:
        """``tensors`` of an update: ``copied`` of them from a shared buffer (a bucket of small
        ones, a colocated bucket) into their parameter, ``staged`` ones to ``load_weights``,
        the rest received straight into their parameter."""
        self.fields["in_place"] += tensors - len(staged) - copied
        self.fields["copied"] += copied
        self.fields["staged"] += len(staged)
        self.fields["staged_bytes"] += sum(t.numel() * t.element_size() for _, t in staged)

    def add_staging(self, staging: Staging, bucket_buffer_bytes: int) -> None:
        """What went through ``staging``'s buffer to ``load_weights`` while the update went
        on, and the most the update's buffers (it and the buckets') held at once."""
        self.fields["staged"] += staging.num_loaded
        self.fields["staged_bytes"] += staging.loaded_bytes
        peak = staging.peak_bytes + bucket_buffer_bytes
        self.fields["peak_staging_bytes"] = max(self.fields["peak_staging_bytes"], peak)

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
        self.device = next(iter(self.params.values())).device if self.params else None
        self.buffers: dict[str, Any] = {}
        self.files: dict[str, Any] = {}  # colocated buckets' shared files, mapped once
        self.allocated = 0  # staging buffers made so far
        self.report: _Report | None = None
        self.planned: tuple = (None, [])  # the last update's key and broadcast plan

    def plan(
        self, names: list[str], dtypes: list[str], shapes: list[list[int]], buckets: tuple
    ) -> list[Broadcast]:
        """``broadcast_plan`` of an update (the last one's kept: every sync sends the same)."""
        key = (tuple(names), tuple(dtypes), tuple(map(tuple, shapes)), tuple(buckets))
        if self.planned[0] != key:
            self.planned = (key, broadcast_plan(names, dtypes, shapes, *buckets))
        return self.planned[1]

    def begin(self) -> _Report:
        self.report = _Report(self)
        return self.report

    def finish(self, message: str) -> str:
        """``message`` with this update's report appended (once); the update's staging freed,
        and on a GPU handed back (the caching allocator would keep it, memory the engine's
        KV cache was sized without)."""
        staging = self.buffers.pop(STAGING, None)
        report, self.report = self.report, None
        buckets = report is not None and report.fields["peak_staging_bytes"] > 0
        if (staging is not None or buckets) and self.device is not None:
            platform.release_cached_memory(self.device)
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
        """The storage tensor ``name`` lands in: a parameter, ``NAME[i]`` the i-th slice of one
        (a routed expert of a layer's stacked experts) or ``NAME[a:b]`` slices a to b-1; None
        when none fits exactly."""
        stacked, _, index = name.partition("[")
        param = self.params.get(stacked)
        if param is None and self.ties_head and stacked == "model.embed_tokens.weight":
            param = self.params.get("lm_head.weight")  # a last stage's head is the embedding
        if param is None or not param.data.is_contiguous():
            return None
        data = param.data
        if index:  # NAME[i], or NAME[a:b] (consecutive slices)
            first, colon, end = index.removesuffix("]").partition(":")
            if not (first.isdigit() and (end.isdigit() or not colon) and index.endswith("]")):
                return None
            begin = int(first)
            stop = int(end) if colon else begin + 1
            if not 0 <= begin < stop <= (data.shape[0] if data.dim() else 0):
                return None
            data = data[begin:stop] if colon else data[begin]
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
