"""Config sections owned by placement: the cluster shape and the placement mode."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from relax_launch.config.section import Section

PlacementMode = Literal["decoupled", "split", "defer"]


class SpareAutoscaleConfig(Section):
    """The shared spare pool's autoscaler (``runtime/pool_policy.py``): it moves the pool's ranks
    to the elastic role the step waits on, when a move saves more than its start costs."""

    target_queue_per_engine: float = Field(
        4.0,
        gt=0,
        description="Requests (queued and running) one teacher or genrm engine takes before "
        "another helps: a burst asks for at most ceil(requests / this) engines.",
    )
    min_gain_s: float = Field(
        5.0,
        ge=0,
        description="Seconds a move must save (a burst ending sooner after the new engines' "
        "start, or the next rollout phase's) beyond what the role giving the ranks loses.",
    )
    hold_s: float = Field(
        5.0,
        ge=0,
        description="A role keeps its pool engines until it has had nothing to do for this "
        "long (the hysteresis between two bursts).",
    )
    interval_s: float = Field(1.0, gt=0, description="How often the roles' load is read.")
    start_estimate_s: float = Field(
        60.0,
        gt=0,
        description="Seconds an engine takes to start until it serves, until a scale-out of "
        "the role has measured it (a rollout engine's first weight sync included).",
    )


class ClusterConfig(Section):
    """Where the job runs: torchrun's world is nnodes x nproc_per_node ranks."""

    nnodes: int = Field(1, ge=1, description="Number of nodes (torchrun --nnodes).")
    nproc_per_node: int = Field(
        1, ge=1, description="Ranks per node, one per device (torchrun --nproc-per-node)."
    )
    device: Literal["cpu", "cuda"] = Field(
        "cuda", description="Device kind: 'cuda' (NCCL) or 'cpu' (gloo, SGLang CPU engine)."
    )
    device_memory_gb: float | None = Field(
        None,
        gt=0,
        description="Memory of one device in GB (10^9 bytes), against which relax-launch plan "
        "totals each device's roles phase by phase and refuses a plan that does not fit. Unset: "
        "on cuda the GPU's own (nvidia-smi where the plan runs, else an 80 GB H100's 85.5, and "
        "said so), on cpu the host's memory divided by nproc_per_node. On GPUs every rank "
        "checks the device it got against it before starting.",
    )
    collective_timeout_s: float = Field(
        600.0, gt=0, description="Timeout of every collective and control-channel wait, seconds."
    )
    startup_timeout_s: float = Field(
        900.0, gt=0, description="Timeout for an engine or trainer to come up, seconds."
    )
    liveness_timeout_s: float = Field(
        10.0,
        gt=0,
        description="A rank silent this long (its process or node died), or a store that does "
        "not answer this long, ends the job on every node, seconds.",
    )
    stop_lead_s: float | Literal["auto"] = Field(
        "auto",
        description="relax-launch sbatch: seconds before the time limit Slurm asks the job to "
        "stop (--signal=B:USR1@N, at least 60: Slurm's resolution), to finish the train step or "
        "sync in flight and write a checkpoint. 'auto': 1.5 x (the longest train + sync + memory "
        "moves of a step, plus the longest checkpoint write) + 30 s, measured in the newest "
        "metrics.jsonl under logging.dir, at least 120 s; with no checkpoint measured yet, 120 s "
        "on cpu and 600 s on cuda.",
    )

    max_restarts: int = Field(
        0,
        ge=0,
        description="relax-launch run and sbatch's script: a job that fails (a rank, its node "
        "or torchrun's agent died; an engine restart could not mend it) starts again by itself "
        "from its newest checkpoint, at most this many times within restart_window_s; never "
        "when it failed before its first checkpoint or the same way at the same step again. "
        "Needs checkpoint.dir and checkpoint.every_steps. 0: a failure ends the job "
        '(docs/operations.md, "Restarting a failed job by itself").',
    )
    restart_window_s: float = Field(
        3600.0,
        gt=0,
        description="The window of cluster.max_restarts: restarts older than this many seconds "
        "no longer count.",
    )

    spare_ranks: int = Field(
        0,
        ge=0,
        description="decoupled: ranks after every role's, reserved for no role (the shared "
        "spare pool). Each role with max_engines may start engines of its shape there (POST "
        "/{role}/scale_out, or spare_autoscale) and gives the ranks back on scale-in; its "
        "max_engines caps its engines and it reserves no ranks of its own. A rollout engine "
        "started there joins the weight sync as any scaled-out one.",
    )
    spare_autoscale: SpareAutoscaleConfig | None = Field(
        None,
        description="Move the spare pool's ranks between the roles with their demand; every "
        "decision and its reasons go to autoscaler.jsonl in the run directory. Needs "
        "spare_ranks; the roles it scales have no autoscale of their own.",
    )

    @field_validator("stop_lead_s")
    @classmethod
    def _lead_slurm_can_keep(cls, lead: float | str) -> float | str:
        if lead != "auto" and lead < 60:
            raise ValueError(f"{lead} s is below Slurm's 60 s resolution: set 60 or more, or auto")
        return lead


class PlacementConfig(Section):
    """How roles share the ranks (docs/design.md, "Placement"; the modes: docs/placement.md)."""

    mode: PlacementMode = Field(
        "decoupled",
        description=(
            "'decoupled': each role on its own ranks; 'split': trainer on all ranks, inference "
            "roles on disjoint slices in one inference phase; 'defer': trainer on all ranks, "
            "rollout, teacher and genrm each from rank 0 in their own serialized phase."
        ),
    )
    staggered_start: bool | Literal["auto"] = Field(
        "auto",
        description="split/defer: start the roles that share devices one at a time: a role's "
        "engines load, serve a first token and release their memory before the next role's "
        "engines start, and the trainer builds once every engine has (SGLang sizes an engine's "
        "KV cache from the memory free when it starts). 'auto': on cuda, where side-by-side "
        "starts would not fit; off on cpu, where they do and start faster.",
    )
    operation_timeout_s: float = Field(
        180.0,
        gt=0,
        description=(
            "split/defer: bound on each offload or onload of a role between phases, seconds. "
            "One that fails or runs out keeps the role's ranks BLOCKED and fails the step."
        ),
    )
