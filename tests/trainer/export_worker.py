"""torchrun worker (two ranks): for each case, a trainer trains two steps, scores fixed sequences,
exports itself as a Hugging Face model while live (``Trainer.export_hf``) and saves a checkpoint
that ``relax-launch export`` converts afterwards (fp32, CPU).

argv: OUT_DIR CASE... with CASE = NAME:MODEL:TP:PP:LORA_RANK (LORA_RANK 0: full fine-tuning).
Prints one JSON line: {NAME: {"logprobs": the trainer's, "live": dir, "checkpoint": dir}}.
"""

import json
import sys
from pathlib import Path

import torch.distributed as dist

from relax_launch import platform
from relax_launch.models.build import ensure_model
from relax_launch.placement.plan import TrainerLayout
from relax_launch.rl.checkpoints import COMPLETE
from relax_launch.rl.exports import PolicyExports
from relax_launch.runtime.groups import build_trainer_groups
from relax_launch.trainer.batch import TokenBatch
from relax_launch.trainer.config import TrainerConfig
from relax_launch.trainer.hf_dir import finish

SEQUENCES = [[5, 17, 42, 99, 7, 150, 23, 61, 8, 8], [9, 88, 31, 4, 270, 12, 55, 200, 13, 77]]


def gathered_rows(trainer, rows) -> list[list[float]]:
    """Every sequence's logprobs, in batch order, from the last stage's tp0 rank of each DP
    replica."""
    mine = None
    if trainer.is_last_stage and trainer.pgc.tp.rank() == 0:
        mine = (trainer.pgc.dp.rank(), rows)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return [row for _, part in sorted(p for p in everyone if p) for row in part]


def run_case(out: Path, name: str, model: str, tp: int, pp: int, lora_rank: int) -> dict:
    from relax_launch.trainer.trainer import Trainer

    world = dist.get_world_size()
    layout = TrainerLayout(
        ranks=tuple(range(world)), tp_size=tp, pp_size=pp, dp_size=world // (tp * pp),
        phase="train",
    )  # fmt: skip
    pgc = build_trainer_groups(layout, platform.dist_backend("cpu"))
    lora = {"rank": lora_rank, "alpha": 2 * lora_rank} if lora_rank else None
    section = TrainerConfig(
        model=model, dtype="float32", lr=1e-2, micro_batch_size=1, tp_size=tp, pp_size=pp,
        lora=lora,
    )  # fmt: skip
    model_dir = ensure_model(model)
    trainer = Trainer(section=section, model_dir=model_dir, pgc=pgc, device="cpu")
    batch = TokenBatch.next_token(SEQUENCES, [2, 2])
    shard = batch.shards(layout.dp_size)[pgc.dp.rank()]
    for _ in range(2):
        trainer.train_step(shard)
    rows = gathered_rows(trainer, trainer.logprobs(shard))
    live, checkpoint = out / name / "live", out / name / "checkpoint"
    if dist.get_rank() == 0:
        live.mkdir(parents=True)
        checkpoint.mkdir(parents=True)
    dist.barrier()
    maps = [None] * world
    dist.all_gather_object(maps, trainer.export_hf(live, "float32"))
    trainer.save(checkpoint)
    dist.barrier()
    if dist.get_rank() == 0:
        weight_map = {k: v for m in maps for k, v in m.items()}
        finish(live, weight_map, model_dir, "float32", f"# {name}\n")
        config = {"name": name, "trainer": section.model_dump(mode="json")}
        PolicyExports(live, 0, True, "float32", model_dir, config).describe(checkpoint)
        (checkpoint / COMPLETE).write_text("2")
    return {"logprobs": rows, "live": str(live), "checkpoint": str(checkpoint)}


def main() -> None:
    dist.init_process_group(platform.dist_backend("cpu"))
    platform.prepare_megatron("cpu")
    out = Path(sys.argv[1])
    report = {}
    for case in sys.argv[2:]:
        name, model, tp, pp, lora_rank = case.split(":", 4)
        report[name] = run_case(out, name, f"builtin:{model}", int(tp), int(pp), int(lora_rank))
    if dist.get_rank() == 0:
        print(json.dumps(report), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
