"""torchrun worker: one train step of the real Trainer (Megatron-core, CPU) with and without
gradient clipping, on a batch whose gradient norm is far above the clip.

argv: model_dir tp_size pp_size dtype. Every rank is a trainer rank. For clip_grad 0 and then 1,
rank 0 prints one JSON line: the grad norm the trainer reported and, from the whole model's
tensors gathered over TP and PP independently of Megatron, the norm of the gradients the
optimizer stepped with, the norm of Adam's first moment over (1 - beta1) (the gradient the update
used) and how far that gradient is from the unclipped one times min(1, clip / unclipped norm).
"""

import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from relax_launch import platform
from relax_launch.placement.plan import TrainerLayout
from relax_launch.runtime.groups import build_trainer_groups
from relax_launch.trainer.batch import TokenBatch
from relax_launch.trainer.config import TrainerConfig
from relax_launch.trainer.hf_conversion import tp_split_dim

LOSS_SCALE = 1000.0  # every token's weight: the grad norm is then in the thousands
TOKENS = [[1, 7, 42, 9, 77, 13, 5, 8, 200, 31], [1, 11, 12, 99, 3, 250, 6, 17, 64, 2]]


def stepped_params(trainer) -> dict[int, torch.Tensor]:
    """Model parameter id -> the fp32 tensor the optimizer steps (its main copy under bf16)."""
    stepped = {}
    for inner in trainer.optimizer.chained_optimizers:
        for model_group, main_group in zip(
            getattr(inner, "float16_groups", []),
            getattr(inner, "fp32_from_float16_groups", []),
            strict=True,
        ):
            stepped.update({id(p): main for p, main in zip(model_group, main_group, strict=True)})
    return stepped


def full_tensors(trainer, pick: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, torch.Tensor]:
    """``pick(stepped param)`` for every parameter of the whole model, TP-gathered, every rank."""
    tp, stepped, mine = trainer.pgc.tp, stepped_params(trainer), {}
    for name, param in trainer.model.module.named_parameters():
        part, dim = pick(stepped.get(id(param), param)).detach().float(), tp_split_dim(name)
        if dim is not None and tp.size() > 1:
            parts = [torch.empty_like(part) for _ in range(tp.size())]
            dist.all_gather(parts, part.contiguous(), group=tp)
            part = torch.cat(parts, dim=dim)
        mine[f"stage{trainer.pgc.pp.rank()}.{name}"] = part
    stages: list = [None] * dist.get_world_size()
    dist.all_gather_object(stages, mine)
    return {name: tensor for stage in stages for name, tensor in stage.items()}


def norm(tensors: dict[str, torch.Tensor]) -> float:
    return float(torch.nn.utils.get_total_norm(list(tensors.values())))


BATCH = TokenBatch(
    tuple(map(tuple, TOKENS)),
    tuple(tuple(float(j > 0) for j in range(len(t))) for t in TOKENS),
    tuple(tuple(LOSS_SCALE for _ in t) for t in TOKENS),
)


def withheld_step(trainer) -> dict:
    """A step the mismatch guard's ``skip`` holds back (its loss above the bound, known on the
    last stage only): whether every rank's weights and step count stayed as they were."""
    from relax_launch.trainer.losses import LossSpec

    before, step = full_tensors(trainer, lambda p: p), trainer.step
    metrics = trainer.train_step(BATCH, LossSpec(withhold_above=(("loss", 0.0),)))
    after = full_tensors(trainer, lambda p: p)
    return {
        "update_withheld": metrics["update_withheld"],
        "weights_changed": any(not torch.equal(before[k], after[k]) for k in before),
        "step_counted": trainer.step != step,
    }


def one_step(section: TrainerConfig, pgc, unclipped: dict | None) -> tuple[dict, dict]:
    """Train one step, then one withheld; returns the report and the gathered gradients the
    optimizer used."""
    from relax_launch.trainer.trainer import Trainer

    batch = BATCH
    trainer = Trainer(section=section, model_dir=Path(section.model), pgc=pgc, device="cpu")
    metrics = trainer.train_step(batch)
    grads = full_tensors(trainer, lambda p: p.grad)
    state = trainer.optimizer.optimizer.state
    beta1 = trainer.optimizer.optimizer.param_groups[0]["betas"][0]
    used = full_tensors(trainer, lambda p: state[p]["exp_avg"] / (1 - beta1))
    unclipped = unclipped or grads
    clip = section.clip_grad
    coeff = min(1.0, clip / norm(unclipped)) if clip else 1.0
    off = max(float((used[k] - unclipped[k] * coeff).abs().max()) for k in used)
    report = {
        "clip_grad": clip,
        "reported_grad_norm": metrics["grad_norm"],
        "unclipped_grad_norm": norm(unclipped),
        "grad_norm_after_step": norm(grads),
        "used_grad_norm": norm(used),
        "used_minus_scaled_unclipped": off,
        "largest_used": max(float(t.abs().max()) for t in used.values()),
        "withheld": withheld_step(trainer),
    }
    return report, grads


def main() -> None:
    model_dir, tp_size, pp_size, dtype = sys.argv[1], *map(int, sys.argv[2:4]), sys.argv[4]
    dist.init_process_group(platform.dist_backend("cpu"))
    world = dist.get_world_size()
    layout = TrainerLayout(
        ranks=tuple(range(world)),
        tp_size=tp_size,
        pp_size=pp_size,
        dp_size=world // (tp_size * pp_size),
        phase="train",
    )
    pgc = build_trainer_groups(layout, platform.dist_backend("cpu"))
    platform.prepare_megatron("cpu")
    unclipped = None
    for clip_grad in (0.0, 1.0):
        section = TrainerConfig(
            model=model_dir,
            ranks=world,
            tp_size=tp_size,
            pp_size=pp_size,
            micro_batch_size=1,
            lr=1e-3,
            clip_grad=clip_grad,
            dtype=dtype,
        )
        report, grads = one_step(section, pgc, unclipped)
        unclipped = unclipped or grads
        if dist.get_rank() == 0:
            print(json.dumps(report), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
