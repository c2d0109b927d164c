"""Colocated start-up one role at a time (``placement.staggered_start``).

SGLang sizes an engine's KV pool from the device memory free when it starts: ``mem_fraction_static``
x capacity minus what is already held. Engines starting side by side on one GPU would each size
theirs from what the others had not taken yet (the last finds none and fails), and a trainer
building its share beside them would find the device full. So, where roles share devices:

    for each wave (defer: one role each, in phase order; split: every role, on its own slice):
        this rank's engines of the wave launch, serve a first token, then park (release
        weights, KV cache and CUDA graphs), and every rank waits for every other's;
    then the trainer builds.

The device then holds, at every moment, what the memory plan's phases say. The controller's
managers know the engines start parked (``RoleSpec.parked``): the first onload resumes them.
"""

from __future__ import annotations

import logging
from typing import Any

from relax_launch.config.job import JobConfig
from relax_launch.deadline import wait_until
from relax_launch.inference.engine import MEMORY_TAGS, post
from relax_launch.placement.plan import PlacementPlan
from relax_launch.runtime.startup import StartupClock

log = logging.getLogger(__name__)


def waves(plan: PlacementPlan) -> list[tuple[str, ...]]:
    """The inference roles in start order: those of one wave share no device."""
    roles = list(dict.fromkeys(e.role for e in plan.engines))
    if plan.mode == "split":  # disjoint slices: all at once
        return [tuple(roles)]
    by_phase = {
        phase: [r for r in roles if plan.engines_of(r)[0].phase == phase]
        for phase in plan.phase_order
    }
    return [tuple(group) for group in by_phase.values() if group]


def start_in_waves(
    job: JobConfig,
    plan: PlacementPlan,
    rank: int,
    store: Any,
    workers: list[Any],
    clock: StartupClock,
) -> None:
    """Launch, ready and park this rank's engines wave by wave, in step with every rank."""
    timeout_s = job.cluster.startup_timeout_s
    for index, wave in enumerate(waves(plan)):
        mine = [w for w in workers if w.engine.role in wave and not w.engine.reserved]
        for worker in mine:
            worker.launch()
            clock.mark(f"{worker.engine.role} engine {worker.engine.index} launched")
        for worker in mine:
            worker.wait_ready(timeout_s)
            post(
                worker.server.url,
                "/release_memory_occupation",
                {"tags": list(MEMORY_TAGS)},
                timeout_s,
            )
            clock.mark(f"{worker.engine.role} engine {worker.engine.index} parked")
        wait_for_every_rank(
            store,
            f"start/wave{index}",
            rank,
            plan.world_size,
            timeout_s,
            f"the {', '.join(wave)} engines to load and park",
        )


def wait_for_every_rank(
    store: Any, key: str, rank: int, world_size: int, timeout_s: float, what: str
) -> None:
    """A barrier over the job's store with a deadline; its error names the ranks missing."""
    store.set(f"{key}/{rank}", "1")
    keys = [f"{key}/{r}" for r in range(world_size)]
    if wait_until(lambda: store.check(keys), timeout_s, 0.05, 1.0):
        return
    missing = [r for r, k in enumerate(keys) if not store.check([k])]
    raise TimeoutError(
        f"start-up: ranks {missing} did not report {what} within {timeout_s:.0f} s "
        "(cluster.startup_timeout_s); their logs (rank<R>.log, <role>-engine<N>.log) say where "
        "they are"
    )
