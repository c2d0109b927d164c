"""PlacementPlan: the immutable rank map every rank computes identically from config + world."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from relax_launch import __version__


@dataclass(frozen=True)
class RoleAssignment:
    """One role a rank serves. Inference roles name their engine; the trainer its coordinates."""

    role: str
    phase: str
    engine_index: int | None = None
    engine_rank: int | None = None
    is_head: bool = False
    tp_rank: int | None = None
    pp_rank: int | None = None
    dp_rank: int | None = None
    ep_rank: int | None = None  # with expert parallelism only
    cp_rank: int | None = None  # with context parallelism only


@dataclass(frozen=True)
class RankPlan:
    """Everything one global rank does."""

    rank: int
    node: int
    local_rank: int
    assignments: tuple[RoleAssignment, ...]


@dataclass(frozen=True)
class EnginePlan:
    """One SGLang engine: its ranks (head first) and parallel sizes."""

    role: str
    index: int
    ranks: tuple[int, ...]
    tp_size: int
    pp_size: int
    phase: str
    nodes: tuple[int, ...]
    disaggregation: str | None = None  # "prefill" or "decode" half of a disaggregated role
    reserved: bool = False  # its ranks wait for a scale-out (max_engines) to start it
    pool: bool = False  # reserved on the shared spare pool's ranks (cluster.spare_ranks)
    model: int = 0  # which of the role's models it serves: {role}.models[model - 1], 0 the default

    @property
    def head_rank(self) -> int:
        return self.ranks[0]

    @property
    def label(self) -> str:
        """``rollout engine 1``, ``rollout engine 1 (prefill)``, ``teacher engine 2
        (models[0])`` (an engine of a further model of its role): how messages name it."""
        half = f" ({self.disaggregation})" if self.disaggregation else ""
        model = f" (models[{self.model - 1}])" if self.model else ""
        reserved = " (spare pool)" if self.pool else " (reserved)" * self.reserved
        return f"{self.role} engine {self.index}{half}{reserved}{model}"


@dataclass(frozen=True)
class TrainerLayout:
    """Megatron's grid over the trainer ranks (tp fastest, then cp, then dp, then pp).

    Context-parallel ranks (``cp_size``) hold slices of the same sequences: a data-parallel
    rank's shard goes to all of them. Expert parallelism splits each data-parallel group's
    ranks: a MoE layer's experts are divided over ``ep_size`` consecutive DP ranks (EP rank =
    DP rank mod ep_size), which the experts' own data parallelism (DP rank // ep_size) then
    replicates.
    """

    ranks: tuple[int, ...]
    tp_size: int
    pp_size: int
    dp_size: int
    phase: str
    ep_size: int = 1
    num_experts: int = 0  # routed experts per MoE layer (0: dense, or not known when planned)
    cp_size: int = 1

    def coordinates(self, rank: int) -> tuple[int, int, int]:
        """(tp_rank, dp_rank, pp_rank) of a global trainer rank."""
        local = rank - self.ranks[0]  # trainer ranks are contiguous
        return (
            local % self.tp_size,
            (local // (self.tp_size * self.cp_size)) % self.dp_size,
            local // (self.tp_size * self.cp_size * self.dp_size),
        )

    def cp_rank(self, rank: int) -> int:
        return ((rank - self.ranks[0]) // self.tp_size) % self.cp_size

    def rank_at(self, tp: int, dp: int, pp: int, cp: int = 0) -> int:
        """The global rank at these grid coordinates."""
        return self.ranks[tp + self.tp_size * (cp + self.cp_size * (dp + self.dp_size * pp))]

    def pp_stage_source(self, pp_rank: int, ep_rank: int = 0) -> int:
        """The global rank (tp 0, cp 0, dp ``ep_rank``) that sends pipeline stage ``pp_rank``'s
        weights (with expert parallelism: EP rank ``ep_rank``'s experts, and with EP rank 0 the
        rest)."""
        return self.rank_at(0, ep_rank, pp_rank)

    def ep_rank(self, rank: int) -> int:
        return self.coordinates(rank)[1] % self.ep_size

    def exports(self, rank: int) -> bool:
        """Whether ``rank`` takes part in exporting the weights (TP gathers): the first
        replica of each expert-parallel rank's experts (DP rank < ep_size, CP rank 0)."""
        return self.coordinates(rank)[1] < self.ep_size and self.cp_rank(rank) == 0


@dataclass(frozen=True)
class WeightSyncGroup:
    """One broadcast group: a pipeline stage's source rank (one per expert-parallel rank) plus
    every rollout engine worker.

    SGLang workers join at ``rank_offset`` (source is rank 0 of the group), one offset per
    engine, as ``init_weights_update_group`` expects.
    """

    pp_rank: int
    source_rank: int
    engine_rank_offsets: tuple[tuple[int, int], ...]
    world_size: int
    ep_rank: int = 0  # with expert parallelism, each EP rank sends its own experts


def shared_tp_size(engines: Iterable[EnginePlan]) -> int | None:
    """The TP size every one of these engines has; None when they differ (e.g. the prefill and
    decode halves of a disaggregated role)."""
    sizes = {engine.tp_size for engine in engines}
    return sizes.pop() if len(sizes) == 1 else None


def sync_rank_offsets(
    engines: Iterable[EnginePlan],
) -> tuple[tuple[tuple[int, int], ...], int]:
    """A broadcast group of a sender (rank 0) and these rollout engines: each engine's
    (index, first rank in the group), and the group's size. Its workers follow one another.
    Engines of one TP size take one group per TP index (TP rank k receives its slice of every
    weight in group k): each group holds one worker per pipeline stage of every engine."""
    engines = list(engines)
    by_tp_index = shared_tp_size(engines) is not None
    offsets, next_offset = [], 1
    for engine in engines:
        offsets.append((engine.index, next_offset))
        next_offset += engine.pp_size if by_tp_index else len(engine.ranks)
    return tuple(offsets), next_offset


@dataclass(frozen=True)
class PlacementPlan:
    """The whole job's rank map. Pure data: JSON round-trips and hashes stably."""

    mode: str
    nnodes: int
    nproc_per_node: int
    ranks: tuple[RankPlan, ...]
    engines: tuple[EnginePlan, ...]
    trainer: TrainerLayout
    phase_order: tuple[str, ...]
    weight_sync_groups: tuple[WeightSyncGroup, ...]
    config_digest: str
    critic: TrainerLayout | None = None  # the value model's grid on ranks of its own, if any

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node

    def cpu_threads(self, node: int, role: str, cores: int, overlapping: bool) -> int:
        """CPU threads for one process of ``role`` on ``node``: the node's ``cores`` shared by
        the processes that compute at the same time. Phases that take turns (synchronous
        training, split, defer) compute one role at a time: its processes share the cores.
        With rollout ``overlapping`` training, every role's processes on the node do."""
        # a critic on ranks of its own trains while the trainer does
        together = {"trainer", "critic"} if role in ("trainer", "critic") else {role}
        computing = [
            r
            for r in self.ranks
            if r.node == node and any(overlapping or a.role in together for a in r.assignments)
        ]
        return max(1, cores // max(len(computing), 1))

    def engine_node_heads(self, engine: EnginePlan) -> tuple[int, ...]:
        """The first rank of ``engine`` on each of its nodes, in node order: each starts its
        node's SGLang process, whose ``node_rank`` is its index (the first is the head)."""
        return tuple(
            min(r for r in engine.ranks if self.ranks[r].node == node) for node in engine.nodes
        )

    def engines_of(self, role: str) -> tuple[EnginePlan, ...]:
        return tuple(e for e in self.engines if e.role == role)

    def prefill_of(self, engine: EnginePlan) -> EnginePlan | None:
        """The prefill engine a decode engine pairs with: decode i takes prefill i mod count."""
        if engine.disaggregation != "decode":
            return None
        prefills = [e for e in self.engines_of(engine.role) if e.disaggregation == "prefill"]
        return prefills[engine.index % len(prefills)]

    def to_json(self) -> str:
        # Each frozen dataclass serialises as its __dict__: json's C encoder does the walking.
        return json.dumps(self, default=vars, sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> PlacementPlan:
        data = json.loads(text)
        return cls(
            mode=data["mode"],
            nnodes=data["nnodes"],
            nproc_per_node=data["nproc_per_node"],
            ranks=tuple(
                RankPlan(
                    rank=r["rank"],
                    node=r["node"],
                    local_rank=r["local_rank"],
                    assignments=tuple(RoleAssignment(**a) for a in r["assignments"]),
                )
                for r in data["ranks"]
            ),
            engines=tuple(_tupled(EnginePlan, e) for e in data["engines"]),
            trainer=_tupled(TrainerLayout, data["trainer"]),
            phase_order=tuple(data["phase_order"]),
            weight_sync_groups=tuple(
                _tupled(WeightSyncGroup, g) for g in data["weight_sync_groups"]
            ),
            config_digest=data["config_digest"],
            critic=_tupled(TrainerLayout, data["critic"]) if data.get("critic") else None,
        )

    def stable_hash(self) -> str:
        """16 hex digits identifying this plan; equal on every rank that planned the same job.

        The per-rank list is left out: it is derived from the fields hashed here (engines,
        trainer grid, world shape, config digest) by the same code, named by its version.
        """
        summary = {k: v for k, v in vars(self).items() if k != "ranks"}
        text = json.dumps([__version__, summary], default=vars, sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]


def _tupled(cls: type, data: dict[str, Any]) -> Any:
    """Build a frozen dataclass from JSON, turning lists back into tuples."""
    return cls(**{k: _as_tuple(v) for k, v in data.items()})


def _as_tuple(value: Any) -> Any:
    return tuple(_as_tuple(v) for v in value) if isinstance(value, list) else value
