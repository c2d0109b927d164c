"""Benchmark: trainer -> SGLang weight sync of SmolLM2-135M (about 538 MB fp32), 1 and 2 engines.

Compares, in one run, over the same kind of gloo group on this machine:
  ours       relax-launch's WeightSender: fixed-size buckets (one engine request each, one
             broadcast per tensor) + versioned session + host copy kept for rollback
  ceiling    one flat buffer of the same bytes broadcast raw to plain receiver processes
  per-tensor SGLang's update_weights_from_distributed: one request, one broadcast per tensor
  disk       save safetensors, then update_weights_from_disk on every engine
and prints GB/s and ratios. Each method runs WARMUP times untimed first: weight sync repeats
every training step, so the steady state is what counts (ours allocates its rollback copy in
its first two syncs). Run: ``.venv/bin/python bench/weight_sync.py [--engines 1 2]``.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from timing import median_seconds

from relax_launch.inference.server import SGLangServer, free_port
from relax_launch.models.build import ensure_model
from relax_launch.weights.config import WeightSyncConfig
from relax_launch.weights.engine_client import Background, post
from relax_launch.weights.sync import WeightSender, custom_group, dtype_name
from relax_launch.weights.update_session import EngineTarget, UpdateSession

REPEATS = 3
WARMUP = 2


def timed(fn) -> float:
    return median_seconds(fn, REPEATS, WARMUP)


def _receiver(port: int, rank: int, world: int, nbytes: int) -> None:
    group = _sender_group_as(rank, port, world)
    buffer = torch.empty(nbytes, dtype=torch.uint8)
    for _ in range(WARMUP + REPEATS):
        dist.broadcast(buffer, group=group, group_src=0)
    dist.destroy_process_group(group)


def _sender_group_as(rank: int, port: int, world: int) -> dist.ProcessGroup:
    return custom_group("gloo", "127.0.0.1", port, world, rank, "ceiling", 120)


def ceiling(nbytes: int, receivers: int) -> float:
    port = free_port()
    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(target=_receiver, args=(port, r + 1, receivers + 1, nbytes))
        for r in range(receivers)
    ]
    for p in procs:
        p.start()
    group = _sender_group_as(0, port, receivers + 1)
    buffer = torch.ones(nbytes, dtype=torch.uint8)
    seconds = timed(lambda: dist.broadcast(buffer, group=group, group_src=0))
    for p in procs:
        p.join(60)
    dist.destroy_process_group(group)
    return seconds


def ours(sender: WeightSender, weights: dict[str, torch.Tensor], version: int) -> None:
    """What ``Session.sync_weights`` does for one pipeline stage."""
    engines = UpdateSession(sender.targets, 300)
    engines.open()
    sender.send(weights.items(), version)
    engines.commit(version)
    engines.close()
    sender.commit()


def per_tensor(sender: WeightSender, weights: dict[str, torch.Tensor]) -> None:
    body = {
        "names": list(weights),
        "dtypes": [dtype_name(t.dtype) for t in weights.values()],
        "shapes": [list(t.shape) for t in weights.values()],
        "group_name": sender.group_name,
        "flush_cache": False,
    }
    for t in sender.targets:
        post(t.url, "/begin_weight_update", {}, 120)
    calls = [
        Background(t.url, "/update_weights_from_distributed", body, 300) for t in sender.targets
    ]
    for tensor in weights.values():
        dist.broadcast(tensor, group=sender.group, group_src=0)
    for call in calls:
        call.result(300)
    for t in sender.targets:
        post(t.url, "/end_weight_update", {}, 120)


def from_disk(
    servers: list[SGLangServer], weights: dict[str, torch.Tensor], model_dir: Path
) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        for f in model_dir.iterdir():
            if f.suffix != ".safetensors":
                (Path(tmp) / f.name).write_bytes(f.read_bytes())
        save_file(weights, str(Path(tmp) / "model.safetensors"))
        calls = [
            Background(s.url, "/update_weights_from_disk", {"model_path": tmp}, 300)
            for s in servers
        ]
        for call in calls:
            call.result(300)


def run(engines: int, model_dir: Path, weights: dict[str, torch.Tensor], log_dir: Path) -> None:
    nbytes = sum(t.numel() * t.element_size() for t in weights.values())
    servers = [
        SGLangServer(
            model_path=model_dir,
            device="cpu",
            log_path=log_dir / f"engine{i}.log",
            engine={"max_total_tokens": 4096},
        )
        for i in range(engines)
    ]
    try:
        for s in servers:
            s.start(timeout_s=300)
        sender = WeightSender(
            targets=[EngineTarget(s.url, 1 + i, f"engine {i}") for i, s in enumerate(servers)],
            world_size=1 + engines,
            group_name="bench",
            host="127.0.0.1",
            port=free_port(),
            backend="gloo",
            bucket_bytes=WeightSyncConfig().bucket_size_mb * 2**20,
            timeout_s=300,
        )
        sender.connect()
        version = iter(range(1000))
        results = {
            "ours": timed(lambda: ours(sender, weights, next(version))),
            "per-tensor": timed(lambda: per_tensor(sender, weights)),
            "disk": timed(lambda: from_disk(servers, weights, model_dir)),
        }
        sender.close()
    finally:
        for s in servers:
            s.stop()
    results["ceiling"] = ceiling(nbytes, engines)
    gb = nbytes / 1e9
    print(f"\n{engines} engine(s), {gb:.3f} GB, median of {REPEATS} after {WARMUP} warm-up:")
    for name, seconds in results.items():
        print(
            f"  {name:<11} {seconds:6.3f} s  {gb / seconds:5.2f} GB/s  "
            f"speed relative to ours: {results['ours'] / seconds:.2f}"
        )
    print(f"  ours / ceiling = {results['ceiling'] / results['ours']:.2f} (target >= 0.85)")


def main() -> None:
    torch.set_num_threads(1)  # as on a torchrun rank (OMP_NUM_THREADS=1)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args()
    model_dir = ensure_model("builtin:smollm2-135m-instruct")
    weights = load_file(str(model_dir / "model.safetensors"))
    with tempfile.TemporaryDirectory() as logs:
        for engines in args.engines:
            run(engines, model_dir, weights, Path(logs))


if __name__ == "__main__":
    main()
