"""Where an engine's ranks may lie: the planner's rule for every engine it places, the role
slices' (``planner.py``) and the spare pool's (``spare_pool.py``) alike."""

from __future__ import annotations

from relax_launch.config.errors import ConfigError


def check_engine_span(
    field: str, index: int, first: int, width: int, per_node: int, pool: bool = False
) -> None:
    """Refuse an engine of ``width`` ranks from ``first`` that crosses a node boundary (one that
    fits in a node), or one wider than a node not made of whole nodes. ``pool``: the engine is
    a reserved one on the spare pool, whose first rank ``cluster.spare_ranks`` sets."""
    name = field.partition(".")[0]
    last = first + width - 1
    where = " on the spare pool" if pool else ""
    fields = (f"{field}.tp_size", "cluster.spare_ranks") if pool else (f"{field}.tp_size",)
    placed_before = (
        "cluster.spare_ranks and the roles placed before it"
        if pool
        else ("the ranks of the roles placed before it")
    )
    if width <= per_node and first // per_node != last // per_node:
        raise ConfigError(
            f"{name} engine {index}{where} (ranks {first}-{last}) would cross a node boundary "
            f"({per_node} ranks per node): change {placed_before}, or "
            f"{field}.tp_size x {field}.pp_size, so each engine fits inside one node.",
            fields,
        )
    if width > per_node and (width % per_node or first % per_node):
        raise ConfigError(
            f"{name} engine {index}{where} spans {width} ranks from rank {first}, but an engine "
            f"wider than a node ({per_node} ranks) must use whole nodes: make "
            f"{field}.tp_size x {field}.pp_size a multiple of {per_node} and start it on a node "
            f"boundary (change {placed_before}).",
            fields,
        )
