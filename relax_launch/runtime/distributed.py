"""Start torch.distributed for one rank and check that every rank planned the same job."""

from __future__ import annotations

import os
import time
from datetime import timedelta

import torch.distributed as dist

from relax_launch import platform
from relax_launch.placement.plan import PlacementPlan


class PlanMismatchError(RuntimeError):
    """Ranks computed different plans: the config differs between nodes."""


def init_distributed(device: platform.Device, timeout_s: float) -> dist.Store:
    """Join the default group and return a store for control traffic (a prefix of torchrun's)."""
    dist.init_process_group(platform.dist_backend(device), timeout=timedelta(seconds=timeout_s))
    # torchrun sets this so later tcp:// rendezvous become store clients: SGLang's own process
    # group and the weight-sync groups would then wait forever for a server.
    os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    store = dist.distributed_c10d._get_default_store()
    return dist.PrefixStore("relax-launch/", store)


def check_same_plan(store: dist.Store, plan: PlacementPlan, rank: int, timeout_s: float) -> None:
    """Every rank publishes its plan hash; rank 0 compares them and publishes the verdict."""
    store.set(f"plan/{rank}", plan.stable_hash())
    if rank == 0:
        keys = [f"plan/{r}" for r in range(plan.world_size)]
        _wait(store, keys, timeout_s, "every rank's plan hash")
        hashes = {r: store.get(k).decode() for r, k in enumerate(keys)}
        odd = {r: h for r, h in hashes.items() if h != hashes[0]}
        verdict = (
            "ok"
            if not odd
            else (
                f"ranks {sorted(odd)} planned {sorted(set(odd.values()))} but rank 0 planned "
                f"{hashes[0]}: the config or the relax-launch version differs between nodes"
            )
        )
        store.set("plan/verdict", verdict)
    _wait(store, ["plan/verdict"], timeout_s, "rank 0's plan verdict")
    verdict = store.get("plan/verdict").decode()
    if verdict != "ok":
        raise PlanMismatchError(f"rank {rank}: {verdict}")


def _wait(store: dist.Store, keys: list[str], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not store.check(keys):
        if time.monotonic() > deadline:
            missing = [k for k in keys if not store.check([k])]
            raise TimeoutError(f"timed out after {timeout_s:.0f} s waiting for {what}: {missing}")
        time.sleep(0.01)
