"""Benchmark: the trainer on SmolLM2 with full fine-tuning and with LoRA, in one run.

Two torchrun jobs of DP=2 CPU trainer ranks (the quickstart's trainer), one per variant, one
after the other, each in fresh processes so each peak is its own. Each builds the real Trainer
(fp32), then times ``logprobs`` and a PPO ``train_step`` on the same 16-sequence batch
(60-75 tokens, micro-batch 4) and the weight sync's export (``export_hf_weights`` as the sync
calls it: fused, only what training changed; LoRA: the targeted weights, merged). Prints per
variant: the median of the steps after the first, the peak resident memory of a trainer rank
(and its growth over the built model's), the trainable parameters and optimizer bytes, and what
a sync sends; then LoRA ÷ full.
Run: ``.venv/bin/python bench/lora.py [--rank 16] [--steps 4]``.
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


def rank_main(variant: str, lora_rank: int, steps: int) -> None:
    import resource

    import psutil
    import torch
    import torch.distributed as dist
    from trainer_steps import dp_trainer  # this directory: that bench's trainer and batch

    from relax_launch.trainer.losses import LossSpec

    lora = {"rank": lora_rank, "alpha": 2 * lora_rank} if variant == "lora" else None
    trainer, shard, rank = dp_trainer(lora=lora)
    built_rss = psutil.Process().memory_info().rss
    times: dict[str, list[float]] = {"logprobs": [], "train": [], "export": []}
    sent = 0
    for _ in range(steps):
        start = time.perf_counter()
        trainer.logprobs(shard)
        times["logprobs"].append(time.perf_counter() - start)
        start = time.perf_counter()
        trainer.train_step(shard, LossSpec())
        times["train"].append(time.perf_counter() - start)
        start = time.perf_counter()
        sent = sum(t.nbytes for _, t in trainer.export_hf_weights(fused=True, changed_only=True))
        times["export"].append(time.perf_counter() - start)
    trainable = [p for p in trainer.model.parameters() if p.requires_grad]
    optimizer_bytes = sum(
        t.nbytes
        for state in trainer.optimizer.optimizer.state.values()
        for t in state.values()
        if isinstance(t, torch.Tensor)
    )
    if rank == 0:
        # ru_maxrss: the process's peak resident set (KiB on Linux), build and steps included
        report = {
            "variant": variant,
            "steps": {k: statistics.median(v[1:]) for k, v in times.items()},
            "first": {k: v[0] for k, v in times.items()},
            "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "built_rss": built_rss,
            "trainable": sum(p.numel() for p in trainable),
            "optimizer_bytes": optimizer_bytes,
            "sync_bytes": sent,
        }
        print("REPORT " + json.dumps(report), flush=True)
    dist.destroy_process_group()


def run_variant(variant: str, lora_rank: int, steps: int) -> dict:
    from relax_launch.inference.process import free_port

    torchrun = Path(sys.executable).with_name("torchrun")
    repo = str(Path(__file__).resolve().parents[1])
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")])),
    }
    command = [str(torchrun), "--nproc-per-node", "2", "--master-port", str(free_port())]
    command += [__file__, "--worker", variant, str(lora_rank), str(steps)]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1800)
    if result.returncode != 0:
        raise SystemExit(f"{variant} failed:\n{result.stderr[-3000:]}")
    line = next(x for x in result.stdout.splitlines() if x.startswith("REPORT "))
    return json.loads(line.removeprefix("REPORT "))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rank", type=int, default=16, help="LoRA rank (alpha = 2 x rank)")
    parser.add_argument("--steps", type=int, default=4, help="steps per variant (first dropped)")
    args = parser.parse_args()
    reports = {v: run_variant(v, args.rank, args.steps) for v in ("full", "lora")}
    mb = 1e6
    print(f"SmolLM2-135M fp32, DP=2 CPU trainer ranks, LoRA rank {args.rank} on every linear")
    print(f"{'':24}{'full':>12}{'LoRA':>12}{'LoRA ÷ full':>14}")
    rows = [
        ("train step (s)", lambda r: r["steps"]["train"], "{:.2f}"),
        ("logprobs (s)", lambda r: r["steps"]["logprobs"], "{:.2f}"),
        ("sync export (s)", lambda r: r["steps"]["export"], "{:.2f}"),
        ("sync bytes (MB)", lambda r: r["sync_bytes"] / mb, "{:.0f}"),
        ("peak RSS/rank (MB)", lambda r: r["peak_rss"] / mb, "{:.0f}"),
        ("RSS growth (MB)", lambda r: (r["peak_rss"] - r["built_rss"]) / mb, "{:.0f}"),
        ("trainable params (M)", lambda r: r["trainable"] / 1e6, "{:.2f}"),
        ("optimizer state (MB)", lambda r: r["optimizer_bytes"] / mb, "{:.0f}"),
    ]
    for label, value, form in rows:
        full, lora = value(reports["full"]), value(reports["lora"])
        ratio = f"{lora / full:.2f}" if full else "-"
        print(f"{label:24}{form.format(full):>12}{form.format(lora):>12}{ratio:>14}")
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        rank_main(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
    else:
        sys.exit(main())
