"""The value model's share of the memory plan (PPO's critic on the trainer's ranks).

Its state follows the trainer's terms for ``critic.model`` without LoRA, with Megatron's plain
optimizer (every DP rank holds its whole Adam state): parameters in the trainer's dtype, fp32
gradients, under bf16 fp32 master weights, Adam's two fp32 moments. Its activations are the
trainer's for its micro-batches (``critic.micro_batch_size``) without the logits: the value
head's output is one number per token.

Decoupled: the critic's state is resident beside the policy's (one ``resident`` phase; the two
models' activations are never live at once); on ranks of its own (``critic.ranks: own``) the
critic alone holds them, its state and its activations, sized by its own grid. Colocated: the
critic is offloaded outside the trainer's turn, and the trainer's turn has more than one
moment (``runtime/critic_turns.py``):

- ``keep``: ``train`` holds the policy training beside the critic's state, ``train critic``
  the critic training beside the policy's state;
- ``swap``: ``critic values`` holds the policy's state and the critic's parameters (scoring),
  ``train`` the policy alone, ``train critic`` the critic beside the policy's parameters.

``critic.offload: auto`` is ``keep`` when the ``keep`` plan's devices hold its phases, else
``swap``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from relax_launch.placement.memory import BYTES, Term, activation_terms, stage_params

if TYPE_CHECKING:
    from relax_launch.config.job import JobConfig
    from relax_launch.models.sizes import ModelSize
    from relax_launch.placement.plan import PlacementPlan, RankPlan, RoleAssignment

CriticMode = Literal["resident", "keep", "swap"]
TRAIN_CRITIC, CRITIC_VALUES = "train critic", "critic values"
STATE_ONLY = ("activations", "logits")  # what a model state without a batch in flight leaves out


def wanted_mode(job: JobConfig, plan: PlacementPlan) -> CriticMode | Literal["auto"] | None:
    """The critic's mode as the config asks it (None: no critic; auto: the plan decides)."""
    if job.critic is None:
        return None
    if plan.mode == "decoupled":
        return "resident"
    return job.critic.offload


def with_critic_phases(phases: tuple[str, ...], mode: CriticMode | None) -> tuple[str, ...]:
    """A colocated rank's phases with the critic's: scoring before ``train`` (swap), training
    after it."""
    if mode not in ("keep", "swap"):
        return phases
    before = (CRITIC_VALUES,) if mode == "swap" else ()
    at = phases.index("train")
    return (*phases[:at], *before, "train", TRAIN_CRITIC, *phases[at + 1 :])


def critic_terms(job: JobConfig, size: ModelSize, pp_rank: int, ranks: dict) -> list[Term]:
    """One trainer rank's value model at stage ``pp_rank``: its state, then its activations."""
    t = job.trainer
    tp, pp, ep = ranks["tp"], ranks["pp"], ranks["ep"]
    elements = critic_params(size, pp_rank, pp, tp, ep)
    weight = BYTES[t.dtype]
    terms = [
        Term("parameters", elements * weight, f"{t.dtype}, / TP {tp} x PP {pp}"),
        Term("gradients", elements * 4, "fp32 grad buffer"),
    ]
    if t.dtype == "bfloat16":
        terms.append(Term("master weights", elements * 4, "fp32, whole on each DP rank"))
    terms.append(Term("optimizer state", elements * 8, "Adam moments, fp32, whole on each DP rank"))
    section = job.critic.trainer_section(t)
    as_trainer = job.model_copy(update={"trainer": section})
    activations = activation_terms(as_trainer, size, pp_rank, ranks)
    return terms + [a for a in activations if a.name != "logits"]  # the head gives 1 per token


def critic_params(size: ModelSize, pp_rank: int, pp: int, tp: int, ep: int) -> float:
    """The value model's parameters on one rank of stage ``pp_rank``: the policy's stage without
    its language-model head (replaced in host memory, never on the device: trainer/critic.py),
    with the value head's hidden + 1 on the last stage."""
    dense, experts = stage_params(size, pp_rank, pp, tp, ep)
    if pp_rank == pp - 1:
        head = size.embedding_params / tp if not size.tied_embeddings or pp > 1 else 0
        dense += size.hidden_size + 1 - head
    return dense + experts


def state_of(terms: list[Term] | tuple[Term, ...]) -> tuple[Term, ...]:
    """A model's terms without a batch in flight."""
    return tuple(t for t in terms if t.name not in STATE_ONLY)


def named_terms(terms: list[Term] | tuple[Term, ...], *names: str) -> tuple[Term, ...]:
    return tuple(t for t in terms if t.name in names)


def trainer_state(mode: CriticMode | None, phase: str) -> str | None:
    """What the policy keeps in the critic's phases: "state" (no batch in flight),
    "parameters" (swap: its gradients and optimizer state are in host memory), or None (a
    phase the critic does not add)."""
    if phase == CRITIC_VALUES or (phase == TRAIN_CRITIC and mode == "keep"):
        return "state"
    if phase == TRAIN_CRITIC:
        return "parameters"
    return None


def critic_assignment_of(plan: PlacementPlan, rank: RankPlan) -> RoleAssignment | None:
    """Where ``rank`` holds the value model: its own rank's critic role, or, when it has no
    ranks of its own, a trainer rank's trainer role (None: it holds none)."""
    wanted = "critic" if plan.critic is not None else "trainer"
    return next((a for a in rank.assignments if a.role == wanted), None)


def critic_ranks(plan: PlacementPlan, trainer_ranks: dict[str, int]) -> dict[str, int]:
    """The grid the value model is sized by: its own (one stage) or the trainer's."""
    if plan.critic is None:
        return trainer_ranks
    return {"tp": plan.critic.tp_size, "pp": 1, "dp": plan.critic.dp_size, "cp": 1, "ep": 1}


def critic_state(
    mode: CriticMode, phase: str, own: bool = False
) -> tuple[str, tuple[str, ...] | None]:
    """The critic's state label in ``phase`` and the names of the terms it holds there (None:
    all of them). On ranks of its own it holds all of them: its state and its batch."""
    if own:
        return "active", None
    if mode == "resident":
        return "resident", _STATE_NAMES
    if phase == "start-up":
        return "built", _STATE_NAMES
    if phase == TRAIN_CRITIC:
        return "active", None
    if phase == CRITIC_VALUES:
        return "parameters only", ("parameters",)
    if phase == "train" and mode == "keep":
        return "resident", _STATE_NAMES
    return "offloaded", ()


_STATE_NAMES = ("parameters", "gradients", "master weights", "optimizer state")
