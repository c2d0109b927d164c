"""The broadcast group of a weight sync: a process group outside the job's world, formed by a
sender (rank 0, hosting its store) and the engine workers that join it over HTTP."""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # not imported at run time: the engines' receiver plugin imports this module
    import torch.distributed as dist


def group_store(group: dist.ProcessGroup) -> dist.Store:
    """The store a process group was formed through (hosted by its rank 0: the sender).

    Read from torch's own record of its groups: the public ``ProcessGroup.get_group_store()``
    returns None in an SGLang scheduler for the group its weight updater formed (torch 2.13;
    ``tests/weights/test_sync_engine.py`` fails with it), though it works in a plain process."""
    from torch.distributed import distributed_c10d  # the engines' plugin imports this module

    return distributed_c10d._world.pg_map[group][1]


def custom_group(
    backend: str,
    host: str,
    port: int,
    world_size: int,
    rank: int,
    group_name: str,
    timeout_s: float,
) -> dist.ProcessGroup:
    """A process group outside the default world, built by the same SGLang helper the engines
    use for their side of it (rank 0 hosts the store); imported here, on the few ranks that
    send weights, because SGLang's utilities are a heavy import."""
    from sglang.srt.utils.common import init_custom_process_group

    return init_custom_process_group(
        backend=backend,
        init_method=f"tcp://{host}:{port}",
        timeout=timedelta(seconds=timeout_s),
        world_size=world_size,
        rank=rank,
        group_name=group_name,
    )
