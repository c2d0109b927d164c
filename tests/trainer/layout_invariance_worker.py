"""torchrun worker: the real Trainer (Megatron-core, CPU, fp32) on one ragged batch under
several micro-batch layouts; what each gives must not depend on the layout.

argv: out_dir model_dir... then variants as NAME=key:value,key:value (TrainerConfig fields;
``-`` for none). Every rank is a trainer rank: the world is split by the variant's cp_size
(DP = world / cp_size). For each model and variant, rank 0 saves to
out_dir/{model name}/{variant}.pt the batch's logprobs (before the step), each rank's
micro-batch count, and for each loss
the gradients a PPO step made (of rank 0's pipeline stage) and the loss it reported (the last
stage's, gathered).
"""

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

# Ragged: 3 to 41 tokens, prompts of different lengths, so layouts pad and pack differently.
LENGTHS = [41, 4, 17, 9, 30, 3, 12, 25]
PROMPTS = [3, 1, 5, 2, 4, 1, 6, 2]
LOSSES = {  # per-token, and every per-sequence operation (GSPO ratio, mean per sequence, MIS)
    "token": LossSpec(),
    "sequence": LossSpec(aggregation="sequence", ratio="sequence", correction="sequence_mis"),
}


def batch() -> TokenBatch:
    generator = torch.Generator().manual_seed(0)
    tokens = [torch.randint(3, 250, (n,), generator=generator).tolist() for n in LENGTHS]
    masks = tuple(
        tuple(float(j >= p) for j in range(len(t))) for t, p in zip(tokens, PROMPTS, strict=True)
    )
    advantages = tuple(tuple(torch.randn(len(t), generator=generator).tolist()) for t in tokens)
    old = tuple(tuple((-torch.rand(len(t), generator=generator) * 6).tolist()) for t in tokens)
    return TokenBatch(tuple(map(tuple, tokens)), masks, advantages, old)


def parse(variant: str) -> tuple[str, dict]:
    name, _, fields = variant.partition("=")
    settings = {}
    for item in filter(None, fields.split(",")) if fields != "-" else ():
        key, _, value = item.partition(":")
        settings[key] = value == "true" if value in ("true", "false") else int(value)
    return name, settings


def run(model_dir: str, name: str, settings: dict, out: Path) -> None:
    from relax_launch.trainer.trainer import Trainer

    world, cp, pp = dist.get_world_size(), settings.get("cp_size", 1), settings.get("pp_size", 1)
    layout = TrainerLayout(
        ranks=tuple(range(world)),
        tp_size=1,
        pp_size=pp,
        dp_size=world // (cp * pp),
        phase="train",
        cp_size=cp,
        ep_size=settings.get("ep_size", 1),
    )
    pgc = build_trainer_groups(layout, platform.dist_backend("cpu"))
    shard = batch().shards(layout.dp_size)[layout.coordinates(dist.get_rank())[1]]
    saved = {}
    for loss, spec in LOSSES.items():
        section = TrainerConfig(
            model=model_dir, ranks=world, lr=1e-3, clip_grad=0.0, dtype="float32", **settings
        )
        trainer = Trainer(section=section, model_dir=Path(model_dir), pgc=pgc, device="cpu")
        rows = trainer.logprobs(shard)
        gathered = [None] * world
        dist.all_gather_object(gathered, rows if layout.cp_rank(dist.get_rank()) == 0 else None)
        # rank 0 holds the first pipeline stage's gradients, the last stage the logprobs
        saved["logprobs"] = [row for part in gathered if part for row in part]
        counts = [None] * world
        dist.all_gather_object(counts, len(trainer._micro_batches(shard)))
        saved["micro_batches"] = counts
        metrics = trainer.train_step(shard, spec)
        reported = [None] * world
        dist.all_gather_object(reported, metrics.get("loss"))
        metrics["loss"] = next(r for r in reported if r is not None)
        saved[loss] = {
            "grads": {n: p.main_grad.clone() for n, p in trainer.model.module.named_parameters()},
            "metrics": metrics,
        }
    if dist.get_rank() == 0:
        (out / Path(model_dir).name).mkdir(parents=True, exist_ok=True)
        torch.save(saved, out / Path(model_dir).name / f"{name}.pt")


def main() -> None:
    out = Path(sys.argv[1])
    models = [a for a in sys.argv[2:] if "=" not in a]
    variants = [parse(a) for a in sys.argv[2:] if "=" in a]
    dist.init_process_group(platform.dist_backend("cpu"))
    platform.prepare_megatron("cpu")
    for model_dir in models:
        for name, settings in variants:
            run(model_dir, name, settings, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
