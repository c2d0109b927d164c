"""The rules that span sections of a job's config: each returns its problems, every one naming
the fields and what to do (``JobConfig`` raises them together)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from relax_launch.config.agent_rules import multi_turn_problems
from relax_launch.config.critic_rules import critic_problems
from relax_launch.config.environment_rules import environment_problems
from relax_launch.config.vlm_rules import vision_language_problems
from relax_launch.rl.reasoning_gym_config import PREFIX as REASONING_GYM
from relax_launch.rl.reasoning_gym_config import SEED_BLOCKS, generator_seed

if TYPE_CHECKING:
    from relax_launch.config.job import JobConfig


def cross_section_problems(job: JobConfig) -> list[str]:
    problems = _role_usage_problems(job) + _colocation_problems(job) + _engine_problems(job)
    problems += _batch_problems(job) + _fault_tolerance_problems(job)
    problems += _static_fault_tolerance_problems(job)
    problems += _algorithm_problems(job) + _lora_problems(job)
    problems += _disaggregation_problems(job) + _micro_batch_problems(job)
    problems += _restart_problems(job)
    problems += critic_problems(job)  # config/critic_rules.py
    problems += multi_turn_problems(job)  # config/agent_rules.py
    problems += environment_problems(job)  # config/environment_rules.py
    problems += vision_language_problems(job)  # config/vlm_rules.py
    return problems + _elastic_problems(job) + _optimizer_offload_problems(job)


def _restart_problems(job: JobConfig) -> list[str]:
    """A job restarted by itself resumes from its newest checkpoint: it must write some."""
    restarts = job.cluster.max_restarts
    if restarts and (job.checkpoint.dir is None or job.checkpoint.every_steps == 0):
        return [
            f"cluster.max_restarts={restarts} restarts the job from its newest checkpoint, but "
            "it writes none while it runs: set checkpoint.dir and checkpoint.every_steps > 0 "
            "(docs/operations.md sizes it), or cluster.max_restarts=0."
        ]
    return []


def _elastic_problems(job: JobConfig) -> list[str]:
    """Where a role's engines can scale while the job runs (``max_engines``)."""
    problems = []
    for name, role in job.inference_roles().items():
        if role.max_engines is None:
            continue
        if job.placement.mode != "decoupled":
            problems.append(
                f"{name}.max_engines reserves ranks for engines started on demand, which "
                f"placement.mode={job.placement.mode} cannot do yet (its roles share every "
                "rank): remove it or use placement.mode=decoupled."
            )
        if role.prefill is not None:
            problems.append(
                f"{name}.max_engines with {name}.prefill: a scaled-out engine would need a "
                "prefill partner of its own; remove one of them."
            )
    return problems


def _role_usage_problems(job: JobConfig) -> list[str]:
    problems = []
    if job.teacher is None and job.algorithm.distill_coef > 0:
        problems.append(
            "algorithm.distill_coef > 0 needs a teacher: add a teacher section with its model, "
            "or set algorithm.distill_coef=0."
        )
    if job.teacher is not None and job.algorithm.distill_coef == 0:
        problems.append(
            "teacher is configured but algorithm.distill_coef is 0, so its engines would idle: "
            "set algorithm.distill_coef > 0 or remove the teacher section."
        )
    if job.genrm is None and job.reward.uses_genrm:
        problems.append(
            "reward.sources has a genrm source but no genrm section: add genrm with its model, "
            "or drop that source."
        )
    if job.genrm is not None and not job.reward.uses_genrm:
        problems.append(
            "genrm is configured but no reward.sources entry has genrm: true, so its engines would "
            "idle: add a source {name: judge, genrm: true} or remove the genrm section."
        )
    return problems


def _colocation_problems(job: JobConfig) -> list[str]:
    mode = job.placement.mode
    if mode == "decoupled":
        if job.trainer.ranks is None:
            return [
                "trainer.ranks is required in placement.mode=decoupled (the trainer's own ranks)."
            ]
        if job.trainer.ranks < 1:
            return [f"trainer.ranks must be at least 1 (got {job.trainer.ranks})."]
        for field in ("operation_timeout_s", "staggered_start"):
            if field in job.placement.model_fields_set:
                return [
                    f"placement.{field} is about the phases of split/defer, where roles share "
                    "devices; placement.mode=decoupled has none: remove it."
                ]
        return []
    problems = []
    for name, role in job.inference_roles().items():
        # a colocated engine must give its memory back (a static model keeps a backup)
        required = ["enable_memory_saver"] + ["enable_weights_cpu_backup"] * (name != "rollout")
        refused = [flag for flag in required if role.engine.get(flag, True) is not True]
        if refused:
            problems.append(
                f"{name}.engine sets {', '.join(refused)} off, but placement.mode={mode} needs "
                "it: engines release their memory between phases. Remove it from the engine "
                "section (or use placement.mode=decoupled)."
            )
    if job.trainer.ranks is not None:
        problems.append(
            f"trainer.ranks is set but placement.mode={mode} puts the trainer on every rank: "
            "remove trainer.ranks (or use placement.mode=decoupled)."
        )
    if job.algorithm.off_policy_steps:
        problems.append(
            f"algorithm.off_policy_steps=1 overlaps generation with training, which "
            f"placement.mode={mode} cannot do (roles share ranks): set it to 0 or use decoupled."
        )
    return problems


ENGINE_DTYPES = ("bfloat16", "float16", "float32")


def _engine_problems(job: JobConfig) -> list[str]:
    problems = []
    for name, role in job.inference_roles().items():
        if role.engine.get("dtype", job.trainer.dtype) not in ENGINE_DTYPES:
            problems.append(
                f"{name}.engine.dtype={role.engine['dtype']!r} is not one of "
                f"{', '.join(ENGINE_DTYPES)}; unset, the engines run at trainer.dtype."
            )
        if job.cluster.device == "cpu" and "max_total_tokens" not in role.engine:
            problems.append(
                f"{name}.engine.max_total_tokens is required with cluster.device=cpu (SGLang "
                "would otherwise size its KV cache from host memory): set e.g. "
                f"{name}.engine.max_total_tokens=4096."
            )
        context = role.engine.get("context_length")
        needed = job.data.max_prompt_tokens + job.data.max_response_tokens
        if name == "rollout" and context is not None and context < needed:
            problems.append(
                f"rollout.engine.context_length={context} is shorter than data.max_prompt_tokens "
                f"+ data.max_response_tokens = {needed}: raise it or shorten the data limits."
            )
    return problems


def _batch_problems(job: JobConfig) -> list[str]:
    """A step's samples must split evenly over data-parallel ranks (and fixed micro-batches)."""
    t = job.trainer
    ranks = t.ranks or job.cluster.nnodes * job.cluster.nproc_per_node
    if ranks % (t.tp_size * t.cp_size * t.pp_size):
        return []  # the planner reports the trainer grid itself
    dp = ranks // (t.tp_size * t.cp_size * t.pp_size)
    micro = t.sequences_per_micro_batch
    samples = job.data.prompts_per_step * job.algorithm.n_samples_per_prompt
    if samples % (dp * micro):
        return [
            f"data.prompts_per_step x algorithm.n_samples_per_prompt = {samples} samples per step "
            f"do not split over {dp} data-parallel trainer ranks x trainer.micro_batch_size="
            f"{micro}: make it a multiple of {dp * micro}."
        ]
    return []


def _micro_batch_problems(job: JobConfig) -> list[str]:
    """A token budget must hold the longest sequence a step can have."""
    budget = job.trainer.max_tokens_per_micro_batch
    longest = job.data.max_prompt_tokens + job.data.max_response_tokens
    if budget is not None and budget < longest:
        return [
            f"trainer.max_tokens_per_micro_batch={budget} is below the longest sequence a step "
            f"can hold (data.max_prompt_tokens + data.max_response_tokens = {longest}): raise "
            "it, or shorten the data limits."
        ]
    return []


def _optimizer_offload_problems(job: JobConfig) -> list[str]:
    """Refused, not ignored, where it cannot act: on the CPU the optimizer is in host memory
    already, and Megatron's offloaded optimizer steps only parameters it copied off a GPU."""
    if job.trainer.optimizer_offload and job.cluster.device == "cpu":
        return [
            "trainer.optimizer_offload moves the optimizer's state from GPU to host memory; with "
            "cluster.device=cpu it is there already: set trainer.optimizer_offload=false."
        ]
    return []


def _fault_tolerance_problems(job: JobConfig) -> list[str]:
    """What rollout.fault_tolerance needs: engines of their own, others to take over, and,
    behind sglang-router, plain workers (``inference/router_workers.py``)."""
    if not job.rollout.fault_tolerance:
        return []
    needs = []
    if job.placement.mode != "decoupled":
        needs.append(f"placement.mode=decoupled (not {job.placement.mode})")
    prefill = job.rollout.prefill
    if prefill is not None and min(job.rollout.num_engines, prefill.num_engines) < 2:
        needs.append(
            "two or more prefill/decode pairs, so that one serves while a half restarts "
            f"(rollout.ranks={job.rollout.ranks} and rollout.prefill.ranks={prefill.ranks} make "
            f"{job.rollout.num_engines} decode and {prefill.num_engines} prefill engines)"
        )
    elif job.rollout.num_engines < 2:
        needs.append(f"two or more rollout engines (rollout.ranks={job.rollout.ranks} makes one)")
    if prefill is not None and job.gateway.rollout_route_mode == "router":
        needs.append(
            "gateway.rollout_route_mode=direct with rollout.prefill (relax-launch changes "
            "sglang-router's plain workers as engines die and come back, not its prefill/decode "
            "pairs)"
        )
    if not needs:
        return []
    return [f"rollout.fault_tolerance needs {' and '.join(needs)}: set them or turn it off."]


def _static_fault_tolerance_problems(job: JobConfig) -> list[str]:
    """What teacher/genrm fault_tolerance needs: engines that own their memory (a restarted
    server loads its weights and KV cache at once, while a colocated role's memory belongs to
    whichever role's turn it is) and no prefill half (it would have to rejoin its partner's KV
    transfer). One engine is enough: requests wait for it to come back."""
    problems = []
    for role in ("teacher", "genrm"):
        section = getattr(job, role)
        if section is None or not section.fault_tolerance:
            continue
        if job.placement.mode != "decoupled":
            problems.append(
                f"{role}.fault_tolerance needs placement.mode=decoupled (not "
                f"{job.placement.mode}): a restarted {role} server loads its weights and KV cache "
                "at once, into GPU memory that colocated roles take in turns. Use decoupled or "
                f"set {role}.fault_tolerance=false."
            )
        if section.prefill is not None:
            problems.append(
                f"{role}.fault_tolerance needs no {role}.prefill: a restarted half would have "
                f"to rejoin its partner's KV transfer. Remove {role}.prefill or set "
                f"{role}.fault_tolerance=false."
            )
    return problems


def _disaggregation_problems(job: JobConfig) -> list[str]:
    """What prefill/decode engines cannot be combined with yet, and why."""
    problems = []
    for name, role in job.inference_roles().items():
        if role.prefill is None:
            continue
        clashes = {
            "placement.mode=decoupled": (
                job.placement.mode != "decoupled",
                "colocated engines release their KV cache between phases, and the KV transfer "
                "registers that memory once at start",
            ),
        }
        if name == "rollout":
            clashes |= _rollout_disaggregation_clashes(job)
        problems += [
            f"{name}.prefill (prefill/decode engines) needs {what}: {why}. Change it or remove "
            f"{name}.prefill."
            for what, (clash, why) in clashes.items()
            if clash
        ]
    return problems


def _rollout_disaggregation_clashes(job: JobConfig) -> dict[str, tuple[bool, str]]:
    return {
        "algorithm.routing_replay and algorithm.control.routing_replay off": (
            job.algorithm.records_routing,
            "the routed experts of a prompt are recorded on the prefill side",
        ),
        "trainer.lora.engines=merged": (
            job.trainer.lora is not None and job.trainer.lora.engines == "adapter",
            "both halves would have to load each adapter version",
        ),
        "rollout.pp_size=1 and rollout.prefill.pp_size=1": (
            job.rollout.pp_size > 1 or job.rollout.prefill.pp_size > 1,
            "SGLang's prefill and decode loops pass requests between pipeline stages in an "
            "order of their own, which the weight sync's relay to every stage does not keep yet",
        ),
    }


def _lora_problems(job: JobConfig) -> list[str]:
    """Where the rollout engines can serve the policy as a LoRA adapter."""
    lora = job.trainer.lora
    if lora is None or lora.engines != "adapter" or job.placement.mode == "decoupled":
        return []
    return [
        f"trainer.lora.engines=adapter needs placement.mode=decoupled (not "
        f"{job.placement.mode}): the colocated engines swap their weights in and out of memory, "
        "which SGLang's LoRA serving does not follow; use trainer.lora.engines=merged."
    ]


def _algorithm_problems(job: JobConfig) -> list[str]:
    """Algorithm settings that depend on the data limits, the placement or the precisions."""
    a, problems = job.algorithm, []
    if a.dynamic_sampling and job.placement.mode == "defer":
        problems.append(
            "algorithm.dynamic_sampling draws more prompts after scoring, which placement.mode="
            "defer cannot do (its roles hand the same memory over in turns): turn it off or use "
            "split or decoupled."
        )
    if a.max_staleness:
        clashes = {
            "placement.mode=decoupled": job.placement.mode != "decoupled",
            "algorithm.off_policy_steps=0": a.off_policy_steps > 0,
            "algorithm.dynamic_sampling off": a.dynamic_sampling,
        }
        if needed := [what for what, clash in clashes.items() if clash]:
            problems.append(
                f"algorithm.max_staleness={a.max_staleness} (fully asynchronous) needs "
                f"{' and '.join(needed)}: change them or set algorithm.max_staleness=0."
            )
    if a.records_routing and (a.max_staleness or job.rollout.function):
        which = "routing_replay" if a.routing_replay else "control.routing_replay"
        problems.append(
            f"algorithm.{which} records the experts of each generate call; the fully "
            "asynchronous rollout (algorithm.max_staleness) and rollout functions (rollout."
            "function) assemble samples from several calls, which it does not follow yet: turn "
            "one of them off."
        )
    if a.overlong_buffer_tokens >= job.data.max_response_tokens:
        problems.append(
            f"algorithm.overlong_buffer_tokens={a.overlong_buffer_tokens} must be below "
            f"data.max_response_tokens={job.data.max_response_tokens}."
        )
    problems += _eval_problems(job)
    if "rollout_correction_cap" in a.model_fields_set and job.rollout_correction() == "none":
        problems.append(
            "algorithm.rollout_correction_cap is set but the rollout correction is none (auto "
            "turns it on only off-policy or at another engine dtype): set "
            "algorithm.rollout_correction=token_tis or sequence_mis, or remove the cap."
        )
    return problems


def _eval_problems(job: JobConfig) -> list[str]:
    """Evaluation needs prompts the training never sees."""
    if job.eval is None:
        return []
    problems = []
    held_out = job.eval.data
    same_task = held_out.dataset == job.data.dataset and job.data.dataset.startswith("builtin:")
    # reasoning-gym draws each task's rows from the seed: a task in both gets the same rows
    both_gym = all(d.startswith(REASONING_GYM) for d in (held_out.dataset, job.data.dataset))
    same_task = same_task or both_gym
    if same_task and held_out.seed == job.data.seed:
        problems.append(
            f"eval.data.seed={held_out.seed} equals data.seed: {held_out.dataset} would "
            "evaluate on the training prompts; give eval.data.seed another value."
        )
    elif both_gym and generator_seed(held_out.seed) == generator_seed(job.data.seed):
        problems.append(
            f"eval.data.seed={held_out.seed} and data.seed={job.data.seed} differ by a multiple "
            f"of {SEED_BLOCKS}: reasoning-gym would draw the same rows for both; give "
            "eval.data.seed another value."
        )
    if job.eval.before_training and job.placement.mode != "decoupled":
        problems.append(
            f"eval.before_training evaluates between the engines' start and the first step, "
            f"which placement {job.placement.mode} has no turn for: remove it or use placement "
            "decoupled."
        )
    if job.eval.before_training and job.algorithm.max_staleness:
        problems.append(  # its rollout starts with the engines: the step-0 eval would share them
            f"eval.before_training with algorithm.max_staleness={job.algorithm.max_staleness} "
            "(fully asynchronous): the continuous rollout starts with the engines, so the "
            "step-0 eval would share them with it; remove one of the two."
        )
    return problems
