"""torchrun entry point: ``torchrun --nproc-per-node G launch.py CONFIG [key=value ...]``.

Every rank loads the config, plans the placement for torchrun's world and checks it. The
runtime that builds process groups and starts each rank's roles lands on top of this.
"""

from __future__ import annotations

import os
import sys

from relax_launch.config import ConfigError, load_config
from relax_launch.placement import plan, preflight
from relax_launch.placement.render import describe


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0 if argv else 2
    rank = int(os.environ.get("RANK", "0"))
    try:
        job = load_config(argv[0], argv[1:])
        placement = plan(
            job,
            world_size=int(
                os.environ.get("WORLD_SIZE", job.cluster.nnodes * job.cluster.nproc_per_node)
            ),
        )
        preflight(job, placement, require_models=True)
    except ConfigError as exc:
        print(f"relax-launch rank {rank}: {exc}", file=sys.stderr)
        return 2
    roles = ", ".join(describe(a) for a in placement.ranks[rank].assignments)
    print(f"rank {rank}: plan {placement.stable_hash()} roles {roles}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
