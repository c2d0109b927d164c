"""torchrun worker for the trainer-channel test: the real control and shard channels over gloo,
the real trainer worker's handlers, and a stand-in trainer that records what it is given.

usage: torchrun --nproc-per-node N channel_worker.py OUT_DIR FIRST_TRAINER_RANK TP DP PP
Rank 0 sends STEPS train steps and one logprobs call through a ``TrainerClient``, each on a new
batch, and reports the batches, the store's key count and bytes after each step, the metrics and
logprobs it got back. Each trainer rank reports the shards it was given and the bytes it took in.
Every rank writes ``rank{R}.json``, with the largest record it put in the store.
"""

import json
import os
import random
import sys
from pathlib import Path

import torch.distributed as dist

from relax_launch import platform
from relax_launch.placement.plan import TrainerLayout
from relax_launch.runtime.control import ControlChannel, Shutdown
from relax_launch.runtime.distributed import ShardChannel, init_distributed
from relax_launch.runtime.groups import build_trainer_groups
from relax_launch.runtime.session import TrainerClient
from relax_launch.runtime.workers import TrainerWorker
from relax_launch.trainer.batch import TokenBatch

STEPS = 10
SEQUENCES_PER_DP_RANK = 3


class RecordingStore:
    """The store, noting the largest value this rank sets in it."""

    def __init__(self, store):
        self.store, self.largest = store, 0

    def set(self, key, value):
        self.largest = max(self.largest, len(value))
        self.store.set(key, value)

    def multi_set(self, keys, values):
        self.largest = max([self.largest, *map(len, values)])
        self.store.multi_set(keys, values)

    def __getattr__(self, name):
        return getattr(self.store, name)


class RecordingTrainer:
    """Stands in for ``Trainer``: records each shard; a row's logprobs are its token ids / 1024."""

    def __init__(self, last_stage: bool):
        self.last_stage, self.shards = last_stage, []

    def train_step(self, shard, spec=None):
        self.shards.append([list(map(list, rows or ())) for rows in shard.__dict__.values()])
        return {"sequences": len(shard), "first_token": shard.tokens[0][0]}

    def logprobs(self, shard):
        self.shards.append([list(map(list, rows or ())) for rows in shard.__dict__.values()])
        if not self.last_stage:
            return None
        return [[t / 1024 for t in tokens[1:]] for tokens in shard.tokens]


def make_batch(step: int, sequences: int) -> TokenBatch:
    rng = random.Random(step)
    tokens = [
        [rng.randrange(1, 500) for _ in range(rng.randrange(2, 40))] for _ in range(sequences)
    ]
    batch = TokenBatch.next_token(tokens, [1] * sequences)
    if step % 2:  # PPO batches carry old logprobs too
        old = tuple(tuple(-t / 64 for t in row) for row in tokens)  # exact in float32
        batch = TokenBatch(batch.tokens, batch.loss_mask, batch.token_weights, old)
    return batch


def footprint(store) -> list[int]:
    """The whole store's key count and the bytes of every value in it."""
    keys = store.list_keys()
    return [store.num_keys(), sum(len(store.get(k)) for k in keys)]


def controller(client: TrainerClient, layout: TrainerLayout, raw_store) -> dict:
    report = {"batches": [], "footprints": [], "metrics": []}
    for step in range(STEPS + 1):
        batch = make_batch(step, SEQUENCES_PER_DP_RANK * layout.dp_size)
        report["batches"].append([list(map(list, rows or ())) for rows in batch.__dict__.values()])
        if step < STEPS:
            report["metrics"].append(client.train_step(batch))
        else:
            report["logprobs"] = client.logprobs(batch)
        report["footprints"].append(footprint(raw_store))
    return report


def main() -> None:
    out = Path(sys.argv[1])
    first, tp, dp, pp, cp = map(int, sys.argv[2:7])
    rank = int(os.environ["RANK"])
    store = RecordingStore(init_distributed("cpu", 60))
    world = dist.get_world_size()
    ranks = tuple(range(first, first + tp * cp * dp * pp))
    layout = TrainerLayout(ranks, tp, pp, dp, "train", cp_size=cp)
    pgc = build_trainer_groups(layout, platform.dist_backend("cpu"))
    roles = {r: "trainer" if r in layout.ranks else "controller" for r in range(world)}
    shards = ShardChannel(layout, rank, "cpu", pgc.shard_peers if pgc is not None else None)
    channel = ControlChannel(store, rank=rank, roles=roles, timeout_s=60)
    trainer = None
    handlers = {}
    if rank in layout.ranks:
        trainer = RecordingTrainer(layout.coordinates(rank)[2] == pp - 1)
        worker = TrainerWorker(trainer=trainer, shards=shards, device="cpu", host="127.0.0.1")
        handlers = worker.handlers()
    report = {}
    if rank == 0:
        client = TrainerClient(channel, shards, layout, handlers)
        report = controller(client, layout, dist.distributed_c10d._get_default_store())
        channel.call(Shutdown(), range(world))
    else:
        channel.serve(handlers)
    channel.close()
    if trainer is not None:
        report |= {"shards": trainer.shards, "received_bytes": shards.received_bytes}
    report["largest_record"] = store.largest
    (out / f"rank{rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
