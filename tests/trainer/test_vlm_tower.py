"""The trainer's Qwen2.5-VL vision tower given its ``VisionLayout`` (computed from the grids on
the CPU): the same features and gradients as transformers' tower given only the grids, bit for
bit, and no read of a device tensor's values on the host in its forward (transformers' own call
reads the grids back several times, and each block its attention bounds).

"On the device" is simulated on the CPU: the tower's inputs are ``OnDevice`` tensors, whose
every derived tensor is one too, and reading their values on the host (``.tolist()``,
``.item()``, ``int()``, ops whose output size depends on values, indexing with a host tensor,
which copies it over and waits) raises ``HostSync``. Limits: it sees the Python-level torch
calls of the forward only (not the backward, nor a sync inside a kernel), and a tensor the code
builds on the host and copies to the device by ``torch.tensor(..., device=)`` is not flagged
unless it indexes a device tensor. ``torch.cuda.set_sync_debug_mode("error")`` is the GPU's
own check."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from relax_launch.models.build import ensure_model
from relax_launch.trainer.vlm_model import (
    VisionLanguageModel,
    read_vl_shape,
    vision_config,
    vision_layout,
)

# several images of different grids (t, h, w patches), one of two frames; the tiny model's
# windows are 4x4 patches, so some are cut by the images' edges
GRIDS = torch.tensor([[1, 6, 6], [1, 4, 10], [2, 6, 4], [1, 2, 2]])
HOST_READS = {
    "item", "tolist", "numpy", "cpu", "__bool__", "__int__", "__index__", "__float__",
    "nonzero", "argwhere", "unique", "unique_consecutive", "masked_select",
}  # fmt: skip


class HostSync(AssertionError):
    pass


class OnDevice(torch.Tensor):
    """A CPU tensor standing for a device-resident one (module docstring)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        if name in HOST_READS or _waits(name, args, kwargs):
            raise HostSync(name)
        return super().__torch_function__(func, types, args, kwargs)


def _waits(name: str, args: tuple, kwargs: dict[str, Any]) -> bool:
    """Whether ``name`` on these arguments waits for the device: indexing with a host tensor
    (copied over first) or a mask, or ``repeat_interleave`` by device counts."""
    if name == "__getitem__":
        index = args[1] if isinstance(args[1], tuple) else (args[1],)
        tensors = [i for i in index if isinstance(i, torch.Tensor)]
        return any(not isinstance(i, OnDevice) or i.dtype == torch.bool for i in tensors)
    if name == "repeat_interleave":
        repeats = args[1] if len(args) > 1 else kwargs.get("repeats")
        return isinstance(repeats, torch.Tensor) and "output_size" not in kwargs
    return False


def on_device(tensor: torch.Tensor) -> OnDevice:
    return tensor.as_subclass(OnDevice)


@pytest.fixture(scope="module")
def model() -> VisionLanguageModel:
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
        Qwen2_5_VisionTransformerPretrainedModel,
    )

    shape = read_vl_shape(ensure_model("builtin:tiny-qwen2.5-vl"))
    torch.manual_seed(0)
    vision = Qwen2_5_VisionTransformerPretrainedModel._from_config(
        vision_config(shape), attn_implementation="sdpa", dtype=torch.float32
    )
    language = SimpleNamespace(config=None, model_type="gpt")  # the tower's tests need none
    return VisionLanguageModel(language, vision, shape)


def patches(model: VisionLanguageModel) -> torch.Tensor:
    config = model.vision.config
    size = config.in_channels * config.temporal_patch_size * config.patch_size**2
    return torch.randn(int(GRIDS.prod(-1).sum()), size, generator=torch.Generator().manual_seed(1))


def test_the_layout_gives_transformers_features_and_gradients_bit_exact(model):
    pixels = patches(model)
    layout = vision_layout(GRIDS, model.shape)
    assert len(layout.cu_window_seqlens) > len(layout.cu_seqlens) > len(GRIDS)  # windows cut
    model.vision.zero_grad()
    ours = model.image_features(pixels, GRIDS, layout)
    ours.square().sum().backward()
    our_grads = [p.grad.clone() for p in model.vision.parameters()]
    model.vision.zero_grad()
    theirs = model.vision(pixels, grid_thw=GRIDS).pooler_output
    theirs.square().sum().backward()
    assert ours.shape == (int(GRIDS.prod(-1).sum()) // 4, 64)
    assert torch.equal(ours, theirs)
    assert all(
        torch.equal(p.grad, g) for p, g in zip(model.vision.parameters(), our_grads, strict=True)
    )


def test_the_tower_given_the_layout_reads_nothing_back_from_the_device(model):
    pixels, grids = on_device(patches(model)), on_device(GRIDS)
    layout = vision_layout(GRIDS, model.shape)  # on the host, as the micro-batches build it
    # as VisionLayout.to(device): the bounds stay on the host
    layout = replace(
        layout,
        position_ids=on_device(layout.position_ids),
        window_index=on_device(layout.window_index),
    )
    with torch.no_grad():
        features = model.image_features(pixels, grids, layout)
        assert isinstance(features, OnDevice)
        # transformers' call reads the device grids back (what this test guards against)
        with pytest.raises(HostSync):
            model.vision(pixels, grid_thw=grids)
        with pytest.raises(HostSync):  # and so does the forward without a layout
            model.image_features(pixels, grids, None)
