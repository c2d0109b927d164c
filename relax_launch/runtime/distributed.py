"""Start torch.distributed for one rank, check that every rank planned the same job, and move
the trainer's batches over it (``ShardChannel``)."""

from __future__ import annotations

import math
import os
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from relax_launch import platform
from relax_launch.deadline import Deadline, wait_until
from relax_launch.placement.plan import PlacementPlan, TrainerLayout
from relax_launch.trainer.batch import ShardShape, TokenBatch

CONTROLLER = 0  # the rank that runs the program and sends every batch


class PlanMismatchError(RuntimeError):
    """Ranks computed different plans: the config differs between nodes."""


def init_distributed(device: platform.Device, timeout_s: float) -> dist.Store:
    """Join the default group and return a store for control traffic (a prefix of torchrun's)."""
    platform.bind_device(device, int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(platform.dist_backend(device), timeout=timedelta(seconds=timeout_s))
    # torchrun sets this so later tcp:// rendezvous become store clients: this process's
    # weight-sync groups would then wait forever for a server (SGLang's environment drops it in
    # platform.sglang_env).
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


def check_shared_directory(
    store: dist.Store, directory: Path, plan: PlacementPlan, rank: int, timeout_s: float
) -> None:
    """On several nodes, every rank must see the files rank 0 writes in ``directory`` (the
    checkpoints: rank 0 writes the controller's part, a trainer rank anywhere its shard, and a
    resume reads them all). Rank 0 writes a probe file; a rank that cannot see it fails naming
    the directory; rank 0 deletes the probe once every rank has looked."""
    if plan.nnodes == 1:
        return
    if rank == 0:
        directory.mkdir(parents=True, exist_ok=True)
        token = secrets.token_hex(8)
        (directory / f".relax-shared-{token}").write_text(token)
        store.set("shared/token", token)
    _wait(store, ["shared/token"], timeout_s, "rank 0's probe of checkpoint.dir")
    probe = directory / f".relax-shared-{store.get('shared/token').decode()}"
    seen = probe.is_file()
    store.set(f"shared/{rank}", "seen" if seen else "missing")
    if not seen:
        raise RuntimeError(
            f"checkpoint.dir={directory} is not shared between nodes: node "
            f"{plan.ranks[rank].node} does not see the file {probe.name} that rank 0 wrote on "
            f"node 0. Put checkpoint.dir on a filesystem every node mounts at the same path"
        )
    if rank == 0:
        _wait(store, [f"shared/{r}" for r in range(plan.world_size)], timeout_s, "every rank")
        probe.unlink()
        for key in ["shared/token", *(f"shared/{r}" for r in range(plan.world_size))]:
            store.delete_key(key)


def _wait(store: dist.Store, keys: list[str], timeout_s: float, what: str) -> None:
    if not wait_until(lambda: store.check(keys), timeout_s, interval_s=0.01):
        missing = [k for k in keys if not store.check([k])]
        raise TimeoutError(f"timed out after {timeout_s:.0f} s waiting for {what}: {missing}")


@dataclass
class Transfer:
    """Rank 0's receives of one command's results, posted until ``ShardChannel.finish`` (its
    sends completed in ``ShardChannel.start``)."""

    works: list[Any] = field(default_factory=list)
    results: list[tuple[int, torch.Tensor]] = field(default_factory=list)  # (source rank, buffer)


class ShardChannel:
    """Batch shards from rank 0 to the trainer ranks, per-token results back, over
    torch.distributed (the job's default group: gloo on the CPU, NCCL on GPUs).

    Rank 0 sends data-parallel shard ``d`` to the shard's first rank (tp 0, cp 0, pp 0 of DP
    rank ``d``) only, which broadcasts it to its tensor-, context- and pipeline-parallel peers
    (``peers``, every trainer rank of that DP rank); each DP rank's result rank (tp 0, cp 0 of
    the last stage) sends its rows back. Rank 0, when it is itself one of those ranks, hands
    itself its part in memory.
    Every receive is a torch.distributed op, under the process group's timeout.
    """

    def __init__(
        self,
        layout: TrainerLayout,
        rank: int,
        device: str,
        peers: Any | None,
        pixel_dtype: torch.dtype = torch.float32,
    ) -> None:
        self.layout, self.rank, self.device, self.peers = layout, rank, device, peers
        # images travel in the dtype the vision tower computes in (it casts them to it anyway)
        self.pixel_dtype = pixel_dtype
        self.held: dict[str, Any] = {}  # rank 0's own shard and result
        self.received_bytes = 0  # what this rank has taken in as a trainer rank

    def first_rank(self, dp_rank: int) -> int:
        return self.layout.rank_at(0, dp_rank, 0)

    def result_rank(self, dp_rank: int) -> int:
        return self.layout.rank_at(0, dp_rank, self.layout.pp_size - 1)

    @property
    def dp_rank(self) -> int:
        return self.layout.coordinates(self.rank)[1]

    def start(
        self,
        shards: list[TokenBatch],
        results: bool = False,
        *,
        failed: Callable[[int], object],
        timeout_s: float,
    ) -> Transfer:
        """Rank 0: send each DP rank's shard to its first rank, one DP rank at a time, each
        shard's sends completed before the next shard's device copy is made: rank 0's device
        holds at most one other DP rank's shard, and none once ``start`` returns (before its own
        step). The receivers take them at once: every first rank is in ``receive`` as the
        command starts, and rank 0's own peers wait in their broadcast, which none of these
        sends needs. A first rank that fails before its receive never takes its shard but
        replies with its error: ``failed(rank)`` raises it if so (``ControlChannel.raise_failed``),
        polled while its sends wait; they all complete within ``timeout_s``, or this raises.
        With ``results``, post the receives of each DP rank's per-token values
        (before the ranks compute them), after that rank's sends: point-to-point ops with one
        peer run in order on one NCCL stream, so a receive posted first would hold the sends
        behind it. They stay posted until ``finish``."""
        transfer, deadline = Transfer(), Deadline(timeout_s)
        for dp, shard in enumerate(shards):
            first = self.first_rank(dp)
            if first == self.rank:
                self.held["shard"] = shard.pack(self.pixel_dtype)
            else:
                self._send(shard.pack(self.pixel_dtype), first, deadline, failed)
            if results:
                shape, source = shard.shape(), self.result_rank(dp)
                buffer = torch.empty(shape.tokens - shape.sequences, device=self.device)
                if source != self.rank:
                    transfer.works.append(dist.irecv(buffer, src=source))
                transfer.results.append((source, buffer))
        return transfer

    def _send(
        self,
        tensors: tuple[torch.Tensor, ...],
        dst: int,
        deadline: Deadline,
        failed: Callable[[int], object],
    ) -> None:
        """Send ``tensors`` to ``dst`` from device copies, freed once the sends completed.
        Given up on (``dst`` failed), the sends stay posted, their copies held by the process
        group: the job is failing anyway. Rank 0's program raises ``dst``'s error, the job
        records it as its cause and ends (``job.report_failure``), and the group's teardown (or
        NCCL's watchdog, at the group's timeout) drops them."""
        copies = [tensor.to(self.device) for tensor in tensors]
        works = [dist.isend(copy, dst=dst) for copy in copies]
        device = torch.device(self.device)
        if not platform.wait_sent(works, device, deadline.left(), lambda: failed(dst)):
            raise TimeoutError(
                f"rank {self.rank}: rank {dst} did not receive its shard within "
                f"{deadline.timeout_s:.0f} s (cluster.collective_timeout_s) of the command's "
                "start, nor reply with an error: it is busy or hung (see its log)"
            )

    def finish(self, transfer: Transfer) -> list[torch.Tensor]:
        """Rank 0: wait for the transfer's receives; each DP rank's per-token values, if asked
        for."""
        for work in transfer.works:
            work.wait()
        return [
            self.held.pop("result") if source == self.rank else buffer
            for source, buffer in transfer.results
        ]

    def receive(self, shape: ShardShape) -> TokenBatch:
        """A trainer rank: this DP rank's shard, of ``shape``."""
        first = self.first_rank(self.dp_rank)
        if self.rank == first == CONTROLLER:
            tensors = tuple(t.to(self.device) for t in self.held.pop("shard"))
        else:
            tensors = shape.empty(self.device, self.pixel_dtype)
            if self.rank == first:
                for tensor in tensors:
                    dist.recv(tensor, src=CONTROLLER)
        if self.peers is not None and self.peers.size() > 1:
            for tensor in tensors:
                dist.broadcast(tensor, src=first, group=self.peers)
        self.received_bytes += sum(t.numel() * t.element_size() for t in tensors)
        return TokenBatch.unpack(tensors[0], tensors[1], shape, *tensors[2:])

    def send_result(self, rows: list[list[float]] | None, shape: ShardShape) -> None:
        """A trainer rank: on its DP rank's result rank, the shard's per-token values, row after
        row, to rank 0; NaN when they could not be computed, so rank 0's receive still ends."""
        if self.rank != self.result_rank(self.dp_rank):
            return
        values = torch.full((shape.tokens - shape.sequences,), math.nan)
        if rows is not None:
            values = torch.tensor([v for row in rows for v in row], dtype=torch.float32)
        if self.rank == CONTROLLER:
            self.held["result"] = values
        else:
            dist.send(values.to(self.device), dst=CONTROLLER)
