"""The teacher and the judge of a vision-language policy (docs/vlm.md "Teacher and judge"):
the teacher scores the policy's own token ids with the prompt's images, so each of its models
must be vision-language (a text model would read the image placeholders as text) and read
images with the trainer's PIL image processor, as the rollout engines do; a vision-language
judge is shown the images (on the CPU SGLang has only the PIL image processor), a text judge
the text alone."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from relax_launch.models.registry import is_vision_language, model_facts

if TYPE_CHECKING:
    from relax_launch.config.job import JobConfig
    from relax_launch.inference.config import InferenceRoleConfig


def role_models(name: str, role: InferenceRoleConfig) -> Iterator[tuple[str, InferenceRoleConfig]]:
    """(field prefix, section) of each model of role ``name``: ``name`` for its default model,
    ``name.models[i]`` for the further ones (their engine arguments over the role's)."""
    prefixes = [name] + [f"{name}.models[{i}]" for i in range(len(role.models))]
    yield from zip(prefixes, role.model_sections(), strict=True)


def scorer_problems(job: JobConfig) -> list[str]:
    """A vision-language policy's teacher and judge models against what scoring images needs."""
    problems = []
    if job.teacher is not None:
        if job.rollout.function is not None:
            problems.append(
                "a teacher section with rollout.function on a vision-language trainer.model: the "
                "teacher scores a prompt's images, not those a conversation's tools return; "
                "remove the teacher or rollout.function."
            )
        for prefix, section in role_models("teacher", job.teacher):
            problems += _teacher_problems(prefix, section)
    if job.genrm is not None and job.cluster.device == "cpu":
        problems += [
            f"{prefix}.engine.image_processor_backend: set it to pil for the vision-language "
            f"judge {section.model} on the CPU (SGLang's CPU engine has only the PIL image "
            "processor)."
            for prefix, section in role_models("genrm", job.genrm)
            if is_vision_language(section.model) and not _reads_with_pil(section)
        ]
    return problems


def _teacher_problems(prefix: str, section: InferenceRoleConfig) -> list[str]:
    facts = model_facts(section.model)
    if facts is not None and not is_vision_language(section.model):
        return [
            f"{prefix}.model={section.model} is a text model: a vision-language policy's "
            "teacher scores the policy's token ids with the prompt's images (each image's "
            "placeholder expanded to its patches), which a text model reads as text; choose a "
            "vision-language teacher with the policy's tokenizer and processor "
            "(builtin:tiny-qwen2.5-vl, or a Qwen2.5-VL directory)."
        ]
    if not _reads_with_pil(section):
        return [
            f"{prefix}.engine.image_processor_backend: set it to pil for a vision-language "
            "policy's teacher: it must read the images into the trainer's pixel values, as the "
            "rollout engines do (SGLang's default backend differs; the CPU engine has only pil)."
        ]
    return []


def _reads_with_pil(section: InferenceRoleConfig) -> bool:
    return section.engine.get("image_processor_backend") == "pil"
