"""The memory plan of a vision-language policy (Qwen2.5-VL): its size read from the config
(language model, vision tower, merger), the trainer's terms (the tower resident, trained or
frozen; its activations over a micro-batch's image patches; the pixel values) and the engine's
(SGLang's multimodal cache and the image encoder's headroom)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from relax_launch.config import ConfigError, load_config
from relax_launch.models.build import ensure_model
from relax_launch.models.sizes import model_size
from relax_launch.models.vision_sizes import QWEN2_5_VL_7B, VisionSize
from relax_launch.placement import plan
from relax_launch.placement.memory import RUNTIME_BYTES
from relax_launch.placement.memory_plan import check_memory, memory_plan
from relax_launch.placement.vision_memory import VLM_CACHE_BYTES, TowerActivations

REPO = Path(__file__).resolve().parents[2]
TINY_JOB = REPO / "tests" / "rl" / "vlm_tiny.yaml"
GPU_CONFIG = REPO / "configs" / "qwen2_5_vl_7b_decoupled_8gpu.yaml"


def numel(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def holder_terms(job, role: str, rank: int) -> dict[str, float]:
    memory = memory_plan(job, plan(job))
    device = next(d for d in memory.devices if d.rank == rank)
    holder = next(h for h in device.holders if h.role.startswith(role))
    return {t.name: t.bytes for t in holder.terms if not t.host}


def test_the_tiny_vlm_size_is_transformers_parameter_count():
    from transformers import AutoConfig, Qwen2_5_VLForConditionalGeneration

    directory = ensure_model("builtin:tiny-qwen2.5-vl")
    with torch.device("meta"):
        model = Qwen2_5_VLForConditionalGeneration(AutoConfig.from_pretrained(directory))
    for ref in ("builtin:tiny-qwen2.5-vl", str(directory)):
        size = model_size(ref)
        assert size.total_params == numel(model), ref
        assert size.vision_params == numel(model.model.visual), ref
        assert size.vision.max_pixels == 112 * 112  # preprocessor_config.json's longest_edge


def test_qwen2_5_vl_7b_size_is_transformers_count_and_the_published_8_29b():
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    size = model_size("/models/Qwen2.5-VL-7B-Instruct")  # absent here: its published config
    config = Qwen2_5_VLConfig(**{k: v for k, v in QWEN2_5_VL_7B.items() if k != "max_pixels"})
    with torch.device("meta"):
        model = Qwen2_5_VLForConditionalGeneration(config)
    assert size.total_params == numel(model) == 8_292_166_656
    assert size.vision_params == numel(model.model.visual) == 676_550_144
    assert abs(size.total_params / 8.29e9 - 1) < 0.01  # the model page's "8.29B params"
    assert size.qkv_bias and not size.tied_embeddings and size.vision.max_pixels == 12845056


def test_hub_and_transformers_5_layouts_read_alike(tmp_path):
    """The hub's config.json has the language model's fields at the top level, transformers 5
    writes them under text_config; the processor's max_pixels is a key or size.longest_edge."""
    flat = {k: v for k, v in QWEN2_5_VL_7B.items() if k != "max_pixels"}
    text = {k: flat.pop(k) for k in ("num_hidden_layers", "hidden_size", "vocab_size")}
    nested = {**flat, "text_config": text}
    for name, cfg, processor in (
        ("hub", {**flat, **text}, {"max_pixels": 50176}),
        ("tf5", nested, {"size": {"longest_edge": 50176, "shortest_edge": 3136}}),
    ):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(cfg))
        (tmp_path / name / "preprocessor_config.json").write_text(json.dumps(processor))
    hub, tf5 = model_size(str(tmp_path / "hub")), model_size(str(tmp_path / "tf5"))
    assert hub.total_params == tf5.total_params == 8_292_166_656
    assert hub.vision == tf5.vision and hub.vision.max_pixels == 50176
    assert hub.vision.image_tokens(10**8) == 64  # 224 x 224 at most: 8 x 8 tokens


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tower_activations_are_what_autograd_saves(dtype):
    """Every tensor the tower's forward saves for its backward pass (by storage, parameters
    aside), on two images of 8 x 16 patches (window and full attention blocks), against the plan's
    bytes per patch: under fp32 the patch embedding keeps the pixel values themselves (the
    plan's own term), under bf16 its copy of them."""
    from transformers import Qwen2_5_VLConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
        Qwen2_5_VisionTransformerPretrainedModel,
    )

    dims = {"depth": 4, "hidden_size": 128, "intermediate_size": 256, "num_heads": 2}
    vision = VisionSize(**dims, out_hidden_size=128)
    config = Qwen2_5_VLConfig(
        vision_config={**dims, "out_hidden_size": 128, "window_size": 112}
    ).vision_config
    config.fullatt_block_indexes = [3]
    torch.manual_seed(0)
    tower = Qwen2_5_VisionTransformerPretrainedModel._from_config(
        config, attn_implementation="sdpa", dtype=dtype
    )
    weights = {p.untyped_storage().data_ptr() for p in tower.parameters()}
    grids = torch.tensor([[1, 8, 16], [1, 16, 8]])
    pixels = torch.randn(256, vision.patch_values)
    saved: dict[int, int] = {}

    def keep(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in weights:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        tower(pixels, grid_thw=grids)
    b = 4 if dtype == torch.float32 else 2
    planned = 256 * TowerActivations(vision, b).per_patch()
    planned += pixels.nbytes if b == 4 else 256 * vision.patch_values * b
    assert sum(saved.values()) == pytest.approx(planned, rel=0.01)


def test_the_tiny_vlm_job_plans_its_tower_pixels_and_the_engine_cache():
    job = load_config(TINY_JOB)
    size = model_size(job.trainer.model)
    trainer = holder_terms(job, "trainer", 0)
    # float32, one rank: the whole model (but the final norm's 64: memory.stage_params), its
    # gradients and Adam's two moments
    whole = size.total_params - size.hidden_size
    assert trainer["parameters"] == trainer["gradients"] == whole * 4
    assert trainer["optimizer state"] == whole * 8
    # one 84 x 84 image a sequence: 9 tokens of 4 patches; the step's 8 sequences' pixels on the
    # device, 2 sequences a micro-batch through the tower
    assert trainer["pixel values"] == 8 * 9 * 4 * 1176 * 4
    # the tower's blocks and the patch embedding's input (a joined copy unless a view)
    per_patch = TowerActivations(size.vision, 4).per_patch() + 1176 * 4
    assert trainer["vision activations"] == 2 * 9 * 4 * per_patch
    engine = holder_terms(job, "rollout", 1)
    assert engine["weights"] == size.total_params * 4  # the tower too
    assert engine["multimodal cache"] == VLM_CACHE_BYTES
    assert engine["runtime"] == RUNTIME_BYTES[("cpu", "engine")]


def test_a_frozen_tower_is_resident_without_gradients_optimizer_or_activations():
    trained = holder_terms(load_config(TINY_JOB), "trainer", 0)
    job = load_config(TINY_JOB, ["trainer.freeze_vision=true"])
    frozen, vision = holder_terms(job, "trainer", 0), model_size(job.trainer.model).vision_params
    assert frozen["parameters"] == trained["parameters"]
    assert frozen["gradients"] == trained["gradients"] - 4 * vision
    assert frozen["optimizer state"] == trained["optimizer state"] - 8 * vision
    assert "vision activations" not in frozen
    assert frozen["pixel values"] == trained["pixel values"]


def test_pixel_values_are_planned_once_in_the_trainer_dtype():
    """The shard's pixel values travel in the trainer's dtype (the tower casts them to it) and
    are held once (the micro-batches are views of the received buffer)."""
    fp32 = holder_terms(load_config(TINY_JOB), "trainer", 0)
    job = load_config(TINY_JOB, ["trainer.dtype=bfloat16"])
    assert holder_terms(job, "trainer", 0)["pixel values"] == fp32["pixel values"] / 2


def test_a_dataset_s_images_may_fill_every_prompt_token():
    job = load_config(TINY_JOB, ["data.dataset=/data/rows.parquet"])
    trainer = holder_terms(job, "trainer", 0)
    assert trainer["pixel values"] == 8 * 128 * 4 * 1176 * 4  # 8 sequences x 128 tokens


def test_the_7b_engine_leaves_sglang_s_vlm_headroom_and_the_plan_fits():
    """SGLang's default mem_fraction_static for Qwen2.5-VL-7B is its text default x 0.95 x
    (1 - 0.1 x (1280² / 1024² - 1)); the KV pool is what that leaves less the multimodal
    cache; the GPU example fits an 80 GB H100."""
    job = load_config(GPU_CONFIG)
    memory = memory_plan(job, plan(job))
    check_memory(job, memory)
    engine = holder_terms(job, "rollout", 4)
    factor = 0.95 * (1 - 0.1 * (1280**2 / 1024**2 - 1))
    text_fraction = round((memory.capacity - engine["workspace"]) / memory.capacity, 3)
    assert memory.fraction_of("rollout engine 0") == pytest.approx(text_fraction * factor)
    assert engine["encoder workspace"] == pytest.approx(
        text_fraction * (1 - factor) * memory.capacity
    )
    assert engine["multimodal cache"] == VLM_CACHE_BYTES
    assert sum(engine.values()) <= memory.capacity * 1.001
    trainer = holder_terms(job, "trainer", 0)
    assert trainer["vision activations"] > 5e9  # 4096 patches through 32 blocks of 1280


def test_a_tower_that_does_not_fit_is_refused_naming_freeze_vision():
    job = load_config(GPU_CONFIG, ["trainer.micro_batch_size=8"])
    with pytest.raises(ConfigError) as refused:
        check_memory(job, memory_plan(job, plan(job)))
    message = str(refused.value)
    assert "largest: trainer vision activations 69.6 GB" in message
    assert "Try trainer.freeze_vision=true; a smaller trainer.micro_batch_size" in message
