"""torchrun entry point: ``torchrun --nproc-per-node G -m relax_launch.launch CONFIG [k=v ...]``.

Every rank loads the config, plans the placement for torchrun's world and checks it, then runs
its part of the job (``relax_launch.runtime.job.run_rank``); rank 0 drives the others. Rank 0
exits with 75 when the job was stopped on request (a signal, a STOP file) before its last step.
"""

from __future__ import annotations

import os
import sys

from relax_launch import platform
from relax_launch.config import ConfigError, load_config
from relax_launch.models.registry import is_vision_language
from relax_launch.placement import check_runnable, plan, preflight
from relax_launch.placement.device_memory import check_device
from relax_launch.placement.memory_plan import memory_plan
from relax_launch.rl.inputs import Inputs, read_inputs
from relax_launch.rl.interfaces import JobStopped
from relax_launch.run_dir import EXIT_STOPPED


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0 if argv else 2
    rank = int(os.environ.get("RANK", "0"))
    try:
        job = load_config(argv[0], argv[1:])
        world = job.cluster.nnodes * job.cluster.nproc_per_node
        placement = plan(job, world_size=int(os.environ.get("WORLD_SIZE", world)))
        preflight(job, placement, require_models=True)
        check_runnable(job, placement)
        memory = memory_plan(job, placement)
        local = int(os.environ.get("LOCAL_RANK", "0"))
        check_device(job, placement, platform.device_memory_bytes(job.cluster.device, local), rank)
        if rank == 0 and memory is not None:  # the run's record of what it planned
            job.log_dir.mkdir(parents=True, exist_ok=True)
            (job.log_dir / "memory_plan.json").write_text(memory.to_json())
        inputs = Inputs([], [])  # read and checked once, by rank 0: the controller's prompts
        if rank == 0:
            r = job.rollout
            vision = is_vision_language(job.trainer.model)
            inputs = read_inputs(
                job.data, job.reward, job.eval, r.function, r.environment, vision=vision
            )
    except ConfigError as exc:
        print(f"relax-launch rank {rank}: {exc}", file=sys.stderr)
        return 2
    from relax_launch.rl.program import rl_program  # torch and friends: after validation
    from relax_launch.runtime.job import run_rank

    try:
        run_rank(job, placement, rl_program(job, inputs.prompts, inputs.eval_prompts))
    except JobStopped:  # a checkpoint and the command that resumes are on the console
        leave(EXIT_STOPPED)  # not waiting for the threads of the abandoned step
    return 0


def leave(code: int) -> None:
    """Exit now with ``code``, output flushed, without joining threads still busy (a background
    rollout's user reward function the stop abandoned may run for minutes yet)."""
    import logging

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
