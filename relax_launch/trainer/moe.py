"""The trainer's routers: routing replay and what the step metrics say about routing.

Routing replay (R3): the rollout engine returns, for every token it computed, the experts each
MoE layer routed it to; the trainer's forward then dispatches every token to those experts
(Megatron's ``RouterReplay``, REPLAY_FORWARD), with the routing weights its own router gives
them, so trainer and engine run the same experts and the logprob mismatch left is numerical.

A micro-batch carries the engine's routing as ``routed_experts`` [batch, seq, MoE layers, top-k]
(the MoE layers of the whole model, in order); Megatron's router sees tokens sequence-first
([seq * batch, hidden]), so the indices are transposed to that order, and under sequence
parallelism (MoE with TP) each TP rank's router sees its part of the sequence only.

The monitor watches every router of the policy in the training forward: tokens per expert, the
load-balancing loss E·Σ f_i·P_i (1 when balanced; f_i the share of routed slots, P_i the mean
router probability of expert i) and, where the engine's routing is known, how often the
trainer's own choice (``routing_mismatch``) and the experts it dispatched to
(``dispatch_mismatch``: 0 under replay) differ from the engine's, over trained tokens. A step
whose ``LossSpec.routing_replay`` is off (``algorithm.control.routing_replay`` before it acts)
carries the engine's routing for the comparison only (``compare_only``): the routers choose.
"""

from __future__ import annotations

from contextvars import ContextVar
from typing import Any

import torch
import torch.distributed as dist

from relax_launch.trainer.hf_conversion import stage_layers
from relax_launch.trainer.model_shape import ModelShape
from relax_launch.trainer.recompute import recomputing


def routers(module: Any, shape: ModelShape, pp: Any) -> list[tuple[int, Any]]:
    """(column of the MoE layer in ``routed_experts``, its router) for this stage's MoE
    layers, in layer order."""
    from megatron.core.transformer.moe.router import TopKRouter

    found = [m for m in module.modules() if isinstance(m, TopKRouter)]
    layers = [i for i in stage_layers(shape, pp.rank(), pp.size()) if shape.is_moe_layer(i)]
    if len(found) != len(layers):
        raise RuntimeError(f"stage has {len(found)} routers for {len(layers)} MoE layers")
    return [
        (shape.moe.layers.index(layer), router) for layer, router in zip(layers, found, strict=True)
    ]


def sequence_first(routed: torch.Tensor, column: int, part: tuple[int, int] = (0, 1)) -> Any:
    """One MoE layer's routing of a micro-batch, [batch, seq, ...] -> Megatron's token order;
    under sequence parallelism (``part`` = (TP rank, TP size)) this rank's part of the
    sequence, which is what its router sees."""
    layer = routed[:, :, column]  # [batch, seq, k]
    rank, ranks = part
    length = layer.shape[1] // ranks
    layer = layer[:, rank * length : (rank + 1) * length]
    return layer.transpose(0, 1).reshape(-1, layer.shape[-1])


def compare_only(micro_batches: list[dict[str, torch.Tensor]]) -> None:
    """Keep each micro-batch's engine routing for the monitor's comparison, not for replay."""
    for batch in micro_batches:
        if "routed_experts" in batch:
            batch[COMPARED] = batch.pop("routed_experts")


COMPARED = "compared_experts"  # the engine's routing of a micro-batch that is not replayed
# The engine's routing of the micro-batch being computed, or None: a context variable, so that a
# recomputation in the backward pass replays its own micro-batch's (``trainer/recompute.py``).
_ROUTED: ContextVar[torch.Tensor | None] = ContextVar("routed_experts", default=None)


class Replay:
    """Dispatch each micro-batch's tokens to the engine's experts (see the module docstring):
    before each forward of a router, its replay is set from the micro-batch's routing."""

    def __init__(self, layers: list[tuple[int, Any]], part: tuple[int, int]) -> None:
        self.layers, self.part = layers, part
        for column, router in layers:
            router.register_forward_pre_hook(self._before(column))

    def set(self, routed: torch.Tensor | None) -> None:
        """Replay ``routed`` in the next forwards; None: route as the router chooses."""
        _ROUTED.set(routed)

    def _before(self, column: int) -> Any:
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        def hook(router: Any, args: tuple) -> None:
            replay, routed = router.router_replay, _ROUTED.get()
            replay.clear_indices()
            if routed is None:
                replay.clear_router_replay_action()
                return
            replay.set_target_indices(sequence_first(routed, column, self.part))
            replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)

        return hook


class RoutingMonitor:
    """Routing statistics of the training forward, summed over micro-batches (module doc)."""

    def __init__(
        self,
        layers: list[tuple[int, Any]],
        num_experts: int,
        topk: int,
        part: tuple[int, int],
        device: torch.device,
    ) -> None:
        self.num_experts, self.topk, self.part = num_experts, topk, part
        self.batch: dict[str, torch.Tensor] | None = None  # the micro-batch being computed
        # tokens per expert, router probability sums per expert, tokens, trained tokens whose
        # chosen / dispatched experts differ from the engine's, trained tokens compared; kept
        # on the device, so the forward never waits for the host
        self.totals = torch.zeros(2 * num_experts + 4, dtype=torch.float64, device=device)
        for column, router in layers:
            router.register_forward_hook(self._observe(column))

    def watch(self, batch: dict[str, torch.Tensor] | None) -> None:
        """Count the next forward's routing, of micro-batch ``batch`` (None: do not count)."""
        self.batch = batch

    def _observe(self, column: int) -> Any:
        def hook(router: Any, inputs: tuple, output: tuple) -> None:
            if self.batch is not None and not recomputing():  # counted in the forward
                with torch.no_grad():
                    self._count(router, inputs[0], output[1], column)

        return hook

    def _count(
        self, router: Any, hidden: torch.Tensor, dispatched: torch.Tensor, column: int
    ) -> None:
        """Add one layer's routing of the micro-batch being computed to ``totals`` (masks
        multiplied in, not indexed by: no host synchronisation)."""
        batch, e, totals = self.batch, self.num_experts, self.totals
        real = sequence_first(batch["valid"][..., None, None], 0, self.part).double()
        logits = hidden.reshape(-1, hidden.shape[-1]).float() @ router.weight.float().t()
        chosen = torch.zeros_like(logits, dtype=torch.bool)
        chosen.scatter_(1, logits.topk(self.topk, dim=-1).indices, True)
        totals[:e] += (dispatched.double() * real).sum(0)
        totals[e : 2 * e] += (logits.softmax(-1).double() * real).sum(0)
        totals[2 * e] += real.sum()
        engine_routing = batch.get("routed_experts", batch.get(COMPARED))
        if engine_routing is not None:
            engine = torch.zeros_like(chosen)
            routed = sequence_first(engine_routing, column, self.part)
            engine.scatter_(1, routed.long(), True)
            trained = sequence_first(batch["trained"][..., None, None] > 0, 0, self.part)[:, 0]
            totals[2 * e + 1] += ((chosen != engine).any(-1) & trained).sum()
            totals[2 * e + 2] += ((dispatched.bool() != engine).any(-1) & trained).sum()
            totals[2 * e + 3] += trained.sum()

    def metrics(self, groups: list[Any]) -> dict[str, float]:
        """The step's routing metrics, summed over ``groups`` (data parallel, pipeline, tensor
        parallel), and reset for the next step. Every rank of the groups calls it."""
        totals, self.totals = self.totals, torch.zeros_like(self.totals)
        for group in groups:
            dist.all_reduce(totals, group=group)
        totals, e = totals.cpu(), self.num_experts
        tokens_per_expert, prob_sums, tokens = totals[:e], totals[e : 2 * e], totals[2 * e]
        if tokens == 0:
            return {}
        share, mean_prob = tokens_per_expert / tokens_per_expert.sum(), prob_sums / tokens
        metrics = {
            "moe/load_balance_loss": float(e * (share * mean_prob).sum()),
            "moe/load_imbalance": float(tokens_per_expert.max() / tokens_per_expert.mean()),
        }
        metrics |= {f"moe/expert{i}_tokens": float(n) for i, n in enumerate(tokens_per_expert)}
        if totals[2 * e + 3] > 0:
            metrics["moe/routing_mismatch"] = float(totals[2 * e + 1] / totals[2 * e + 3])
            metrics["moe/dispatch_mismatch"] = float(totals[2 * e + 2] / totals[2 * e + 3])
        return metrics


class MoeRouting:
    """The routers of the policy (and of its frozen reference): replay in every forward of a
    micro-batch that carries the engine's routing, statistics in the training forward."""

    def __init__(self, policy: Any, shape: ModelShape, pgc: Any, device: torch.device) -> None:
        self.shape, self.pp = shape, pgc.pp
        sequence_parallel = policy.config.sequence_parallel
        self.part = (pgc.tp.rank(), pgc.tp.size()) if sequence_parallel else (0, 1)
        layers = routers(policy, shape, pgc.pp)
        self.replays = {id(policy): Replay(layers, self.part)}
        moe = shape.moe
        self.monitor = RoutingMonitor(layers, moe.num_experts, moe.topk, self.part, device)

    def add(self, model: Any) -> None:
        """Replay in ``model`` too (the reference model: its own routers)."""
        self.replays[id(model)] = Replay(routers(model, self.shape, self.pp), self.part)

    def prepare(self, model: Any, batch: dict[str, torch.Tensor], train: bool) -> None:
        """Before ``model`` computes ``batch``: replay its routing if it has the engine's;
        count it if this is the training forward."""
        self.replays[id(getattr(model, "module", model))].set(batch.get("routed_experts"))
        self.monitor.watch(batch if train else None)


def moe_routing(policy: Any, shape: ModelShape, pgc: Any, device: Any) -> MoeRouting | None:
    """The policy's ``MoeRouting``; None for a dense model."""
    return MoeRouting(policy, shape, pgc, device) if shape.moe is not None else None
