"""What to change when a device of the memory plan overflows: its largest consumers, the
config fields that shrink each (``placement/memory_plan.py``'s refusal names them)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from relax_launch.config.job import JobConfig
    from relax_launch.placement.memory import Term
    from relax_launch.placement.memory_plan import DevicePhase


def consumers(phase: DevicePhase, count: int = 3) -> list[tuple[str, Term]]:
    """The ``count`` largest terms on the device in ``phase``, with their holders."""
    terms = [(h.role, t) for h in phase.holders for t in h.terms if not t.host]
    return sorted(terms, key=lambda rt: -rt[1].bytes)[:count]


def fixes(job: JobConfig, phase: DevicePhase) -> str:
    """What would shrink the largest consumers, the largest first."""
    found = []
    for role, term in consumers(phase):
        if role == "critic" and job.critic.own_ranks:  # alone on its ranks: its own layout
            found.append("a larger critic.tp_size or a smaller critic.micro_batch_size")
            continue
        if role == "critic":  # swapping shrinks the trainer's turn, not the start-up
            turn = phase.phase not in ("start-up", "resident") and job.critic.offload != "swap"
            found += ["critic.offload=swap"] if turn else []
            found += _trainer_fixes(job, term.name)[-1:]  # a larger layout shrinks it too
            continue
        if role != "trainer":
            name = role.split()[0]
            found.append(f"a smaller {name}.engine.mem_fraction_static or a larger {name}.tp_size")
            continue
        found += _trainer_fixes(job, term.name)
    return "Try " + "; ".join(dict.fromkeys(found)) + "."


def _trainer_fixes(job: JobConfig, term: str) -> list[str]:
    t = job.trainer
    fewer_images = "fewer image tokens a sequence (data.max_prompt_tokens)"
    if term == "vision activations":  # of a micro-batch's image patches
        return ["trainer.freeze_vision=true", "a smaller trainer.micro_batch_size", fewer_images]
    if term == "pixel values":  # of the DP rank's whole step
        return [fewer_images, "fewer sequences a DP rank (data.prompts_per_step)"]
    if term in ("activations", "logits"):
        recompute = [] if t.recompute == "full" or term == "logits" else ["trainer.recompute=full"]
        return [*recompute, "fewer tokens per micro-batch (trainer.max_tokens_per_micro_batch)"]
    if term in ("optimizer state", "master weights") and not t.distributed_optimizer:
        return ["trainer.distributed_optimizer=true"]
    if term in ("optimizer state", "master weights") and job.cluster.device == "cuda":
        return ["trainer.optimizer_offload=true"] if not t.optimizer_offload else []
    return ["a larger trainer.tp_size or pp_size (or ep_size for experts)"]


def fields(job: JobConfig, phase: DevicePhase) -> tuple[str, ...]:
    """The config fields of the largest consumers' fixes."""
    roles = dict.fromkeys(role.split()[0] for role, _ in consumers(phase))
    own = job.critic is not None and job.critic.own_ranks
    named = {"trainer": "trainer.distributed_optimizer"}
    named["critic"] = "critic.tp_size" if own else "critic.offload"
    return tuple(named.get(r, f"{r}.tp_size") for r in roles)
