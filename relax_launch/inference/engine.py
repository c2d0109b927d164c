"""EngineHandle: rank 0's handle on one SGLang engine (its head's HTTP server).

Every control operation on an engine goes through ``call``, which refuses a weight mutation or
LoRA operation on a STATIC model (teacher, genrm) before any network I/O.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from relax_launch.weights.engine_client import EngineRequestError, get_json, post

MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")

# SGLang routes that change what a model computes; a STATIC model refuses all of them.
WEIGHT_MUTATIONS = frozenset(
    {
        "init_weights_update_group",
        "destroy_weights_update_group",
        "begin_weight_update",
        "end_weight_update",
        "update_weights_from_distributed",
        "update_weights_from_tensor",
        "update_weights_from_disk",
        "update_weights_from_ipc",
        "update_weight_version",
        "init_weights_send_group_for_remote_instance",
        "send_weights_to_remote_instance",
        "load_lora_adapter",
        "load_lora_adapter_from_tensors",
        "unload_lora_adapter",
    }
)


class StaticModelError(RuntimeError):
    """A weight or LoRA operation was asked of a static model; nothing was sent."""


@dataclass
class EngineHandle:
    """One logical engine; ``loaded`` tracks which memory tags it holds, as last confirmed."""

    engine_id: str
    url: str
    role: str
    static: bool
    timeout_s: float = 60.0
    generation: int = 1
    loaded: set[str] = field(default_factory=lambda: set(MEMORY_TAGS))
    history: deque = field(default_factory=lambda: deque(maxlen=64))

    def require_mutable(self, op: str) -> None:
        if self.static and op in WEIGHT_MUTATIONS:
            raise StaticModelError(
                f"{self.role} engine {self.engine_id} serves a STATIC model and refuses {op!r}; "
                "only the rollout policy takes weight or LoRA updates"
            )

    def call(self, op: str, body: dict[str, Any] | None = None, timeout_s: float | None = None):
        """POST ``/op`` to the engine; raises ``EngineRequestError`` naming the engine."""
        self.require_mutable(op)
        started = time.monotonic()
        try:
            reply = post(self.url, "/" + op, body, timeout_s or self.timeout_s)
        except EngineRequestError as exc:
            self.history.append((op, "error", round(time.monotonic() - started, 3)))
            raise EngineRequestError(f"{self.role} engine {self.engine_id}: {exc}") from None
        self.history.append((op, "ok", round(time.monotonic() - started, 3)))
        return reply

    def info(self, path: str = "/model_info") -> dict[str, Any]:
        return get_json(self.url, path, self.timeout_s)

    def weight_version(self) -> str:
        return str(self.info()["weight_version"])

    @property
    def complete(self) -> bool:
        return self.loaded >= set(MEMORY_TAGS)
