"""TrainerClient: rank 0's typed proxy for the trainer ranks. Each method sends one small command
record to every trainer rank; a batch goes alongside over the ``ShardChannel``, each
data-parallel rank receiving only its shard, and per-token results come back the same way,
never through the store."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from relax_launch.placement.plan import TrainerLayout
from relax_launch.runtime.control import Command, ControlChannel, Handler, Posted
from relax_launch.runtime.distributed import ShardChannel, Transfer
from relax_launch.runtime.rank_commands import (
    ExportTrainer,
    LoadTrainer,
    Logprobs,
    OffloadTrainer,
    OnloadTrainer,
    SaveTrainer,
    TrainStep,
)
from relax_launch.trainer.batch import TokenBatch
from relax_launch.trainer.losses import LossSpec
from relax_launch.trainer.offload import CHANGED, PARTS


class TrainerClient:
    """Rank 0's typed proxy for the trainer ranks: each method sends one small command record to
    every trainer rank; a batch goes alongside over the ``ShardChannel``, each data-parallel rank
    receiving only its shard, and per-token results come back the same way."""

    def __init__(
        self,
        channel: ControlChannel,
        shards: ShardChannel,
        layout: TrainerLayout,
        local: dict[str, Handler],
    ) -> None:
        self.channel, self.shards, self.layout, self.local = channel, shards, layout, local

    def train_step(self, batch: TokenBatch, spec: LossSpec | None = None) -> dict[str, float]:
        """One optimizer step; the metrics of the last pipeline stage's first rank."""
        shards = batch.shards(self.layout.dp_size)
        command = TrainStep(tuple(s.shape() for s in shards), spec)
        return self._with_shards(command, shards)[0][self._last_stage_rank()]

    def logprobs(self, batch: TokenBatch) -> list[list[float]]:
        """Per-token logprobs of ``tokens[1:]`` of every sequence, in batch order."""
        shards = batch.shards(self.layout.dp_size)
        command = Logprobs(tuple(s.shape() for s in shards))
        return self._per_token(command, shards)

    def _per_token(self, command: Command, shards: list[TokenBatch]) -> list[list[float]]:
        """``command``'s per-token results (one per position of ``tokens[:-1]``), every DP
        rank's come back over the shard channel; rows in batch order."""
        _, results = self._with_shards(command, shards, results=True)
        rows = []
        for shard, values in zip(shards, results, strict=True):
            flat, start = values.tolist(), 0
            for tokens in shard.tokens:
                rows.append(flat[start : start + len(tokens) - 1])
                start += len(tokens) - 1
        return rows

    def save(self, directory: str) -> list[str]:
        """Every trainer shard writes its state into ``directory``; returns the files."""
        replies = self._call(SaveTrainer(directory))
        return [path for path in replies.values() if path]

    def export_hf(self, directory: str, dtype: str) -> dict[str, str]:
        """Every pipeline stage writes its Hugging Face shards into ``directory``; returns
        {HF tensor name: file} of them all."""
        weight_map: dict[str, str] = {}
        for stage_map in self._call(ExportTrainer(directory, dtype)).values():
            weight_map |= stage_map
        return weight_map

    def load(self, directory: str) -> int:
        """Every trainer rank restores its shard; returns the optimizer steps restored."""
        return min(self._call(LoadTrainer(directory)).values())

    def offload(self, parts: Iterable[str] = PARTS) -> dict[str, float]:
        """Every trainer rank moves these parts of its state ("params", "grads", "optimizer") to
        host memory; returns the bytes moved (summed over ranks) and the slowest rank's seconds."""
        return moved_by_ranks(self._call(OffloadTrainer(tuple(parts))))

    def onload(self, parts: Iterable[str] = PARTS) -> dict[str, float]:
        """Every trainer rank brings these offloaded parts back; same reply as ``offload``."""
        return moved_by_ranks(self._call(OnloadTrainer(tuple(parts))))

    def _call(self, command: Command) -> dict[int, Any]:
        return self.channel.call(command, self.layout.ranks, self.local.get(command.route))

    def _with_shards(
        self, command: Command, shards: list[TokenBatch], results: bool = False
    ) -> tuple[dict[int, Any], list[Any]]:
        """Post ``command``, send the shards while the ranks take it, collect the replies."""
        posted = self.channel.post(command, self.layout.ranks)
        transfer = self._send_shards(posted, shards, results)
        replies = self.channel.collect(posted, self.local.get(command.route))
        return replies, self.shards.finish(transfer)

    def _send_shards(
        self, posted: Posted, shards: list[TokenBatch], results: bool = False
    ) -> Transfer:
        """Send ``posted``'s shards (``ShardChannel.start``); a receiving rank that replies
        with its error meanwhile raises it at once, not once its send timed out."""

        def failed(rank: int) -> None:
            self.channel.raise_failed(posted, [rank])

        return self.shards.start(shards, results, failed=failed, timeout_s=self.channel.timeout_s)

    def _last_stage_rank(self) -> int:
        return self.layout.pp_stage_source(self.layout.pp_size - 1)


def moved_by_ranks(replies: dict[int, dict[str, float]]) -> dict[str, float]:
    """Trainer ranks' offload/onload replies as one: bytes summed, seconds of the slowest, and
    ``changed/<part>`` for a part any rank moved (``offload.move_parts``)."""
    changed = {key: 1.0 for r in replies.values() for key in r if key.startswith(CHANGED)}
    return {
        "bytes": sum(r["bytes"] for r in replies.values()),
        "seconds": max(r["seconds"] for r in replies.values()),
    } | changed
