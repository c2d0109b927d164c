"""torchrun worker: PPO's value model (``trainer/critic.py``) on two CPU trainer ranks, driven
from rank 0 through the real control channel, shard channel and ``CriticWorker`` handlers.

argv: model_dir, tp (2: TP=2 x DP=1; 1: TP=1 x DP=2), dtype. Rank 0 prints one JSON line:

- ``initial``: the per-token values of a fixed batch before any step (the same in every
  layout if the head sees the whole hidden state);
- ``losses``, ``clip_fractions``, ``grad_norms``: 6 steps of the clipped value loss towards
  fixed returns, V_old re-scored before each step as the RL loop does;
- ``saved_after`` 3 steps into a checkpoint directory; every rank then rebuilds a fresh value
  model, loads it and replays steps 4-6: ``resumed_losses`` and ``resumed_values``, which must
  equal the first run's (``final_values``);
- ``stale_clip_fractions``: 3 steps towards tripled returns with V_old fixed before the first
  (as ``critic.mini_batches`` does): the first cannot clip, the later ones do;
- ``parameters`` (the value model's on rank 0) and ``planned_parameters`` (the memory plan's:
  ``placement/critic_memory.py``), ``dp_all_reduces`` (a train step's on the data-parallel
  group), ``load_copied_bytes`` (the tensors ``Critic.load`` copied: only the optimizer state
  it keeps, ``optimizer_state_bytes``; the rest is copied into the live tensors).
"""

import json
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from relax_launch import platform
from relax_launch.models.sizes import model_size
from relax_launch.placement.critic_memory import critic_params
from relax_launch.placement.plan import TrainerLayout
from relax_launch.rl.critic_config import CriticConfig
from relax_launch.runtime.control import Command, ControlChannel, Shutdown
from relax_launch.runtime.critic_worker import CriticClient, CriticWorker
from relax_launch.runtime.distributed import ShardChannel, init_distributed
from relax_launch.runtime.groups import build_trainer_groups
from relax_launch.trainer.batch import TokenBatch
from relax_launch.trainer.config import TrainerConfig
from relax_launch.trainer.critic import Critic
from relax_launch.trainer.critic_loss import critic_batch

STEPS, SAVED_AFTER, CLIP = 6, 3, 0.2
STALE_STEPS, STALE_CLIP = 3, 0.05  # a clip the values outgrow within a step


@dataclass(frozen=True)
class Rebuild(Command):
    op: ClassVar[str] = "test.rebuild_critic"


def fixed_batch() -> tuple[TokenBatch, list[list[float]]]:
    """4 sequences, and returns per target: +1 on the even ones' responses, -1 on the odd."""
    gen = torch.Generator().manual_seed(3)
    tokens = [torch.randint(6, 320, (n,), generator=gen).tolist() for n in (9, 12, 7, 10)]
    batch = TokenBatch.next_token(tokens, [3, 4, 2, 5])
    returns = [
        [(1.0 if i % 2 == 0 else -1.0) * m for m in mask[1:]]
        for i, mask in enumerate(batch.loss_mask)
    ]
    return batch, returns


@contextmanager
def counted_all_reduces(group) -> Iterator[list[int]]:
    """The all-reduces rank 0 makes on ``group`` meanwhile (count in the list's one item)."""
    count, real = [0], dist.all_reduce

    def counting(tensor, *args, **kwargs):
        count[0] += kwargs.get("group") is group
        return real(tensor, *args, **kwargs)

    dist.all_reduce = counting
    try:
        yield count
    finally:
        dist.all_reduce = real


class CopiedBytes(TorchDispatchMode):
    """The bytes of the tensors that copies (clone, to) create meanwhile on this rank."""

    COPIES = (torch.ops.aten.clone.default, torch.ops.aten._to_copy.default)

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in self.COPIES:
            self.bytes += out.numel() * out.element_size()
        return out


def optimizer_state_bytes(optimizer) -> int:
    return sum(
        v.numel() * v.element_size()
        for part in optimizer.chained_optimizers
        for per_param in part.optimizer.state.values()
        for v in per_param.values()
        if isinstance(v, torch.Tensor)
    )


def drive(client: CriticClient, channel: ControlChannel, layout, directory: str, local) -> dict:
    batch, returns = fixed_batch()
    report: dict = {"initial": client.values(batch)}
    losses, clips, norms = [], [], []
    for step in range(STEPS):
        old = client.values(batch)
        with counted_all_reduces(local["dp_group"]) as reduces:
            metrics = client.train(
                critic_batch(batch, [[0.0, *r] for r in returns], [[0.0, *v] for v in old]), CLIP
            )
        report["dp_all_reduces"] = reduces[0]
        losses.append(metrics["critic/value_loss"])
        clips.append(metrics["critic/clip_fraction"])
        norms.append(metrics["critic/grad_norm"])
        if step + 1 == SAVED_AFTER:
            report["saved_files"] = client.save(directory)
    report["final_values"] = client.values(batch)
    channel.call(Rebuild(), layout.ranks, local[Rebuild.op])
    with CopiedBytes() as copied:
        report["loaded_steps"] = client.load(directory)
    report["load_copied_bytes"] = copied.bytes
    report["optimizer_state_bytes"] = optimizer_state_bytes(local["worker"].critic.optimizer)
    resumed = []
    for _ in range(STEPS - SAVED_AFTER):
        old = client.values(batch)
        metrics = client.train(
            critic_batch(batch, [[0.0, *r] for r in returns], [[0.0, *v] for v in old]), CLIP
        )
        resumed.append(metrics["critic/value_loss"])
    report |= {"losses": losses, "clip_fractions": clips, "grad_norms": norms}
    report |= {"resumed_losses": resumed, "resumed_values": client.values(batch)}
    # updates against the values from before the first (critic.mini_batches): the later ones
    # move values already moved, and the clip binds where they went past V_old +- STALE_CLIP
    report["new_returns"] = [[3 * r for r in row] for row in returns]
    stale = [[0.0, *v] for v in client.values(batch)]
    flipped = critic_batch(batch, [[0.0, *r] for r in report["new_returns"]], stale)
    report["stale_clip_fractions"] = [
        client.train(flipped, STALE_CLIP)["critic/clip_fraction"] for _ in range(STALE_STEPS)
    ]
    report["stale_values"] = client.values(batch)
    return report


def main() -> None:
    torch.set_num_threads(1)
    model_dir, tp, dtype = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    store = init_distributed("cpu", 60)
    rank, world = dist.get_rank(), dist.get_world_size()
    layout = TrainerLayout(
        tuple(range(world)), tp_size=tp, pp_size=1, dp_size=world // tp, phase="train"
    )
    pgc = build_trainer_groups(layout, platform.dist_backend("cpu"))
    platform.prepare_megatron("cpu")
    trainer = TrainerConfig(model=model_dir, ranks=world, tp_size=tp, dtype=dtype)
    section = CriticConfig(lr=1e-3, micro_batch_size=1).trainer_section(trainer)

    def build() -> Critic:
        return Critic(section=section, model_dir=Path(model_dir), pgc=pgc, device="cpu")

    shards = ShardChannel(layout, rank, "cpu", pgc.mp)
    worker = CriticWorker(critic=build(), shards=shards)
    handlers = worker.handlers()
    handlers[Rebuild.op] = lambda c: setattr(worker, "critic", build())
    handlers["dp_group"], handlers["worker"] = pgc.dp, worker  # for the report, not commands
    channel = ControlChannel(
        store, rank=rank, roles=dict.fromkeys(layout.ranks, "trainer"), timeout_s=120
    )
    if rank == 0:
        with tempfile.TemporaryDirectory() as directory:
            client = CriticClient(channel, shards, layout, handlers)
            report = drive(client, channel, layout, directory, handlers)
            size = model_size(model_dir)
            report["planned_parameters"] = critic_params(size, 0, 1, tp, 1)
            module = worker.critic.model.module
            report["parameters"] = sum(p.numel() for p in module.parameters())
            channel.call(Shutdown(), layout.ranks)
        print(json.dumps({"rank": 0, **report}), flush=True)
    else:
        channel.serve(handlers)
    channel.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
