"""Weight sync into pipeline-parallel SGLang engines (``pp_size > 1``): part of the SGLang
plugin (``receiver.register``).

SGLang's own update path assumes one pipeline stage in two places:

- Every worker joins the update group at ``rank_offset + tp_rank``, so the stages of one engine
  take the same rank. Here a worker joins at ``rank_offset + pp_rank * tp_size + tp_rank``, the
  order of SGLang's own pipeline ranks, in a group of ``1 + tp_size * pp_size`` per engine (the
  planner's ``sync_rank_offsets``). Engines whose TP ranks each receive their own slice join
  one group per TP index instead (``BY_TP_RANK``): TP rank k of every stage of
  every engine with the sender, at ``rank_offset + pp_rank``.
- A control request reaches the first stage, which runs it before relaying its batch of
  requests to the next stage: the first stage then waits in the group's rendezvous (or its
  broadcasts) for stages that have not received the request yet. A batch holding a weight-sync
  request is relayed first, then run, so every stage joins at once.

Every stage receives every tensor and keeps its own layers' (``receiver._ReceiverState.
elsewhere``). Engines of one stage take neither change.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)
UPDATER = "sglang.srt.model_executor.model_runner_components.weight_updater.WeightUpdater"
SCHEDULER = "sglang.srt.managers.scheduler.Scheduler"
RELAYED = "_relax_relayed"  # a batch this stage relayed ahead of running it


# A group name ending so asks each engine TP rank k to join the group of TP index k
# (``tp_group_name``) instead: the sender broadcasts there rank k's slice of every weight.
BY_TP_RANK = "@by-tp-rank"


def tp_group_name(group_name: str, tp_rank: int) -> str:
    """The broadcast group of a sender and every engine's TP rank ``tp_rank`` (all its pipeline
    stages), for a ``group_name`` ending in ``BY_TP_RANK``."""
    return f"{group_name}/tp{tp_rank}"


def tp_groups(group_name: str, tp_size: int) -> list[str]:
    """The groups a sender forms with engines of ``tp_size`` ranks: the one named, or past one
    rank, one per TP index."""
    if tp_size == 1:
        return [group_name]
    return [tp_group_name(group_name, rank) for rank in range(tp_size)]


def register() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(
        f"{UPDATER}.init_weights_update_group", join_at_stage_rank, HookType.AROUND
    )
    HookRegistry.register(
        f"{SCHEDULER}.process_input_requests", relay_sync_requests_first, HookType.AROUND
    )
    HookRegistry.register(
        f"{SCHEDULER}._pp_send_pyobj_to_next_stage", skip_relayed, HookType.AROUND
    )


def join_at_stage_rank(
    original: Any,
    updater: Any,
    master_address: str,
    master_port: int,
    rank_offset: int,
    world_size: int,
    group_name: str,
    backend: str,
) -> Any:
    """SGLang's ``init_weights_update_group``, with this stage's workers after the earlier
    stages' in the group. A group named ``BY_TP_RANK`` is one group per TP index instead: this
    worker joins its TP rank's (``tp_group_name``), one worker per stage of each engine, kept
    under the name the sender's requests use."""
    from sglang.srt.runtime_context import get_parallel

    parallel = get_parallel()
    if not group_name.endswith(BY_TP_RANK):
        offset = rank_offset + parallel.pp_rank * parallel.tp_size
        return original(
            updater, master_address, master_port, offset, world_size, group_name, backend
        )
    own = tp_group_name(group_name, parallel.tp_rank)
    offset = rank_offset + parallel.pp_rank - parallel.tp_rank  # SGLang adds tp_rank back
    joined = original(updater, master_address, master_port, offset, world_size, own, backend)
    groups = updater._model_update_group
    if own in groups:
        groups[group_name] = groups.pop(own)
    return joined


def relay_sync_requests_first(original: Any, scheduler: Any, requests: list) -> Any:
    """On a stage before the last, a batch with a weight-sync request goes to the next stage
    before this one runs it (the event loop's own relay of it is then skipped)."""
    from sglang.srt.runtime_context import get_parallel

    if (
        get_parallel().pp_size > 1
        and not scheduler.pp_group.is_last_rank
        and any(_is_sync_request(r) for r in requests or ())
    ):
        scheduler._pp_commit_comm_work(scheduler.send_req_work)  # keep the relay's order
        scheduler.send_req_work = []
        send = getattr(type(scheduler)._pp_send_pyobj_to_next_stage, "__wrapped__", None)
        send = send or type(scheduler)._pp_send_pyobj_to_next_stage
        setattr(scheduler, RELAYED, send(scheduler, requests, async_send=True))
    return original(scheduler, requests)


def skip_relayed(original: Any, scheduler: Any, data: Any, async_send: bool = False) -> Any:
    relayed = getattr(scheduler, RELAYED, None)
    if relayed is not None:  # the event loop relays the batch already sent
        setattr(scheduler, RELAYED, None)
        return relayed
    return original(scheduler, data, async_send=async_send)


def _is_sync_request(request: Any) -> bool:
    from sglang.srt.managers.io_struct import (
        DestroyWeightsUpdateGroupReqInput,
        InitWeightsUpdateGroupReqInput,
        UpdateWeightsFromDistributedReqInput,
    )

    sync = (
        InitWeightsUpdateGroupReqInput,
        UpdateWeightsFromDistributedReqInput,
        DestroyWeightsUpdateGroupReqInput,
    )
    return isinstance(request, sync)
