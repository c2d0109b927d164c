"""Colocated weight transport: trainer and engines on one host share a memory-mapped file.

For ``split`` and ``defer`` placements the trainer and its engines run on the same machine
(on one GPU NCCL cannot even join two processes). Instead of a broadcast, the sender writes the
stage's export into a file under ``/dev/shm`` laid out by the manifest, then makes one
``update_weights_from_tensor`` request per engine whose payload names the file and the layout
(no tensor data in the request). The engine maps the file once and copies each tensor into its
parameter (``receiver.py``), or hands it to ``load_weights`` where layouts differ.

All or nothing comes for free here: nothing reaches an engine until the whole export is in the
file, so an export that fails leaves every engine untouched. Once every engine has mapped the
file it is unlinked, so a crash cannot leave it behind in memory.
"""

from __future__ import annotations

import base64
import os
import pickle
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future

import torch

from relax_launch.weights.receiver import SHARED_FILE
from relax_launch.weights.sync import TensorSpec, WeightSender
from relax_launch.weights.update_session import Deadline, EngineTarget, WeightSyncError

SHM_DIR = "/dev/shm"


def layout(manifest: list[TensorSpec]) -> tuple[list[tuple[str, str, list[int], int]], int]:
    """(name, dtype, shape, byte offset) of each tensor in the file, and the file's size; each
    tensor starts on a 64-byte boundary."""
    entries, offset = [], 0
    for spec in manifest:
        entries.append((spec.name, spec.dtype, list(spec.shape), offset))
        offset += -(-spec.nbytes // 64) * 64
    return entries, offset


class SharedMemorySender(WeightSender):
    """A stage's sender for engines on its own host: a shared file instead of a broadcast."""

    TRANSPORT = "shared_memory"

    def connect(self, timeout_s: float) -> None:
        """Nothing to join: the file is made on the first send."""
        self.files, self.path = 0, ""
        self.region: torch.Tensor | None = None
        self.entries: list[tuple[str, str, list[int], int]] = []
        self.mapped_by_engines = False

    def _deliver(
        self,
        tensors: Iterable[tuple[str, torch.Tensor]],
        manifest: list[TensorSpec],
        weight_version: int,
        deadline: Deadline,
    ) -> tuple[list[Future], float, float]:
        """Write the export into the file, then ask every engine to load it."""
        views = self._views(manifest)
        sent, export_s, copy_s = [], 0.0, 0.0
        tensors = iter(tensors)
        for spec, view in zip(manifest, views, strict=True):
            began = time.monotonic()
            name, tensor = next(tensors, (None, None))
            export_s += time.monotonic() - began
            if tensor is None or TensorSpec.of(name, tensor) != spec:
                got = None if tensor is None else TensorSpec.of(name, tensor)
                raise WeightSyncError(
                    f"the export does not match the manifest: expected {spec}, "
                    f"the trainer exported {got}"
                )
            began = time.monotonic()
            view.copy_(tensor)
            copy_s += time.monotonic() - began
            self.device = tensor.device
            sent.append((spec.name, view))
        request = self._request(weight_version)
        calls = [
            self.control.submit(
                t.url, "/update_weights_from_tensor", request(t), deadline.left("updating")
            )
            for t in self.targets
        ]
        return calls, export_s, copy_s

    def _views(self, manifest: list[TensorSpec]) -> list[torch.Tensor]:
        entries, size = layout(manifest)
        if self.region is None or entries != self.entries:
            if self.path and not self.mapped_by_engines:
                os.unlink(self.path)
            self.files += 1  # a new name: engines keep files mapped by name
            name = f"relax-launch-{self.group_name}-{os.getpid()}-{self.files}"
            self.path = os.path.join(SHM_DIR, name)
            with open(self.path, "wb") as file:
                file.truncate(size)
            self.region = torch.from_file(self.path, shared=True, size=size, dtype=torch.uint8)
            self.entries, self.mapped_by_engines = entries, False
        return [
            self.region[offset : offset + spec.nbytes].view(getattr(torch, spec.dtype)).view(shape)
            for spec, (_, _, shape, offset) in zip(manifest, self.entries, strict=True)
        ]

    def _request(self, weight_version: int) -> Callable[[EngineTarget], dict]:
        # The engine unpickles each rank's payload (base64 over HTTP): here the file and layout.
        payload = base64.b64encode(pickle.dumps((self.path, self.entries))).decode()

        def body(target: EngineTarget) -> dict:
            return {
                "serialized_named_tensors": [payload] * target.tp_size,  # one per engine rank
                "load_format": SHARED_FILE,
                "weight_version": str(weight_version),
                "flush_cache": True,
            }

        return body

    def _delivered(self) -> None:
        """Every engine answered: each has the file mapped, so its name can go."""
        if not self.mapped_by_engines:
            os.unlink(self.path)
            self.mapped_by_engines = True

    def close(self) -> None:
        if self.region is not None and not self.mapped_by_engines:
            os.unlink(self.path)
        self.region = None
        self.control.close()
