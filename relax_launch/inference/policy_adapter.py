"""Inside an SGLang engine that serves the LoRA policy as an adapter (``trainer.lora.engines:
adapter``): every request that names no adapter of its own is served by the current policy
adapter, so the controller, the gateway and agents need not know its name.

The weight sync loads each version as ``policy-v{N}`` (``weights/adapter_sync.py``) and then
unloads the one before; the current adapter is the highest version the engine has loaded. A
request may still name an adapter (``lora_path``, or OpenAI's ``model: "<model>:<adapter>"``).
Registered by the project's SGLang plugin (``weights/receiver.py``) in every engine process when
``POLICY_ADAPTER_ENV`` is set, which ``SGLangServer`` does for these engines only.
"""

from __future__ import annotations

import os
import re
from typing import Any

from relax_launch import platform

POLICY_ADAPTER_ENV = "RELAX_POLICY_ADAPTER"
POLICY_PREFIX = "policy-v"
TOKENIZER_MANAGER = "sglang.srt.managers.tokenizer_manager.TokenizerManager"
_VERSION = re.compile(re.escape(POLICY_PREFIX) + r"(\d+)$")


def adapter_name(weight_version: int) -> str:
    return f"{POLICY_PREFIX}{weight_version}"


def register() -> None:
    """Plugin part: the default adapter on every request, and on a CPU engine pinned memory
    as ordinary memory (SGLang's LoRA code asks for pinned buffers unconditionally)."""
    if not os.environ.get(POLICY_ADAPTER_ENV):
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(f"{TOKENIZER_MANAGER}.generate_request", default_adapter, HookType.BEFORE)
    platform.pinned_memory_without_accelerator()


def current_adapter(manager: Any) -> str | None:
    """The highest policy version among the adapters this engine has loaded."""
    versions = [
        (int(match.group(1)), name)
        for name in manager.lora_ref_cache
        if (match := _VERSION.match(name))
    ]
    return max(versions)[1] if versions else None


def default_adapter(manager: Any, obj: Any, *args: Any, **kwargs: Any) -> None:
    """Before a request is normalised: no adapter named -> the current policy adapter."""
    if getattr(manager, "enable_lora", False) and getattr(obj, "lora_path", None) is None:
        obj.lora_path = current_adapter(manager)
