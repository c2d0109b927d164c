"""Qwen2.5-VL's conversion and inputs, without Megatron-core: the HF -> trainer shards -> HF
round trip, the multimodal RoPE positions against transformers', image placeholders expanded
as the processor does, and refusals."""

from __future__ import annotations

import json

import pytest
import torch
from PIL import Image

from relax_launch.models.build import ensure_model
from relax_launch.models.vlm_processor import VisionProcessor
from relax_launch.trainer.hf_dir import read_weights
from relax_launch.trainer.vlm_conversion import (
    VLShape,
    check_vlm_checkpoint,
    checkpoint_names,
    split_parts,
    vlm_hf_to_megatron,
    vlm_megatron_to_hf,
    vlm_tp_split_dim,
)
from relax_launch.trainer.vlm_model import mrope_positions

MODEL = "builtin:tiny-qwen2.5-vl"


@pytest.fixture(scope="module")
def tiny_vl():
    path = ensure_model(MODEL)
    return path, VLShape.from_hf_config(json.loads((path / "config.json").read_text()))


def two_image_prompt(processor: VisionProcessor):
    content = [
        {"type": "image"},
        {"type": "text", "text": "How many red circles? And here:"},
        {"type": "image"},
    ]
    images = [Image.new("RGB", (84, 56), "red"), Image.new("RGB", (56, 112), "blue")]
    return processor.encode_chat([{"role": "user", "content": content}], images)


@pytest.mark.parametrize("tp_size", [1, 2])
def test_hf_to_trainer_shards_and_back_is_bit_exact(tiny_vl, tp_size):
    path, shape = tiny_vl
    hf = checkpoint_names(read_weights(path))
    shards = [vlm_hf_to_megatron(hf, shape, tp_rank=r, tp_size=tp_size) for r in range(tp_size)]
    back = {}
    for name in shards[0]:
        dim = vlm_tp_split_dim(name)
        full = shards[0][name] if dim is None else torch.cat([s[name] for s in shards], dim)
        back |= dict(vlm_megatron_to_hf(name, full, shape, tp_size=tp_size))
    assert set(back) == set(hf)
    assert [n for n in hf if not torch.equal(back[n], hf[n])] == []
    assert any(n.startswith("visual.") for n in back)  # the vision tower went through too


def test_transformers_in_memory_names_are_read_as_the_checkpoints(tiny_vl):
    path, _ = tiny_vl
    hf = read_weights(path)
    renamed = {
        k.replace("model.", "model.language_model.", 1).replace("visual.", "model.visual.", 1): v
        for k, v in hf.items()
    }
    assert checkpoint_names(renamed).keys() == hf.keys()


def test_mrope_positions_equal_transformers_get_rope_index(tiny_vl):
    from transformers import Qwen2_5_VLForConditionalGeneration

    path, shape = tiny_vl
    prompt = two_image_prompt(VisionProcessor(path))
    ids = torch.tensor([prompt.ids])
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(path, dtype=torch.float32)
    theirs, _ = model.model.get_rope_index(
        ids,
        mm_token_type_ids=(ids == shape.image_token_id).int(),
        image_grid_thw=prompt.image_grid_thw,
    )
    ours = mrope_positions(ids[0], prompt.image_grid_thw, shape)
    assert torch.equal(ours, theirs[:, 0])
    assert not torch.equal(ours[0], ours[1])  # the images' height/width positions differ


def test_each_image_placeholder_becomes_one_token_per_merged_patch(tiny_vl):
    path, shape = tiny_vl
    prompt = two_image_prompt(VisionProcessor(path))
    grids = prompt.image_grid_thw.tolist()
    assert grids == [[1, 4, 6], [1, 8, 4]]  # 56 x 84 and 112 x 56 pixels in 14-pixel patches
    assert prompt.ids.count(shape.image_token_id) == (24 + 32) // 4
    assert prompt.pixel_values.shape[0] == 24 + 32


def test_a_checkpoint_without_a_vision_tensor_is_refused(tiny_vl):
    path, shape = tiny_vl
    hf = read_weights(path)
    _, vision = split_parts(hf)
    del hf["visual.merger.mlp.0.bias"]
    with pytest.raises(ValueError, match=r"missing \['merger.mlp.0.bias'\]"):
        check_vlm_checkpoint(hf, shape, set(vision))


def test_an_mrope_section_that_does_not_cover_the_rotary_dimension_is_refused(tiny_vl):
    path, _ = tiny_vl
    cfg = json.loads((path / "config.json").read_text())
    text = cfg.get("text_config") or cfg
    (text.get("rope_parameters") or text["rope_scaling"])["mrope_section"] = [2, 2, 2]
    with pytest.raises(ValueError, match="mrope_section"):
        VLShape.from_hf_config(cfg)
