"""Process groups of one job, created once, in the same order on every rank.

Megatron's ``parallel_state.initialize_model_parallel`` sizes its groups from the whole world, so
the trainer's TP/DP/PP groups are built with ``HyperCommGrid`` over the trainer's ranks only and
handed to Megatron as a ``ProcessGroupCollection``. Inference ranks take part in every
``new_group`` call (torch requires it) and get ``None`` back.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from relax_launch.placement.plan import TrainerLayout


def build_trainer_groups(layout: TrainerLayout, backend: str) -> Any | None:
    """The trainer's ProcessGroupCollection on trainer ranks; None elsewhere. All ranks call."""
    from megatron.core.hyper_comm_grid import HyperCommGrid
    from megatron.core.process_groups_config import ProcessGroupCollection

    # Megatron's default order tp-cp-ep-dp-pp: tp fastest, then cp, dp, pp (as the planner);
    # the dense grid's ep is 1 (expert parallelism has its own grid, below).
    grid = HyperCommGrid(
        [layout.tp_size, layout.cp_size, 1, layout.dp_size, layout.pp_size],
        ["tp", "cp", "ep", "dp", "pp"],
        rank_offset=layout.ranks[0],
        backend=backend,
    )
    dims = {
        "tp": "tp",
        "cp": "cp",
        "dp": "dp",
        "pp": "pp",
        "mp": ["tp", "pp"],
        "tp_cp": ["tp", "cp"],
        "dp_cp": ["dp", "cp"],
        "tp_dp_cp": ["tp", "dp", "cp"],
    }
    groups = {name: grid.create_pg(dim) for name, dim in dims.items()}
    trainer_group = grid.create_pg(["tp", "cp", "dp", "pp"])
    shard_peers = grid.create_pg(["tp", "cp", "pp"])  # the ranks of one data-parallel shard
    single = grid.create_pg("ep")
    experts = _expert_groups(layout, backend) if layout.ep_size > 1 else None
    embedding, position_embedding = _embedding_groups(grid, backend)
    if dist.get_rank() not in layout.ranks:
        return None
    pgc = ProcessGroupCollection(**groups)
    pgc.embd, pgc.pos_embd = embedding, position_embedding
    if experts is None:
        # A dense model (or EP 1): the expert groups are their dense equivalents (experts
        # replicated over data and context parallelism), or Megatron's DDP would call new_group
        # on trainer ranks alone and hang the world.
        experts = {"ep": single, "expt_tp": groups["tp"], "expt_dp": groups["dp_cp"]}
        experts |= {"tp_ep": groups["tp"], "tp_ep_pp": groups["mp"]}
    for name, group in experts.items():
        setattr(pgc, name, group)
    pgc.intra_expt_dp = pgc.expt_dp  # no partial distributed optimizer
    pgc.intra_dp_cp, pgc.inter_dist_opt, pgc.hcp = groups["dp_cp"], None, None
    # The distributed optimizer's one instance spans the trainer: it sums the gradient norm
    # over it (None would mean the default world, inference ranks included, and hang).
    pgc.intra_dist_opt = trainer_group
    pgc.trainer, pgc.shard_peers = trainer_group, shard_peers
    return pgc


def _expert_groups(layout: TrainerLayout, backend: str) -> dict[str, Any]:
    """Megatron's expert groups over the same ranks: experts keep the trainer's TP, and each
    data-parallel group splits into ``ep_size`` expert-parallel ranks (consecutive DP ranks)
    times the experts' own data parallelism, as Megatron orders them (tp-ep-dp-pp)."""
    from megatron.core.hyper_comm_grid import HyperCommGrid

    grid = HyperCommGrid(
        [layout.tp_size, layout.ep_size, layout.dp_size // layout.ep_size, layout.pp_size],
        ["tp", "ep", "dp", "pp"],
        rank_offset=layout.ranks[0],
        backend=backend,
    )
    dims = {"ep": "ep", "expt_tp": "tp", "expt_dp": "dp"}
    dims |= {"tp_ep": ["tp", "ep"], "tp_ep_pp": ["tp", "ep", "pp"]}
    return {name: grid.create_pg(dim) for name, dim in dims.items()}


def _embedding_groups(grid: Any, backend: str) -> tuple[Any, Any]:
    """Per pipeline: {first, last} stage shares tied embeddings; {first} has position embeddings."""
    embedding = position_embedding = None
    rank = dist.get_rank()
    for ranks in grid.get_rank_enum("pp"):
        ends = sorted({ranks[0], ranks[-1]})
        group = dist.new_group(ends, backend=backend)
        if rank in ends:
            embedding = group
        group = dist.new_group([ranks[0]], backend=backend)
        if rank == ranks[0]:
            position_embedding = group
    return embedding, position_embedding
