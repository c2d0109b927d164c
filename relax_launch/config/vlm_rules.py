"""The rules of a job whose policy is a vision-language model (Qwen2.5-VL, docs/vlm.md): what
its RL step runs today (one-turn rollouts with images on decoupled engines, padded
micro-batches, the whole model or the language model alone trained and synced) and, naming the
field, what is not built yet. A text policy refuses the fields and data that need images."""

from __future__ import annotations

from typing import TYPE_CHECKING

from relax_launch.models.registry import is_vision_language

if TYPE_CHECKING:
    from relax_launch.config.job import JobConfig

VISUAL_DATASETS = ("builtin:shape_counting",)
NOT_YET = "is not built for a vision-language trainer.model yet (docs/vlm.md)"


def vision_language_problems(job: JobConfig) -> list[str]:
    """A vision-language policy against the sections it cannot use yet; a text policy against
    the vision fields and data."""
    t = job.trainer
    if not is_vision_language(t.model):
        problems = []
        if t.freeze_vision:
            problems.append(
                f"trainer.freeze_vision acts on a vision-language trainer.model; "
                f"{t.model} is not one: remove it."
            )
        sections = [("data", job.data)] + ([("eval.data", job.eval.data)] if job.eval else [])
        problems += [
            f"{field}.dataset={data.dataset} shows images: it needs a vision-language "
            "trainer.model (builtin:tiny-qwen2.5-vl, or a Qwen2.5-VL directory)."
            for field, data in sections
            if data.dataset in VISUAL_DATASETS
        ]
        return problems
    return _unbuilt_problems(job) + _engine_problems(job)


def _unbuilt_problems(job: JobConfig) -> list[str]:
    t, a, r = job.trainer, job.algorithm, job.rollout
    unbuilt = {
        "trainer.lora": t.lora is not None,
        "trainer.pack_sequences": t.pack_sequences,
        "trainer.pp_size > 1": t.pp_size > 1,
        "trainer.cp_size > 1": t.cp_size > 1,
        f"placement.mode={job.placement.mode}": job.placement.mode != "decoupled",
        "rollout.function (agentic turns)": r.function is not None,
        "rollout.environment": r.environment is not None,
        "rollout.prefill (prefill/decode disaggregation)": r.prefill is not None,
        "a teacher section": job.teacher is not None,
        "a genrm section": job.genrm is not None,
        "a critic section": job.critic is not None,
        "an eval section": job.eval is not None,
        "algorithm.max_staleness (fully asynchronous rollout)": bool(a.max_staleness),
    }
    fixes = {
        "trainer.lora": "train every weight (remove trainer.lora); trainer.freeze_vision keeps "
        "the vision tower as loaded",
        "trainer.pack_sequences": "set it to false (padded micro-batches)",
    }
    return [
        f"{field} {NOT_YET}: {fixes.get(field, 'remove it, or train a text model')}."
        for field, set_ in unbuilt.items()
        if set_
    ]


def _engine_problems(job: JobConfig) -> list[str]:
    """The engine reads images with the trainer's PIL image processor, on every device: the
    trainer's pixel values must equal the engine's (SGLang's GPU default is another backend;
    its CPU engine has only PIL, torchvision's needing the real torchvision)."""
    backend = job.rollout.engine.get("image_processor_backend")
    if backend != "pil":
        return [
            "rollout.engine.image_processor_backend: set it to pil for a vision-language "
            "policy: the trainer's pixel values (PIL image processor) must equal the "
            "engine's, and SGLang's default backend differs (the CPU engine has only pil)."
        ]
    return []
