"""A vision-language policy's teacher and judge at config time (config/vlm_scorer_rules.py): a
text teacher, a teacher reading images with another processor, a teacher of agentic
conversations and a vision-language judge without the CPU's image processor are refused naming
the field; a vision-language teacher and judges of either kind are accepted."""

from __future__ import annotations

import pytest

from relax_launch.config import ConfigError, build_config

ENGINE = {"max_total_tokens": 2048, "image_processor_backend": "pil"}
VLM = "builtin:tiny-qwen2.5-vl"
BASE = {
    "cluster": {"nnodes": 1, "nproc_per_node": 4, "device": "cpu"},
    "trainer": {"model": VLM, "ranks": 1},
    "rollout": {"ranks": 1, "engine": ENGINE},
    "data": {"dataset": "builtin:shape_counting"},
    "algorithm": {"n_samples_per_prompt": 4},
}
TEACHER = [f"teacher={{model: '{VLM}', ranks: 1, engine: {ENGINE}}}", "algorithm.distill_coef=1.0"]
JUDGE = ["reward.sources=[{name: judge, genrm: true}]"]


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        (
            [*TEACHER, "teacher.model=builtin:tiny-llama"],
            ["teacher.model=builtin:tiny-llama is a text model", "vision-language teacher"],
        ),
        (
            [*TEACHER, "teacher.models=[{model: 'builtin:tiny-qwen2', route_keys: [b]}]"],
            ["teacher.models[0].model=builtin:tiny-qwen2 is a text model"],
        ),
        (
            [*TEACHER, "teacher.engine.image_processor_backend=torchvision"],
            ["teacher.engine.image_processor_backend: set it to pil", "trainer's pixel values"],
        ),
        (
            [*TEACHER, "rollout.function=builtin:calculator"],
            ["a teacher section with rollout.function", "remove the teacher or rollout.function"],
        ),
        (
            [*JUDGE, f"genrm={{model: '{VLM}', ranks: 1, engine: {{max_total_tokens: 2048}}}}"],
            ["genrm.engine.image_processor_backend: set it to pil", "on the CPU"],
        ),
    ],
)
def test_a_vlm_policys_scorers_are_refused_naming_the_field(overrides, words):
    with pytest.raises(ConfigError) as refused:
        build_config(BASE, overrides)
    assert all(w in str(refused.value) for w in words), str(refused.value)


def test_a_vlm_teacher_and_judges_of_either_kind_are_accepted():
    assert build_config(BASE, TEACHER).teacher.model == VLM
    for judge in (
        f"{{model: '{VLM}', ranks: 1, engine: {ENGINE}}}",
        "{model: 'builtin:tiny-llama'}",
    ):
        build_config(BASE, [*JUDGE, f"genrm={judge}", "genrm.engine.max_total_tokens=2048"])
