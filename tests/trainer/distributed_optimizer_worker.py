"""torchrun worker: the real Trainer (Megatron-core, CPU, gloo) with trainer.distributed_optimizer.

argv: MODE OUT_DIR MODEL... Every rank is a trainer rank; rank 0 prints every rank's JSON report
``{"rank": r, ...}``, one line each. Every run trains fp32 clipped Adam (the clip acts: it needs
the gradient norm summed over the trainer ranks) on batches whose DP shards differ.

- ``dense OUT llama qwen3``: DP=2 on two ranks. Per model (and LoRA on qwen3; llama also
  unclipped), the plain and the distributed optimizer's parameters after 3 steps (each rank's
  own copy: the distributed one's all-gather must have brought the other rank's half) and
  what the HF export yields, with each optimizer's bytes (fp32; bf16 after one step). The llama
  runs save checkpoints after steps 0 and 2 (distributed and plain); the distributed run's final
  parameters are written for ``resume``. Then offload and onload: every tensor reachable from
  the optimizer and DDP's buffers is empty while offloaded and bit-exact after, and 3 steps with
  a cycle after each end bit-identical to 3 without (fp32; bf16: one step and a cycle).
- ``resume OUT llama``: fresh processes load the step-2 checkpoint, take step 3 and compare
  with the uninterrupted run's parameters; a plain checkpoint into the distributed optimizer,
  and the distributed one into the plain optimizer, are refused; the step-0 one loads. The
  resumed state offloads and onloads bit-exact.
- ``parallel OUT llama qwen2 moe``: four ranks. The DP=2 checkpoint into DP=4 is refused,
  nothing loaded. Plain against distributed after 3 steps with TP=2 x DP=2 (llama), PP=2 x DP=2
  (Qwen2: tied embeddings on both stages; unclipped), CP=2 x DP=2 (llama: sharded over 4) and
  DP=4 x EP=2 (Qwen3-MoE, experts sharded over their own DP of 2); the MoE run saved after
  step 2 and resumed into a new Trainer gives step 3 exactly.
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
from relax_launch.trainer.config import LoraConfig, TrainerConfig
from relax_launch.trainer.offload import PARTS

STEPS = 3


def batch(step: int, dp: int, dp_rank: int) -> TokenBatch:
    """Step ``step``'s batch (4 sequences per DP rank, ragged), this DP rank's shard."""
    gen = torch.Generator().manual_seed(100 + step)
    lengths = torch.randint(6, 14, (4 * dp,), generator=gen).tolist()
    tokens = [torch.randint(6, 250, (n,), generator=gen).tolist() for n in lengths]
    return TokenBatch.next_token(tokens, [2 + i % 3 for i in range(len(tokens))]).shards(dp)[
        dp_rank
    ]


class Run:
    """One layout of the world: its groups, and trainers built on them."""

    def __init__(self, tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1) -> None:
        world = dist.get_world_size()
        self.layout = TrainerLayout(
            tuple(range(world)),
            tp_size=tp,
            pp_size=pp,
            cp_size=cp,
            ep_size=ep,
            dp_size=world // (tp * pp * cp),
            phase="train",
        )
        self.pgc = build_trainer_groups(self.layout, platform.dist_backend("cpu"))
        self.dp_rank = self.layout.coordinates(dist.get_rank())[1]

    def trainer(self, model: str, **fields):
        from relax_launch.trainer.trainer import Trainer

        section = TrainerConfig(
            model=model,
            ranks=dist.get_world_size(),
            tp_size=self.layout.tp_size,
            pp_size=self.layout.pp_size,
            cp_size=self.layout.cp_size,
            ep_size=self.layout.ep_size,
            **{"micro_batch_size": 2, "lr": 1e-3, "clip_grad": 1.0, "dtype": "float32"} | fields,
        )
        return Trainer(section=section, model_dir=Path(model), pgc=self.pgc, device="cpu")

    def step(self, trainer, step: int) -> dict:
        return trainer.train_step(batch(step, self.layout.dp_size, self.dp_rank))


def params(trainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.model.module.named_parameters()}


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((float((a[n].float() - b[n].float()).abs().max()) for n in a), default=0.0)


def optimizer_bytes(trainer) -> list[dict[str, int]]:
    """Per chained optimizer (dense, then experts): bytes of what it steps (fp32 master
    weights: the parameters themselves under the plain fp32 optimizer, a slice of them under
    the distributed one) and of Adam's state."""
    sizes = []
    for part in trainer.optimizer.chained_optimizers:
        groups = part.optimizer.param_groups
        master = sum(p.numel() * p.element_size() for g in groups for p in g["params"])
        state = sum(
            v.numel() * v.element_size()
            for per_param in part.optimizer.state.values()
            for k, v in per_param.items()
            if isinstance(v, torch.Tensor) and k != "step"
        )
        sizes.append({"master": master, "state": state})
    return sizes


def compare(run: Run, model: str, report: dict, name: str, **fields) -> None:
    """3 steps plain and distributed: the largest difference of the parameters and of what
    the HF export (the weight sync's source) yields, how far the weights moved, both runs'
    gradient norms and optimizer bytes."""
    final, exported, norms, sizes = {}, {}, {}, {}
    for kind in ("plain", "distributed"):
        trainer = run.trainer(model, distributed_optimizer=kind == "distributed", **fields)
        start = params(trainer)
        norms[kind] = [run.step(trainer, s)["grad_norm"] for s in range(STEPS)]
        final[kind], sizes[kind] = params(trainer), optimizer_bytes(trainer)
        exported[kind] = {n: t.clone() for n, t in trainer.export_hf_weights()}
        changed = max_diff(start, final[kind])
    report[name] = {
        "diff": max_diff(final["plain"], final["distributed"]),
        "export_diff": max_diff(exported["plain"], exported["distributed"]),
        "exported": len(exported["plain"]),
        "changed": changed,
        "grad_norms": norms,
        "bytes": sizes,
    }


def bf16_bytes(run: Run, model: str) -> dict[str, dict[str, int]]:
    """Optimizer bytes after one bfloat16 step (fp32 master copies of bf16 weights)."""
    sizes = {}
    for distributed in (False, True):
        trainer = run.trainer(model, distributed_optimizer=distributed, dtype="bfloat16")
        run.step(trainer, 0)
        sizes["distributed" if distributed else "plain"] = optimizer_bytes(trainer)
    return sizes


def reachable_tensors(trainer) -> list[torch.Tensor]:
    """Every tensor reachable from the optimizer's objects and DDP's param/grad buffers
    (modules are not entered: their parameters are reached through the buffers' maps), found
    independently of ``trainer/offload.py``."""
    roots = [trainer.optimizer, trainer.model.buffers, trainer.model.expert_parallel_buffers]
    seen, found, stack = set(), {}, list(roots)
    while stack:
        item = stack.pop()
        if id(item) in seen or isinstance(item, torch.nn.Module | type):
            continue
        seen.add(id(item))
        if isinstance(item, torch.Tensor):
            if item.numel() > 0:
                found[id(item)] = item
        elif isinstance(item, dict):
            stack += [*item.keys(), *item.values()]
        elif isinstance(item, list | tuple | set):
            stack += list(item)
        elif hasattr(item, "__dict__") and type(item).__module__.startswith(("megatron", "torch")):
            stack += list(vars(item).values())
    return list(found.values())


def offload_cycle(trainer, report: dict) -> None:
    """Offload everything, check every reachable tensor is empty, onload, compare bytes."""
    tensors = reachable_tensors(trainer)
    buffers = [*trainer.model.buffers, *trainer.model.expert_parallel_buffers]
    grads = {b.grad_data.untyped_storage()._cdata for b in buffers}  # discarded: back as zeros
    before = [t.clone() for t in tensors]
    moved = trainer.offload(PARTS)["bytes"]
    left = [tuple(t.shape) for t in tensors if t.untyped_storage().size() > 0]
    back = trainer.onload(PARTS)["bytes"]
    restored = all(
        torch.equal(t, torch.zeros_like(b) if t.untyped_storage()._cdata in grads else b)
        for t, b in zip(tensors, before, strict=True)
    )
    report.setdefault("cycles", []).append(
        {"tensors": len(tensors), "left": left, "moved": moved, "back": back, "same": restored}
    )


def offloading(run: Run, model: str, report: dict) -> None:
    """3 distributed steps with a cycle after each against 3 without; bf16: one cycle."""
    final = {}
    for cycles in (False, True):
        trainer = run.trainer(model, distributed_optimizer=True)
        for step in range(STEPS):
            run.step(trainer, step)
            if cycles:
                offload_cycle(trainer, report)
        final[cycles] = params(trainer)
    report["offload_identical"] = all(
        torch.equal(final[False][n], final[True][n]) for n in final[1]
    )
    trainer = run.trainer(model, distributed_optimizer=True, dtype="bfloat16")
    run.step(trainer, 0)
    offload_cycle(trainer, report)


def dense(out: Path, llama: str, qwen3: str) -> dict:
    run = Run()
    report = {
        "grad_stats_is_trainer": all(
            p.get_grad_stats_parallel_group() is run.pgc.trainer
            for p in run.trainer(llama, distributed_optimizer=True).optimizer.chained_optimizers
        )
    }
    compare(run, llama, report, "llama")
    compare(run, llama, report, "llama_unclipped", clip_grad=0.0, lr=1e-2)
    compare(run, qwen3, report, "qwen3")
    compare(run, qwen3, report, "qwen3_lora", lora=LoraConfig(rank=4))
    report["bf16_bytes"] = bf16_bytes(run, llama)
    for distributed in (True, False):  # checkpoints after steps 0 and 2; the final weights
        trainer = run.trainer(llama, distributed_optimizer=distributed)
        kind = "distributed" if distributed else "plain"
        for step in range(STEPS):
            if step in (0, 2):
                directory = out / (kind if step else f"{kind}_step0")
                directory.mkdir(exist_ok=True)
                dist.barrier()
                report[f"{directory.name}_file"] = trainer.save(directory)
            run.step(trainer, step)
        if distributed:
            torch.save(params(trainer), out / f"final{dist.get_rank()}.pt")
    offloading(run, llama, report)
    return report


def refused(trainer, directory: Path) -> str:
    before = params(trainer)
    try:
        trainer.load(directory)
    except ValueError as exc:
        unchanged = max_diff(before, params(trainer)) == 0.0 and trainer.step == 0
        return str(exc) + ("" if unchanged else " [BUT THE MODEL CHANGED]")
    return ""


def resume(out: Path, llama: str) -> dict:
    run = Run()
    trainer = run.trainer(llama, distributed_optimizer=True)
    report = {"plain_refused": refused(trainer, out / "plain")}
    report["loaded_step"] = trainer.load(out / "distributed")
    run.step(trainer, 2)
    expected = torch.load(out / f"final{dist.get_rank()}.pt")
    got = params(trainer)
    report["identical"] = all(torch.equal(expected[n], got[n]) for n in expected)
    report["diff"] = max_diff(expected, got)
    offload_cycle(trainer, report)  # what a colocated resume does next: the loaded state moves
    plain = run.trainer(llama, distributed_optimizer=False)
    report["distributed_refused"] = refused(plain, out / "distributed")
    fresh = run.trainer(llama, distributed_optimizer=True)  # saved before Adam had state
    report["step0_loaded"] = fresh.load(out / "distributed_step0")
    run.step(fresh, 0)
    report["step0_then_step"] = fresh.step
    return report


def parallel(out: Path, llama: str, qwen2: str, moe: str) -> dict:
    dp4 = Run().trainer(llama, distributed_optimizer=True)  # the DP=2 checkpoint into DP=4
    report = {"resized_refused": refused(dp4, out / "distributed")}
    compare(Run(tp=2), llama, report, "tp2_dp2")
    # tied embeddings, one copy on each stage; unclipped, so bit-identical is expected
    compare(Run(pp=2), qwen2, report, "pp2_dp2", clip_grad=0.0, lr=1e-2)
    compare(Run(cp=2), llama, report, "cp2_dp2")  # sharded over DP x CP = 4
    run = Run(ep=2)
    compare(run, moe, report, "moe_dp4_ep2")
    first = run.trainer(moe, distributed_optimizer=True)
    (out / "moe").mkdir(exist_ok=True)
    for step in range(STEPS):
        if step == 2:
            report["moe_files"] = first.save(out / "moe")
        run.step(first, step)
    second = run.trainer(moe, distributed_optimizer=True)
    report["moe_loaded_step"] = second.load(out / "moe")
    run.step(second, 2)
    report["moe_resumed_identical"] = max_diff(params(first), params(second)) == 0.0
    report["moe_expert_dp"] = run.pgc.expt_dp.size()
    return report


def main() -> None:
    torch.set_num_threads(1)  # one order of float sums every time
    mode, out, models = sys.argv[1], Path(sys.argv[2]), sys.argv[3:]
    dist.init_process_group(platform.dist_backend("cpu"))
    platform.prepare_megatron("cpu")
    report = {"dense": dense, "resume": resume, "parallel": parallel}[mode](out, *models)
    reports = [None] * dist.get_world_size()  # printed by one rank: lines never interleave
    dist.all_gather_object(reports, {"rank": dist.get_rank()} | report)
    if dist.get_rank() == 0:
        print("\n".join(json.dumps(r) for r in reports), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
