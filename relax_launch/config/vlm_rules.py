"""The rules of a job whose policy is a vision-language model (Qwen2.5-VL, docs/vlm.md): what
its RL step runs today (one-turn and agentic rollouts with images on decoupled or colocated
engines, fully asynchronous too, eval prompts with images, padded or
packed micro-batches, the whole model, the language model alone or LoRA on it trained and synced)
and, naming the field, what is not built yet. A text policy refuses the fields and data that
need images."""

from __future__ import annotations

from typing import TYPE_CHECKING

from relax_launch.config.vlm_scorer_rules import scorer_problems
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
    return (
        _unbuilt_problems(job) + _lora_problems(job) + _engine_problems(job) + scorer_problems(job)
    )


def _unbuilt_problems(job: JobConfig) -> list[str]:
    t, r = job.trainer, job.rollout
    unbuilt = {
        "trainer.lora.engines=adapter": t.lora is not None and t.lora.engines == "adapter",
        "trainer.pp_size > 1": t.pp_size > 1,
        "trainer.cp_size > 1": t.cp_size > 1,
        # one row per turn would need each turn's images on its own row (rl/agent_vision.py)
        "rollout.multi_turn=per_turn": r.function is not None and r.multi_turn == "per_turn",
        "rollout.environment": r.environment is not None,
        "rollout.prefill (prefill/decode disaggregation)": r.prefill is not None,
        "a critic section": job.critic is not None,
    }
    fixes = {
        "trainer.lora.engines=adapter": "use trainer.lora.engines=merged (the engines get the "
        "language model's targeted weights merged at each sync)",
        "rollout.multi_turn=per_turn": "use rollout.multi_turn: continue_tokens or strict",
    }
    return [
        f"{field} {NOT_YET}: {fixes.get(field, 'remove it, or train a text model')}."
        for field, set_ in unbuilt.items()
        if set_
    ]


def _lora_problems(job: JobConfig) -> list[str]:
    """LoRA trains the adapters on the language model alone: the vision tower stays as loaded,
    which is what ``trainer.freeze_vision: true`` says; an explicit false contradicts it."""
    t = job.trainer
    if t.lora is None or t.freeze_vision or "freeze_vision" not in t.model_fields_set:
        return []
    return [
        "trainer.freeze_vision=false with trainer.lora: LoRA trains adapters on the language "
        "model alone and keeps the vision tower as loaded; remove trainer.freeze_vision (or set "
        "it true), or remove trainer.lora to train the tower."
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
