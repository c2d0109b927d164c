"""Benchmark: one train step's batch from the controller to the trainer ranks, old and new path.

A synthetic RL batch of 2M tokens (512 sequences x 4,096 tokens; token ids, loss mask, per-token
weights and old logprobs, as ``TokenBatch`` carries them) goes from rank 0 (the controller, not a
trainer rank) to 4 trainer ranks in DP=4, in a 5-rank gloo torchrun on this machine:
  old  the path of commit 26762ce: the batch, as a dict of tuples, pickled into one store key
       that every trainer rank reads whole, unpickles and then takes its DP quarter of; the store
       keeps every key (reproduced below from that commit's runtime/control.py). torch 2.13's
       default store server (libuv, as torchrun's) refuses a value over 8 MiB, and this batch
       pickles to about 63 MB: the old path fails outright at this size. It is timed here over a
       store on rank 0 with the legacy TCP backend, which takes it.
  new  relax-launch's trainer channel: a small typed command record through the store (deleted
       once taken); each DP rank's shard, packed into two flat tensors, over torch.distributed
A step is timed on rank 0 from the batch in hand until every trainer rank has replied holding
its shard as a ``TokenBatch`` (no training). Paths alternate in rounds, so a slow spell of the
shared machine hits both; the first step of each path is a warm-up. Prints seconds per step
(median and range), the ratio, and the bytes each path puts through the store per step.
Run: ``.venv/bin/python bench/trainer_channel.py [--rounds 3] [--steps 2]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pickle
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from relax_launch import platform
from relax_launch.inference.process import free_port
from relax_launch.placement.plan import TrainerLayout
from relax_launch.runtime.control import ControlChannel, Shutdown
from relax_launch.runtime.distributed import ShardChannel, init_distributed
from relax_launch.runtime.groups import build_trainer_groups
from relax_launch.runtime.session import TrainerClient
from relax_launch.runtime.workers import TrainerWorker
from relax_launch.trainer.batch import TokenBatch

SEQUENCES, LENGTH, PROMPT = 512, 4096, 512  # 2,097,152 tokens
DP = 4
LAYOUT = TrainerLayout(tuple(range(1, 1 + DP)), 1, 1, DP, "train")


def synthetic_batch() -> TokenBatch:
    tokens = torch.randint(0, 50_000, (SEQUENCES, LENGTH))
    mask = (torch.arange(LENGTH) >= PROMPT).float().expand(SEQUENCES, LENGTH)
    weights = torch.randn(SEQUENCES, 1) * mask
    old = -torch.rand(SEQUENCES, LENGTH) * 5 * mask

    def rows(t: torch.Tensor) -> tuple[tuple, ...]:
        return tuple(map(tuple, t.tolist()))

    return TokenBatch(rows(tokens), rows(mask), rows(weights), rows(old))


class OldChannel:
    """The store transport of commit 26762ce (runtime/control.py), its call and serve only."""

    def __init__(self, store: dist.Store, rank: int) -> None:
        self.store, self.rank, self.next_id = store, rank, 0
        self.payload_bytes = 0

    def call(self, op: str, ranks: list[int], **kwargs) -> dict[int, object]:
        n = self.next_id = self.next_id + 1
        record = pickle.dumps((op, ranks, kwargs))
        self.payload_bytes = max(self.payload_bytes, len(record))
        self.store.set(f"control/cmd/{n}", record)
        keys = {r: f"control/reply/{n}/{r}" for r in ranks}
        while not self.store.check(list(keys.values())):
            time.sleep(0.002)
        return {r: pickle.loads(self.store.get(k)) for r, k in keys.items()}

    def serve(self, handlers: dict) -> None:
        while True:
            n = self.next_id = self.next_id + 1
            key = f"control/cmd/{n}"
            while not self.store.check([key]):
                time.sleep(0.005)
            op, ranks, kwargs = pickle.loads(self.store.get(key))
            if self.rank in ranks:
                value = handlers[op](**kwargs) if op in handlers else None
                self.store.set(f"control/reply/{n}/{self.rank}", pickle.dumps(value))
            if op == "shutdown":
                return


class HoldShard:
    """Stands in for the trainer: the step ends once the rank holds its shard."""

    def train_step(self, shard: TokenBatch, spec=None) -> dict[str, int]:
        return {"sequences": len(shard)}


def old_train_step(batch: dict, spec=None) -> int:
    """The old trainer rank: rebuild the whole batch, then take its DP quarter."""
    whole = TokenBatch(**batch)
    dp_rank = LAYOUT.coordinates(int(os.environ["RANK"]))[1]
    per_rank = len(whole) // DP
    return len(whole.select(range(dp_rank * per_rank, (dp_rank + 1) * per_rank)))


def timed(fn) -> float:
    began = time.perf_counter()
    fn()
    return time.perf_counter() - began


def controller(args, new: ControlChannel, client: TrainerClient, old: OldChannel) -> dict:
    batch = synthetic_batch()
    trainers = list(LAYOUT.ranks)

    def old_step() -> None:
        replies = old.call("trainer.train_step", trainers, batch=dataclasses.asdict(batch))
        assert sorted(replies.values()) == [SEQUENCES // DP] * DP

    def new_step() -> None:
        assert client.train_step(batch)["sequences"] == SEQUENCES // DP

    seconds = {"old": [], "new": [], "pack": []}
    for round_ in range(args.rounds + 1):
        for name, step in (("new", new_step), ("old", old_step)):
            times = [timed(step) for _ in range(1 if round_ == 0 else args.steps)]
            if round_:  # round 0 warms both paths up
                seconds[name] += times
                if name == "new":  # the part of a new step that is rank 0 packing the shards
                    seconds["pack"].append(timed(lambda: [s.pack() for s in batch.shards(DP)]))
            if name == "new":
                new.call(Shutdown(), range(1, 1 + DP))
            else:
                old.call("shutdown", trainers)
    return {"seconds": seconds, "old_store_bytes_per_step": old.payload_bytes}


def worker(args) -> None:
    rank = int(os.environ["RANK"])
    store = init_distributed("cpu", 600)
    pgc = build_trainer_groups(LAYOUT, platform.dist_backend("cpu"))
    shards = ShardChannel(LAYOUT, rank, "cpu", pgc.mp if pgc is not None else None)
    roles = {r: "controller" if r == 0 else "trainer" for r in range(1 + DP)}
    new = ControlChannel(store, rank=rank, roles=roles, timeout_s=600)
    old_store = dist.TCPStore(
        "127.0.0.1", args.old_store_port, 1 + DP, rank == 0, timedelta(seconds=600), use_libuv=False
    )
    old = OldChannel(old_store, rank)
    if rank == 0:
        client = TrainerClient(new, shards, LAYOUT, {})
        report = controller(args, new, client, old)
        Path(args.out).write_text(json.dumps(report))
    else:
        handlers = TrainerWorker(
            trainer=HoldShard(), shards=shards, device="cpu", host="127.0.0.1"
        ).handlers()
        for _ in range(args.rounds + 1):
            new.serve(handlers)
            old.serve({"trainer.train_step": old_train_step})
    new.close()
    dist.destroy_process_group()


def summary(report: dict) -> str:
    old, new, pack = (report["seconds"][k] for k in ("old", "new", "pack"))

    def line(name: str, times: list[float]) -> str:
        return (
            f"  {name}  {statistics.median(times):7.3f} s/step  "
            f"(min {min(times):.3f}, max {max(times):.3f}, {len(times)} steps)"
        )

    megabytes = report["old_store_bytes_per_step"] / 1e6
    return "\n".join(
        [
            f"2M-token batch ({SEQUENCES} x {LENGTH}) from rank 0 to {DP} trainer ranks (DP={DP}),"
            " 5-rank gloo torchrun",
            line("old", old),
            line("new", new),
            f"        of which rank 0 packing the shards into tensors: "
            f"{statistics.median(pack):.3f} s (median)",
            f"  old / new: {statistics.median(old) / statistics.median(new):.1f}x; old path puts "
            f"{megabytes:.0f} MB per step in the store (read {DP}x, never deleted)",
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=2, help="steps per path per round")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--old-store-port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "report.json"
        torchrun = Path(sys.executable).with_name("torchrun")
        command = [str(torchrun), "--nproc-per-node", str(1 + DP)]
        command += ["--master-port", str(free_port()), __file__, "--worker", "--out", str(out)]
        command += ["--rounds", str(args.rounds), "--steps", str(args.steps)]
        command += ["--old-store-port", str(free_port())]
        subprocess.run(command, check=True, timeout=3600)
        report = json.loads(out.read_text())
    print(summary(report))
    print(json.dumps(report))


if __name__ == "__main__":
    main()
