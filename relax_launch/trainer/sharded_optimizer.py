"""Checkpoint state of Megatron-core's distributed optimizer (``trainer.distributed_optimizer``).

Its fp32 master weights and Adam state are sharded over the data-parallel (x context-parallel)
ranks, so ``state_dict()`` holds only what every rank shares (parameter groups, step). Each rank
saves its own shard in Megatron's per-rank ``dp_reshardable`` form
(``get_parameter_state_dp_reshardable``, loaded back by ``load_state_dict``), with no
collective and no gather onto one rank. A shard fits only the data-parallel sizes it was cut
for: a resume into other sizes is refused before anything loads.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch.utils._pytree import tree_map

SHARDING = "dp_reshardable"  # Megatron's name of the per-rank bucket form


def dp_shard_name(pgc: Any) -> str:
    """The checkpoint file of a rank outside the first data-parallel replica of its experts
    (those write the model shard, ``trainer.shard_name``, and their optimizer shard with it):
    its optimizer shard alone, named by its rank in the DP x CP group."""
    return f"trainer_tp{pgc.tp.rank()}_pp{pgc.pp.rank()}_dp{pgc.dp_cp.rank()}.pt"


def checkpoint(optimizer: Any, pgc: Any, sharded: bool) -> dict[str, Any]:
    """The optimizer entries of a rank's checkpoint file: the whole ``state_dict``, or under
    the distributed optimizer this rank's shards and the sizes they were cut for."""
    if not sharded:
        return {"optimizer": optimizer.state_dict()}
    return {"optimizer": state(optimizer), "sharded_optimizer": layout(pgc)}


def layout(pgc: Any) -> dict[str, int]:
    """The sizes this rank's optimizer shards were cut for: the dense parameters' data-parallel
    (x context-parallel) group and the experts' data-parallel group."""
    return {"dp_cp": pgc.dp_cp.size(), "expt_dp": pgc.expt_dp.size()}


def state(optimizer: Any) -> list[dict[str, Any]] | None:
    """This rank's part of the optimizer, per chained Megatron optimizer: its shared
    ``state_dict`` with its shard of master weights and Adam state (host copies: a shard of
    fp32 weights views the whole parameter buffer, which ``torch.save`` would write whole).
    None before the first step, when Adam has no state yet."""
    parts = optimizer.chained_optimizers
    if any(not p.optimizer.state for p in parts):
        return None
    saved = []
    for part in parts:
        shard = part.get_parameter_state_dp_reshardable()
        for gbuf in (v for k, v in shard.items() if isinstance(k, int)):
            for buckets in gbuf.values():
                for entry in (e for bucket in buckets for e in bucket):
                    entry["padding"] = False  # the loader skips padding entries by this flag
        shard = tree_map(lambda v: v.detach().to("cpu", copy=True) if _tensor(v) else v, shard)
        saved.append(
            part.state_dict() | {"param_state": shard, "param_state_sharding_type": SHARDING}
        )
    return saved


def check_resumable(saved: dict[str, Any], distributed: bool, pgc: Any, path: Path) -> None:
    """Refuse, before anything loads, a checkpoint whose optimizer this trainer cannot take:
    saved with the other ``trainer.distributed_optimizer`` setting, or sharded for other
    data-parallel sizes."""
    sizes = saved.get("sharded_optimizer")
    if (sizes is not None) != distributed:
        was = "true" if sizes is not None else "false"
        raise ValueError(
            f"{path} was saved with trainer.distributed_optimizer={was}, which holds its "
            "optimizer state in another form: resume with trainer.distributed_optimizer="
            f"{was} (the setting it was saved with)"
        )
    if distributed and sizes != layout(pgc):
        now = layout(pgc)
        raise ValueError(
            f"{path} holds distributed-optimizer shards for {sizes['dp_cp']} data-parallel "
            f"(x context-parallel) ranks, {sizes['expt_dp']} for the experts, but this trainer "
            f"has {now['dp_cp']} and {now['expt_dp']}: with trainer.distributed_optimizer each "
            "DP rank saves only its own slice of the optimizer state, so it resumes only into "
            "the same data-parallel size; resume with the trainer.ranks (and tp_size, pp_size, "
            "cp_size, ep_size) it was saved with"
        )


def load(optimizer: Any, saved: list[dict[str, Any]] | None) -> None:
    """Restore this rank's shards (``state``'s output) into the optimizer; None (saved before
    the first step) leaves it fresh."""
    if saved is None:
        return
    with torch.no_grad():  # fp32 shards are views of the parameters, which require grad
        optimizer.load_state_dict(saved if len(saved) > 1 else saved[0])  # a list for several
    # Megatron gives torch's Adam one "step" tensor for every parameter, which each
    # parameter's update then advances: the bias correction would run ahead. One each.
    for part in optimizer.chained_optimizers:
        for per_param in part.optimizer.state.values():
            if _tensor(per_param.get("step")):
                per_param["step"] = per_param["step"].clone()


def _tensor(value: Any) -> bool:
    return isinstance(value, torch.Tensor)
