"""torchrun worker (one rank): the ``Trainer``'s logprobs, from the model directory's initial
weights, of the samples ``vlm_record.py`` recorded, images included (as the RL step scores
them: padded micro-batches of two rows).

argv: model_dir, record file. Prints one JSON line: {"responses": each sample's response
token logprobs, "other_image": the same with each sample given the image of the sample half the
batch away (the other prompt's, of the same size)}."""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from relax_launch import platform
from relax_launch.placement.plan import TrainerLayout
from relax_launch.runtime.groups import build_trainer_groups
from relax_launch.trainer.batch import RowImages, TokenBatch
from relax_launch.trainer.config import TrainerConfig
from relax_launch.trainer.trainer import Trainer


def main() -> None:
    dist.init_process_group(platform.dist_backend("cpu"))
    layout = TrainerLayout(ranks=(0,), tp_size=1, pp_size=1, dp_size=1, phase="train")
    pgc = build_trainer_groups(layout, platform.dist_backend("cpu"))
    platform.prepare_megatron("cpu")
    model_dir, record = sys.argv[1], sys.argv[2]
    section = TrainerConfig(model=model_dir, ranks=1, dtype="float32", micro_batch_size=2)
    trainer = Trainer(section=section, model_dir=Path(model_dir), pgc=pgc, device="cpu")
    rows = torch.load(record, weights_only=False)
    tokens = tuple(tuple(r["prompt_ids"] + r["response_ids"]) for r in rows)
    masks = tuple(
        tuple([0.0] * len(r["prompt_ids"]) + [1.0] * len(r["response_ids"])) for r in rows
    )
    images = [
        None if r["pixel_values"] is None else RowImages(r["pixel_values"], r["grids"])
        for r in rows
    ]
    half = len(rows) // 2
    report = {}
    for name, given in (("responses", images), ("other_image", images[half:] + images[:half])):
        batch = TokenBatch(tokens, masks, masks, None, None, tuple(given))
        scored = trainer.logprobs(batch)
        report[name] = [
            row[len(r["prompt_ids"]) - 1 :] for r, row in zip(rows, scored, strict=True)
        ]
    print(json.dumps(report), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
