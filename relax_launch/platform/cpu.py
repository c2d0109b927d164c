"""Make Megatron-core run on the CPU: redirect its hard-coded CUDA device uses to the CPU.

Megatron-core 0.16.1 names ``cuda`` in about 226 places (buffers, the RNG tracker, the
optimizer's loss scale, the pipeline schedules). A TorchFunctionMode rewrites ``device=cuda``
arguments and ``Tensor.cuda()`` calls, and gives CPU tensors' ``Tensor.type()`` names as CUDA
ones (Megatron's optimizer checks them: the gradient clip asserts ``torch.cuda.FloatTensor``
grads); a few ``torch.cuda`` functions become no-ops. Imported only when ``cluster.device`` is
``cpu``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.overrides import TorchFunctionMode


def _to_cpu(device: Any) -> Any:
    if isinstance(device, torch.device):
        return torch.device("cpu") if device.type == "cuda" else device
    if isinstance(device, str) and device.startswith("cuda"):
        return "cpu"
    if isinstance(device, int):
        return "cpu"
    return device


class CudaToCpu(TorchFunctionMode):
    """Rewrites CUDA device arguments to the CPU in every torch call made under it."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if "device" in kwargs:
            kwargs["device"] = _to_cpu(kwargs["device"])
        name = getattr(func, "__name__", "")
        if name == "cuda":
            return args[0]
        if name == "type" and len(args) == 1 and not kwargs and args[0].device.type == "cpu":
            return func(*args).replace("torch.", "torch.cuda.", 1)  # e.g. torch.cuda.FloatTensor
        if name == "to" and len(args) > 1 and not isinstance(args[1], torch.dtype | torch.Tensor):
            args = (args[0], _to_cpu(args[1]), *args[2:])
        return func(*args, **kwargs)


def redirect_megatron_to_cpu() -> CudaToCpu:
    """Enter the redirection for the rest of the process; returns the active mode."""
    torch.cuda.current_device = lambda: torch.device("cpu")
    torch.cuda.synchronize = lambda *args, **kwargs: None
    torch.cuda.empty_cache = lambda *args, **kwargs: None
    mode = CudaToCpu()
    mode.__enter__()
    return mode


PINNING_FACTORIES = (
    "tensor", "empty", "zeros", "ones", "full", "arange", "as_tensor", "empty_strided",
    "empty_like", "zeros_like", "ones_like", "full_like",
)  # fmt: skip


def pinned_memory_is_ordinary() -> None:
    """Without an accelerator there is no pinned memory: ``Tensor.pin_memory()`` returns the
    tensor and the factories ignore ``pin_memory=True`` instead of raising (SGLang's LoRA
    serving asks for pinned staging buffers unconditionally). Only the engines that serve a LoRA
    adapter on the CPU run this."""

    def ignoring_pin(factory: Any) -> Any:
        def made(*args: Any, **kwargs: Any) -> Any:
            kwargs.pop("pin_memory", None)
            return factory(*args, **kwargs)

        return made

    torch.Tensor.pin_memory = lambda self, *args, **kwargs: self
    for name in PINNING_FACTORIES:
        setattr(torch, name, ignoring_pin(getattr(torch, name)))
