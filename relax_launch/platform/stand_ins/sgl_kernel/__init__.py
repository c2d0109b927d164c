"""Import stand-in for SGLang's CUDA-only kernel package, used only with device cpu.

Every name resolves so SGLang's imports succeed; calling one raises, naming the kernel. On CPUs
without AMX, SGLang's CPU path uses torch-native code and never calls these for Llama models.
"""

__version__ = "0.4.10"


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)

    def _missing(*args, **kwargs):
        raise NotImplementedError(f"sgl_kernel.{name} has no CPU build (relax-launch stand-in)")

    return _missing
