"""The rules of a job with a critic (PPO's value model, ``rl/critic_config.py``): GAE needs it
and it needs GAE, it shares the trainer's ranks and layout (in any placement) or has ranks of
its own (decoupled), and what is not built yet is refused naming the field."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from relax_launch.config.job import JobConfig


def critic_problems(job: JobConfig) -> list[str]:
    """The critic against the algorithm, the placement and the trainer's layout."""
    critic, a = job.critic, job.algorithm
    gae = a.advantage_estimator == "gae"
    if critic is None:
        if gae:
            return [
                "algorithm.advantage_estimator=gae needs a value model: add a critic section "
                "(critic: {lr: 1e-5}), or choose a group estimator (grpo, rloo, ...)."
            ]
        if set(a.model_fields_set) & {"gamma", "lam"}:
            return [
                "algorithm.gamma and algorithm.lam are GAE's: they act only with "
                "algorithm.advantage_estimator=gae and a critic section; remove them."
            ]
        return []
    if not gae:
        return [
            f"a critic section trains a value model, which algorithm.advantage_estimator="
            f"{a.advantage_estimator} does not use: set algorithm.advantage_estimator=gae, or "
            "remove the critic section."
        ]
    return _critic_layout_problems(job) + _critic_algorithm_problems(job)


def _critic_layout_problems(job: JobConfig) -> list[str]:
    critic, t = job.critic, job.trainer
    problems = _own_ranks_problems(job) if critic.own_ranks else _shared_ranks_problems(job)
    if job.placement.mode == "decoupled" and critic.offload != "auto":
        problems.append(
            f"critic.offload={critic.offload} acts in a colocated placement (split, defer), "
            "where the critic and the policy take turns on the device; in decoupled placement "
            "both stay resident: remove critic.offload."
        )
    if not critic.own_ranks and (t.pp_size > 1 or t.cp_size > 1):
        problems.append(
            "a critic on the trainer's ranks with trainer.pp_size > 1 or trainer.cp_size > 1 is "
            "not supported yet (its value head is on one pipeline stage without context "
            "parallelism): use trainer.pp_size=1 and cp_size=1, or give the critic ranks of its "
            "own (critic.ranks=own, placement.mode=decoupled: one stage, its own tp_size)."
        )
    micro = critic.micro_batch_size or t.sequences_per_micro_batch
    ranks = t.ranks or job.cluster.nnodes * job.cluster.nproc_per_node
    dp = max(ranks // (t.tp_size * t.cp_size * t.pp_size), 1)
    whose = "trainer ranks"
    if critic.own_ranks:
        dp, whose = critic.own_layout(t)[1], "ranks of the critic (critic.dp_size)"
    samples = job.data.prompts_per_step * job.algorithm.n_samples_per_prompt
    split = critic.mini_batches * dp * micro
    if samples % split:
        problems.append(
            f"{samples} samples per step do not split into critic.mini_batches="
            f"{critic.mini_batches} x {dp} data-parallel {whose} x {micro} sequences per "
            f"micro-batch (critic.micro_batch_size, else trainer's): make the step a multiple "
            f"of {split}."
        )
    return problems


def _shared_ranks_problems(job: JobConfig) -> list[str]:
    """The critic on the trainer's ranks takes the trainer's layout."""
    critic, t, problems = job.critic, job.trainer, []
    for field in ("tp_size", "pp_size"):
        chosen = getattr(critic, field)
        if chosen is not None and chosen != getattr(t, field):
            problems.append(
                f"critic.{field}={chosen} differs from trainer.{field}={getattr(t, field)}: the "
                f"critic shares the trainer's ranks and layout; remove critic.{field}, or give "
                "it ranks of its own (critic.ranks=own, placement.mode=decoupled)."
            )
    if critic.dp_size is not None:
        problems.append(
            f"critic.dp_size={critic.dp_size} sizes a critic on ranks of its own: with "
            "critic.ranks=trainer its data parallelism is the trainer's; remove critic.dp_size, "
            "or set critic.ranks=own."
        )
    return problems


def _own_ranks_problems(job: JobConfig) -> list[str]:
    """Ranks of its own exist only where roles own their ranks (decoupled), one stage."""
    critic, problems = job.critic, []
    if job.placement.mode != "decoupled":
        problems.append(
            f"critic.ranks=own gives the value model ranks no other role uses, but "
            f"placement.mode={job.placement.mode} runs the trainer on every rank (the roles "
            "take turns on them), so there are none to give: set critic.ranks=trainer (the "
            "critic takes turns with the policy, critic.offload), or placement.mode=decoupled."
        )
    if critic.pp_size not in (None, 1):
        problems.append(
            f"critic.pp_size={critic.pp_size} with critic.ranks=own: the value model on ranks "
            "of its own is one pipeline stage; remove critic.pp_size and size it with "
            "critic.tp_size and critic.dp_size."
        )
    return problems


def _critic_algorithm_problems(job: JobConfig) -> list[str]:
    a, problems = job.algorithm, []
    if job.critic.warmup_steps >= a.num_steps:
        problems.append(
            f"critic.warmup_steps={job.critic.warmup_steps} leaves no step of "
            f"algorithm.num_steps={a.num_steps} to train the policy: lower critic.warmup_steps "
            "below algorithm.num_steps."
        )
    if a.distill_coef > 0:
        problems.append(
            "algorithm.distill_coef with advantage_estimator=gae is not supported yet (the "
            "distillation term would need to enter the per-token rewards): use one of them."
        )
    if a.dynamic_sampling:
        problems.append(
            "algorithm.dynamic_sampling drops groups by their rewards' spread, a group "
            "estimator's signal; with advantage_estimator=gae every sample carries a signal "
            "through the critic: turn dynamic_sampling off."
        )
    return problems
