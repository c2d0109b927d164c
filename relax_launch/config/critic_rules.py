"""The rules of a job with a critic (PPO's value model, ``rl/critic_config.py``): GAE needs it
and it needs GAE, it shares the trainer's ranks and layout (in any placement), and what is not
built yet is refused naming the field."""

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
    critic, t, problems = job.critic, job.trainer, []
    if critic.ranks == "own":
        problems.append(
            "critic.ranks=own (a value model on ranks of its own) is not supported yet: use "
            "critic.ranks=trainer (it shares the trainer's ranks, trained after the policy)."
        )
    if job.placement.mode == "decoupled" and critic.offload != "auto":
        problems.append(
            f"critic.offload={critic.offload} acts in a colocated placement (split, defer), "
            "where the critic and the policy take turns on the device; in decoupled placement "
            "both stay resident: remove critic.offload."
        )
    for field in ("tp_size", "pp_size"):
        chosen = getattr(critic, field)
        if chosen is not None and chosen != getattr(t, field):
            problems.append(
                f"critic.{field}={chosen} differs from trainer.{field}={getattr(t, field)}: the "
                f"critic shares the trainer's ranks and layout; remove critic.{field}."
            )
    if t.pp_size > 1 or t.cp_size > 1:
        problems.append(
            "a critic with trainer.pp_size > 1 or trainer.cp_size > 1 is not supported yet (its "
            "value head is on one pipeline stage without context parallelism): use a critic "
            "with trainer.pp_size=1 and cp_size=1."
        )
    micro = critic.micro_batch_size or t.sequences_per_micro_batch
    ranks = t.ranks or job.cluster.nnodes * job.cluster.nproc_per_node
    dp = max(ranks // (t.tp_size * t.cp_size * t.pp_size), 1)
    samples = job.data.prompts_per_step * job.algorithm.n_samples_per_prompt
    split = critic.mini_batches * dp * micro
    if samples % split:
        problems.append(
            f"{samples} samples per step do not split into critic.mini_batches="
            f"{critic.mini_batches} x {dp} data-parallel trainer ranks x {micro} sequences per "
            f"micro-batch (critic.micro_batch_size, else trainer's): make the step a multiple "
            f"of {split}."
        )
    return problems


def _critic_algorithm_problems(job: JobConfig) -> list[str]:
    a, problems = job.algorithm, []
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
