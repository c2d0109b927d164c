"""torchrun worker: one PPO train step of the real Trainer (Megatron-core, CPU, fp32) on the same
global batch, split into micro-batches of each size given, over this world's data parallelism.

argv: model_dir out_dir micro_batch_size... Every rank is a trainer rank (DP = the
world size, TP = PP = 1). For each loss aggregation and micro-batch size, rank 0 saves the
gradients the step made and the loss it reported to out_dir/{aggregation}_dp{world}_mbs{size}.pt.
"""

import itertools
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from relax_launch import platform
from relax_launch.placement.plan import TrainerLayout
from relax_launch.runtime.groups import build_trainer_groups
from relax_launch.trainer.batch import TokenBatch
from relax_launch.trainer.config import TrainerConfig
from relax_launch.trainer.losses import LossSpec

# Four sequences of different lengths and loss-mask sizes: a mean per micro-batch would weight
# their tokens differently than the mean over the batch.
TOKENS = [
    [1, 7, 42, 9, 77, 13, 5, 8, 200, 31, 4, 6],
    [1, 11, 12, 99],
    [1, 3, 250, 6, 17, 64, 2, 90],
    [1, 5, 9, 33, 41, 70, 88],
]
PROMPT = [2, 1, 5, 3]


def batch() -> TokenBatch:
    generator = torch.Generator().manual_seed(0)
    masks = tuple(
        tuple(float(j >= n) for j in range(len(t))) for t, n in zip(TOKENS, PROMPT, strict=True)
    )
    advantages = tuple(tuple(torch.randn(len(t), generator=generator).tolist()) for t in TOKENS)
    old = tuple(tuple((-torch.rand(len(t), generator=generator) * 6).tolist()) for t in TOKENS)
    return TokenBatch(tuple(map(tuple, TOKENS)), masks, advantages, old)


def main() -> None:
    model_dir, out_dir = sys.argv[1], Path(sys.argv[2])
    dist.init_process_group(platform.dist_backend("cpu"))
    world = dist.get_world_size()
    layout = TrainerLayout(
        ranks=tuple(range(world)), tp_size=1, pp_size=1, dp_size=world, phase="train"
    )
    pgc = build_trainer_groups(layout, platform.dist_backend("cpu"))
    platform.prepare_megatron("cpu")
    from relax_launch.trainer.trainer import Trainer

    shard = batch().shards(world)[dist.get_rank()]
    for aggregation, micro in itertools.product(("token", "sequence"), map(int, sys.argv[3:])):
        section = TrainerConfig(
            model=model_dir,
            ranks=world,
            micro_batch_size=micro,
            lr=1e-3,
            clip_grad=0.0,
            dtype="float32",
        )
        trainer = Trainer(section=section, model_dir=Path(model_dir), pgc=pgc, device="cpu")
        metrics = trainer.train_step(shard, LossSpec(aggregation=aggregation))
        grads = {n: p.main_grad.clone() for n, p in trainer.model.module.named_parameters()}
        if dist.get_rank() == 0:
            torch.save(
                {"grads": grads, "metrics": metrics},
                out_dir / f"{aggregation}_dp{world}_mbs{micro}.pt",
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
