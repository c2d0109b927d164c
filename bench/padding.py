"""Benchmark: what padding costs on a ragged RL batch, and what token budgets and packing save.

One CPU trainer rank (torchrun) builds the real Trainer on SmolLM2-135M (fp32) and trains on
one batch whose response lengths spread like a reasoning task's: log-normal, clipped to
MIN-MAX tokens, after a 40-token prompt. Three layouts of the same batch, in one run:

- ``padded``: fixed micro-batches of ``--micro`` sequences, each padded to its longest;
- ``budgeted``: sequences grouped by length under ``--budget`` tokens per micro-batch (padded);
- ``packed``: the same budget, each micro-batch's sequences end to end in one row.

For each: tokens computed (rows x row length, every micro-batch) over tokens trained (each
sequence's own tokens), micro-batches, and the median seconds of a PPO ``train_step`` (after
one warm-up step), with its ratio to padded. The gradient is the same in all three (tested in
``tests/trainer/test_micro_batch_layouts_cpu.py``).
Run: ``.venv/bin/python bench/padding.py [--sequences 16] [--max-len 600] [--budget 1024]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

PROMPT = 40
LAYOUTS = {
    "padded": lambda a: {"micro_batch_size": a.micro},
    "budgeted": lambda a: {"max_tokens_per_micro_batch": a.budget},
    "packed": lambda a: {"max_tokens_per_micro_batch": a.budget, "pack_sequences": True},
}


def arguments(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="builtin:smollm2-135m-instruct")
    parser.add_argument("--sequences", type=int, default=16)
    parser.add_argument("--min-len", type=int, default=20)
    parser.add_argument("--max-len", type=int, default=600)
    parser.add_argument("--micro", type=int, default=4, help="padded: sequences per micro-batch")
    parser.add_argument("--budget", type=int, default=1024, help="tokens per micro-batch")
    parser.add_argument("--steps", type=int, default=2, help="timed steps per layout")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    return parser.parse_args(argv)


def ragged_batch(args: argparse.Namespace):
    """A PPO batch: prompts of PROMPT tokens, log-normal response lengths (median ~1/6 of the
    maximum, a long tail), random tokens and advantages."""
    import torch

    from relax_launch.models.build import ensure_model
    from relax_launch.trainer.batch import TokenBatch

    config = json.loads((ensure_model(args.model) / "config.json").read_text())
    vocab = min(config["vocab_size"], 40000)
    generator = torch.Generator().manual_seed(0)
    normal = torch.randn(args.sequences, generator=generator)
    responses = (torch.exp(normal) * args.max_len / 6).clamp(args.min_len, args.max_len)
    tokens = [
        torch.randint(10, vocab, (PROMPT + int(n),), generator=generator).tolist()
        for n in responses
    ]
    return TokenBatch(
        tuple(map(tuple, tokens)),
        tuple(tuple(float(j >= PROMPT) for j in range(len(t))) for t in tokens),
        tuple(tuple(torch.randn(len(t), generator=generator).tolist()) for t in tokens),
        tuple(tuple(-1.0 for _ in t) for t in tokens),
    )


def measure(args: argparse.Namespace, layout: str, pgc, batch) -> dict[str, float]:
    from relax_launch.models.build import ensure_model
    from relax_launch.trainer.config import TrainerConfig
    from relax_launch.trainer.losses import LossSpec
    from relax_launch.trainer.trainer import Trainer

    model = ensure_model(args.model)
    fields = LAYOUTS[layout](args)
    section = TrainerConfig(model=str(model), ranks=1, lr=1e-6, dtype="float32", **fields)
    trainer = Trainer(section=section, model_dir=model, pgc=pgc, device="cpu")
    micro_batches = trainer._micro_batches(batch)
    computed = sum(b["inputs"].numel() for b in micro_batches)
    trained = sum(len(t) - 1 for t in batch.tokens)
    seconds = []
    for _ in range(args.steps + 1):
        start = time.perf_counter()
        trainer.train_step(batch, LossSpec())
        seconds.append(time.perf_counter() - start)
    return {
        "micro_batches": len(micro_batches),
        "computed_tokens": computed,
        "trained_tokens": trained,
        "computed_per_trained": computed / trained,
        "step_s": statistics.median(seconds[1:]),
    }


def rank_main(argv: list[str]) -> None:
    import torch.distributed as dist

    from relax_launch import platform
    from relax_launch.placement.plan import TrainerLayout
    from relax_launch.runtime.groups import build_trainer_groups

    args = arguments(argv)
    dist.init_process_group(platform.dist_backend("cpu"))
    layout = TrainerLayout(ranks=(0,), tp_size=1, pp_size=1, dp_size=1, phase="train")
    pgc = build_trainer_groups(layout, platform.dist_backend("cpu"))
    platform.prepare_megatron("cpu")
    batch = ragged_batch(args)
    lengths = sorted(len(t) for t in batch.tokens)
    print(
        f"{len(lengths)} sequences of {lengths[0]}-{lengths[-1]} tokens "
        f"(median {lengths[len(lengths) // 2]}), {args.model}, fp32, 1 rank",
        flush=True,
    )
    figures = {layout: measure(args, layout, pgc, batch) for layout in LAYOUTS}
    print(
        f"\n{'layout':<9} {'micro-batches':>13} {'computed/trained':>17} {'step s':>8} "
        f"{'÷ padded':>9}"
    )
    for layout, f in figures.items():
        ratio = f["step_s"] / figures["padded"]["step_s"]
        print(
            f"{layout:<9} {f['micro_batches']:>13} {f['computed_per_trained']:>17.2f} "
            f"{f['step_s']:>8.2f} {ratio:>9.2f}"
        )
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))
    dist.destroy_process_group()


def main(argv: list[str]) -> int:
    from relax_launch.inference.process import free_port

    torchrun = Path(sys.executable).with_name("torchrun")
    repo = str(Path(__file__).resolve().parents[1])
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")])),
    }
    command = [str(torchrun), "--nproc-per-node", "1", "--master-port", str(free_port())]
    return subprocess.call([*command, __file__, "--rank", *argv], env=env)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--rank"]:
        rank_main(sys.argv[2:])
    else:
        sys.exit(main(sys.argv[1:]))
