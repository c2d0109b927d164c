"""Benchmark: the trainer's first steps against its later ones, alone (no engines).

A torchrun job of DP=2 CPU trainer ranks builds the real Trainer on SmolLM2 (fp32), then runs
``logprobs`` and a PPO ``train_step`` on the same 16-sequence batch (60-75 tokens, micro-batch
4) four times, and prints each call's seconds per rank. A first call much slower than the
others is a one-off cost on the way to a job's first step (compilation, lazy allocation).
Run: ``.venv/bin/python bench/trainer_steps.py``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

STEPS = 4


def ppo_batch():
    """16 random sequences of 60-75 tokens (responses after 40), as a PPO batch."""
    import torch

    from relax_launch.trainer.batch import TokenBatch

    generator = torch.Generator().manual_seed(0)
    tokens = [
        torch.randint(10, 40000, (60 + 5 * (i % 4),), generator=generator).tolist()
        for i in range(16)
    ]
    return TokenBatch(
        tuple(map(tuple, tokens)),
        tuple(tuple(float(j >= 40) for j in range(len(t))) for t in tokens),
        tuple(tuple(0.5 for _ in t) for t in tokens),
        tuple(tuple(-1.0 for _ in t) for t in tokens),
    )


def dp_trainer(**fields: object) -> tuple:
    """This torchrun rank's share of a DP trainer of SmolLM2 (fp32, micro-batch 4) with extra
    TrainerConfig ``fields``, and its shard of ``ppo_batch``: (trainer, shard, rank)."""
    import torch.distributed as dist

    from relax_launch import platform
    from relax_launch.models.build import ensure_model
    from relax_launch.placement.plan import TrainerLayout
    from relax_launch.runtime.groups import build_trainer_groups
    from relax_launch.trainer.config import TrainerConfig

    dist.init_process_group(platform.dist_backend("cpu"))
    world, rank = dist.get_world_size(), dist.get_rank()
    layout = TrainerLayout(
        ranks=tuple(range(world)), tp_size=1, pp_size=1, dp_size=world, phase="train"
    )
    pgc = build_trainer_groups(layout, platform.dist_backend("cpu"))
    platform.prepare_megatron("cpu")
    from relax_launch.trainer.trainer import Trainer

    model = ensure_model("builtin:smollm2-135m-instruct")
    section = TrainerConfig(
        model=str(model), ranks=world, micro_batch_size=4, lr=1e-5, dtype="float32", **fields
    )
    trainer = Trainer(section=section, model_dir=model, pgc=pgc, device="cpu")
    return trainer, ppo_batch().shards(world)[rank], rank


def rank_main() -> None:
    import torch.distributed as dist

    from relax_launch.trainer.losses import LossSpec

    start = time.perf_counter()
    trainer, shard, rank = dp_trainer()
    print(f"rank {rank}: trainer built in {time.perf_counter() - start:.1f} s", flush=True)
    for step in range(STEPS):
        start = time.perf_counter()
        trainer.logprobs(shard)
        logprobs_s = time.perf_counter() - start
        start = time.perf_counter()
        trainer.train_step(shard, LossSpec())
        train_s = time.perf_counter() - start
        print(
            f"rank {rank} call {step + 1}: logprobs {logprobs_s:.1f} s, train step {train_s:.1f} s"
        )
    dist.destroy_process_group()


def main() -> int:
    from relax_launch.inference.process import free_port

    torchrun = Path(sys.executable).with_name("torchrun")
    repo = str(Path(__file__).resolve().parents[1])
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")])),
    }
    command = [str(torchrun), "--nproc-per-node", "2", "--master-port", str(free_port())]
    return subprocess.call([*command, __file__, "--rank"], env=env)


if __name__ == "__main__":
    if sys.argv[1:] == ["--rank"]:
        rank_main()
    else:
        sys.exit(main())
