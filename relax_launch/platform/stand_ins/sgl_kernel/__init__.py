"""Import stand-in for SGLang's CUDA-only kernel package, used only with device cpu.

Every name resolves so SGLang's imports succeed; calling one raises, naming the kernel. On CPUs
without AMX, SGLang's CPU path uses torch-native code and never calls these for Llama models.
"""

import torch

__version__ = "0.4.10"

# SGLang CPU kernels that modules bind at import (``torch.ops.sgl_kernel.NAME``, unconditionally
# on the CPU): Qwen3.5's, imported by the Qwen-VL multimodal processor that serves Qwen2.5-VL.
# Defined so those imports succeed; a call raises, naming the kernel.
IMPORT_TIME_CPU_OPS = (
    "fused_sigmoid_mul_cpu",
    "fused_qk_gemma_rmsnorm_cpu",
    "fused_qk_gemma_rmsnorm_with_gate_cpu",
    "fused_qkvzba_split_reshape_cat_contiguous_cpu",
)
_LIBRARY = torch.library.Library("sgl_kernel", "FRAGMENT")


def _no_cpu_build(name: str):
    def kernel(*args, **kwargs):
        raise NotImplementedError(f"sgl_kernel.{name} has no CPU build (relax-launch stand-in)")

    return kernel


for _name in IMPORT_TIME_CPU_OPS:
    if not hasattr(torch.ops.sgl_kernel, _name):
        _LIBRARY.define(f"{_name}(Tensor x) -> Tensor")
        _LIBRARY.impl(_name, _no_cpu_build(_name), "CompositeExplicitAutograd")


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)

    def _missing(*args, **kwargs):
        raise NotImplementedError(f"sgl_kernel.{name} has no CPU build (relax-launch stand-in)")

    return _missing
