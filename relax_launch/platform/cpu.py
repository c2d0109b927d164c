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
    _moe_without_cuda()
    _checkpoint_without_cuda()
    mode = CudaToCpu()
    mode.__enter__()
    return mode


def _checkpoint_without_cuda() -> None:
    """Megatron's activation checkpoint saves and restores the CUDA generator's state around a
    recomputation (with the CPU generator's, which is the one dropout draws from here): there is
    none, so it is nothing (torch would refuse the read, and queue the write forever)."""
    from megatron.core.tensor_parallel import random

    random._get_cuda_rng_state = lambda *args, **kwargs: None
    random._set_cuda_rng_state = lambda *args, **kwargs: None


class _NoStream:
    """A CUDA stream or event that has nothing to order: CPU work runs in program order."""

    def wait_stream(self, *args: Any, **kwargs: Any) -> None: ...

    def synchronize(self) -> None: ...

    def wait(self, *args: Any, **kwargs: Any) -> None: ...

    def record_event(self, *args: Any, **kwargs: Any) -> _NoStream:
        return self


def _moe_without_cuda() -> None:
    """Megatron's MoE layer off the GPU: its router's gating GEMM reads Transformer Engine's
    GEMM, unbound when TE is absent (set it to None, which selects the torch matmul), and the
    all-to-all token dispatcher copies token counts to the host on a side stream, ordered by
    stream waits and events, and as numpy arrays the all-to-all's split sizes (only CUDA
    tensors are converted: CPU ones would reach the collective as tensors, which it refuses)."""
    import contextlib

    from megatron.core.transformer.moe import moe_utils, token_dispatcher
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    if not moe_utils.HAVE_TE:
        moe_utils.te_general_gemm = None

    def to_host(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
        return tensor.numpy() if as_numpy and torch.is_tensor(tensor) else tensor

    token_dispatcher.maybe_move_tensor_to_cpu = to_host
    MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = _NoStream()
    current = _NoStream()
    torch.cuda.current_stream = lambda *args, **kwargs: current
    torch.cuda.stream = lambda *args, **kwargs: contextlib.nullcontext()


PINNING_FACTORIES = (
    "tensor",
    "empty",
    "zeros",
    "ones",
    "full",
    "arange",
    "as_tensor",
    "empty_strided",
    "empty_like",
    "zeros_like",
    "ones_like",
    "full_like",
)


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


def qwen2_moe_shared_gate(hidden: torch.Tensor, gate_weight: torch.Tensor) -> torch.Tensor:
    """Qwen2-MoE's shared-expert gate, sigmoid(h·w) per token, in torch: SGLang runs it as a
    Triton kernel whenever its CPU kernels (AMX) are absent."""
    return torch.sigmoid(hidden @ gate_weight.reshape(-1, 1))


def gated_shared_expert_add(
    hidden: torch.Tensor, gate_weight: Any, shared: torch.Tensor, out: torch.Tensor
) -> None:
    out.add_(qwen2_moe_shared_gate(hidden, gate_weight) * shared)


def gated_shared_expert(hidden: torch.Tensor, gate_weight: Any, shared: torch.Tensor) -> Any:
    return qwen2_moe_shared_gate(hidden, gate_weight) * shared


def no_host_register(buffer: Any, registration_granularity_bytes: Any = None) -> None:
    """Without an accelerator a host buffer needs no cudaHostRegister (SGLang's capture of
    routed experts registers its host cache)."""
