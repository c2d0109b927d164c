"""torchrun worker (two ranks, DP=2): trainer.optimizer_offload, Megatron-core's
HybridDeviceOptimizer inside its distributed optimizer, on the CPU standing in for the device.

On a CPU host the offloaded optimizer finds no device parameter to copy to the host (it
offloads only parameters whose ``is_cuda`` is true), so it cannot step there (the config
refuses the setting with cluster.device=cpu). Here DDP's parameter buffers play the device:
``Tensor.is_cuda`` is true for tensors on their storage, and pinned memory is ordinary memory.
Everything else is Megatron's code as on a GPU: the host copies of the shards, the gradient
copies, torch's AdamW stepping on the host, the copy back into the parameter buffer and its
all-gather.

argv: model_dir out_dir. For fp32 and bf16: 3 steps with the plain distributed optimizer and 3
with the offloaded one; the offloaded run saves a checkpoint after step 2, and a fresh
offloaded Trainer loads it and takes step 3. Then, without the stand-in, how many shards an
offloaded optimizer built on the plain CPU copies to the host. Rank 0 prints one JSON line.
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from relax_launch import platform
from relax_launch.placement.plan import TrainerLayout
from relax_launch.runtime.groups import build_trainer_groups
from relax_launch.trainer.batch import TokenBatch
from relax_launch.trainer.config import TrainerConfig

STEPS = 3
DEVICE: set[int] = set()  # storages standing in for device memory (DDP's parameter buffers)
# held for the worker's life: a freed buffer's address, reused by a later host tensor, would
# make that tensor "on the device" (seen: one bf16 Adam state, and its resume off by 9e-3)
DEVICE_BUFFERS: list[torch.Tensor] = []


def on_the_device(tensor: torch.Tensor) -> bool:
    return tensor.untyped_storage().data_ptr() in DEVICE


def cpu_as_the_device() -> None:
    """Every Trainer built from now on has its parameter buffers taken for device memory."""
    import relax_launch.trainer.trainer as trainer_module
    from relax_launch.platform.cpu import pinned_memory_is_ordinary

    build = trainer_module.build_optimizer

    def build_optimizer(model, section, pgc):
        DEVICE_BUFFERS.extend(b.param_data for b in model.buffers)
        DEVICE.update(b.param_data.untyped_storage().data_ptr() for b in model.buffers)
        return build(model, section, pgc)

    trainer_module.build_optimizer = build_optimizer
    torch.Tensor.is_cuda = property(on_the_device)
    pinned_memory_is_ordinary()


def batch(step: int) -> TokenBatch:
    """Step ``step``'s batch, this DP rank's shard (the ranks' shards differ)."""
    generator = torch.Generator().manual_seed(100 + step)
    tokens = [torch.randint(6, 250, (n,), generator=generator).tolist() for n in (9, 12, 7, 10)]
    plain = TokenBatch.next_token(tokens, [2, 3, 2, 4])
    return plain.shards(2)[dist.get_rank()]


def trainer(model_dir: str, pgc, dtype: str, offload: bool):
    from relax_launch.trainer.trainer import Trainer

    section = TrainerConfig(
        model=model_dir,
        ranks=2,
        dtype=dtype,
        lr=1e-2,
        distributed_optimizer=True,
        optimizer_offload=offload,
    )
    return Trainer(section=section, model_dir=Path(model_dir), pgc=pgc, device="cpu")


def params(built) -> dict[str, torch.Tensor]:
    return {n: p.detach().float().clone() for n, p in built.model.module.named_parameters()}


def gap(a: dict, b: dict) -> float:
    return max(float((a[n] - b[n]).abs().max()) for n in a)


def where_the_state_is(built) -> dict:
    """The offloaded optimizer's parts, and whether any of its state is in device memory."""
    inner = built.optimizer.chained_optimizers[0].optimizer
    state = [v for per in inner.state.values() for v in per.values() if torch.is_tensor(v)]
    return {
        "optimizer": type(inner).__name__,
        "host_optimizers": len(inner.cpu_optimizers),
        "device_optimizer": inner.gpu_optimizer is not None,
        "host_copies": len(inner.cpu_copys_map_gpu_param),
        "state_tensors": len(state),
        "state_on_the_device": sum(on_the_device(v) for v in state),
    }


def run(model_dir: str, pgc, dtype: str, out: Path) -> dict:
    plain = trainer(model_dir, pgc, dtype, offload=False)
    for step in range(STEPS):
        plain.train_step(batch(step))
    offloaded = trainer(model_dir, pgc, dtype, offload=True)
    for step in range(STEPS):
        if step == STEPS - 1:
            (out / dtype).mkdir(parents=True, exist_ok=True)
            offloaded.save(out / dtype)
            dist.barrier()  # every rank's shard on disk before any loads
        offloaded.train_step(batch(step))
    resumed = trainer(model_dir, pgc, dtype, offload=True)
    resumed.load(out / dtype)
    resumed.train_step(batch(STEPS - 1))
    return {
        "moved": gap(params(plain), params(trainer(model_dir, pgc, dtype, offload=False))),
        "offload_vs_plain": gap(params(plain), params(offloaded)),
        "resumed_vs_uninterrupted": gap(params(offloaded), params(resumed)),
        **where_the_state_is(offloaded),
    }


def main() -> None:
    model_dir, out = sys.argv[1], Path(sys.argv[2])
    dist.init_process_group(platform.dist_backend("cpu"))
    platform.prepare_megatron("cpu")
    torch.set_num_threads(1)
    layout = TrainerLayout((0, 1), tp_size=1, pp_size=1, dp_size=2, phase="train")
    pgc = build_trainer_groups(layout, platform.dist_backend("cpu"))
    on_the_host = trainer(model_dir, pgc, "bfloat16", offload=True)  # before the stand-in
    report = {"plain_cpu_host_copies": where_the_state_is(on_the_host)["host_copies"]}
    cpu_as_the_device()
    for dtype in ("float32", "bfloat16"):
        report[dtype] = run(model_dir, pgc, dtype, out)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, report)
    if dist.get_rank() == 0:
        print(json.dumps({"ranks": gathered}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
