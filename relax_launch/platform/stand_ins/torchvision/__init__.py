"""Import stand-in for torchvision, used only with device cpu.

PyPI's torchvision does not load beside the CPU torch wheel, and SGLang imports it at config
time for multimodal models, and transformers' auto classes import its video processors (type
hints ``X | InterpolationMode``). Images go through the PIL image processors; any use raises.
"""

import importlib.abc
import importlib.machinery
import sys
import types
import typing

__version__ = "0.28.0"  # transformers parses this


class _Missing:
    def __init__(self, *args, **kwargs):
        pass

    def __call__(self, *args, **kwargs):
        raise NotImplementedError("torchvision is not available (relax-launch CPU stand-in)")

    def __getattr__(self, name):
        return _Missing()

    def __mro_entries__(self, bases):
        return (object,)

    def __or__(self, other):  # in a type hint, ``PILImageResampling | InterpolationMode``
        return typing.Any

    __ror__ = __or__


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    return _Missing()


class _SubmoduleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path, target=None):
        if fullname.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__getattr__ = __getattr__
        return module

    def exec_module(self, module):
        pass


sys.meta_path.insert(0, _SubmoduleFinder())
