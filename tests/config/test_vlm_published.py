"""A vision-language model planned away from its files (configs/qwen2_5_vl_7b_decoupled_8gpu.yaml:
/models/Qwen2.5-VL-7B-Instruct has no config.json here) is one by its published config.json for
the vision-language rules too (config/vlm_rules.py), as it is for the memory plan
(models/sizes.py): freeze_vision is accepted, what the VLM trainer does not build is refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from relax_launch.config import ConfigError, load_config
from relax_launch.models.registry import is_vision_language
from relax_launch.models.sizes import model_size

YAML = Path(__file__).resolve().parents[2] / "configs" / "qwen2_5_vl_7b_decoupled_8gpu.yaml"


def test_a_published_vlm_without_its_files_is_one_for_rules_and_sizes(tmp_path):
    ref = str(tmp_path / "Qwen2.5-VL-7B-Instruct")  # no config.json there
    assert is_vision_language(ref) and model_size(ref).vision is not None
    assert not is_vision_language(str(tmp_path / "Qwen3-8B"))
    assert not is_vision_language(str(tmp_path / "unknown"))


def test_the_7b_yaml_accepts_freeze_vision():
    assert not (Path(load_config(YAML).trainer.model) / "config.json").exists()
    assert load_config(YAML, ["trainer.freeze_vision=true"]).trainer.freeze_vision


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        (["trainer.pp_size=2"], "trainer.pp_size > 1 is not built for a vision-language"),
        (["rollout.engine.image_processor_backend=null"], "image_processor_backend: set it"),
        (
            ["trainer.lora.rank=8", "trainer.lora.engines=adapter"],
            "trainer.lora.engines=adapter is not built for a vision-language",
        ),
    ],
)
def test_the_7b_yaml_refuses_what_the_vlm_trainer_does_not_build(overrides, words):
    assert load_config(YAML).rollout.engine["image_processor_backend"] == "pil"  # as shipped
    with pytest.raises(ConfigError, match=words.replace(">", ".")):
        load_config(YAML, overrides)
