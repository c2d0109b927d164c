"""torchrun worker (two ranks): the trainer's Megatron-core MoE model against the Hugging Face
model it was converted from, on the same token sequences (fp32, CPU), under several layouts.

argv: layouts model_dir...; layouts like "1x1x1,2x1x1" (tp_size x ep_size x pp_size). Under each
layout each rank scores the sequences as its data-parallel shard (with EP, the ranks exchange
tokens with the experts they route to), then takes one train step on them: its gradient norm
must not depend on the layout. Then, under the last layout, routing replay of random experts.
Rank 0 prints one JSON line per rank: {"TxExP model_dir": {"gap": largest |trainer - transformers|
logprob, "grad_norm": ...}, "replay": {...}}.
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from hf_parity_worker import SEQUENCES, transformers_logprobs

from relax_launch import platform
from relax_launch.placement.plan import TrainerLayout
from relax_launch.runtime.groups import build_trainer_groups
from relax_launch.trainer.batch import TokenBatch
from relax_launch.trainer.config import TrainerConfig


def trainer_for(model_dir: str, tp: int, ep: int, pp: int) -> object:
    from relax_launch.trainer.trainer import Trainer

    world = dist.get_world_size()
    layout = TrainerLayout(tuple(range(world)), tp, pp, world // (tp * pp), "train", ep_size=ep)
    pgc = build_trainer_groups(layout, platform.dist_backend("cpu"))
    section = TrainerConfig(
        model=model_dir,
        ranks=world,
        dtype="float32",
        lr=1e-6,
        **{"tp_size": tp, "ep_size": ep, "pp_size": pp},
    )
    return Trainer(section=section, model_dir=Path(model_dir), pgc=pgc, device="cpu")


def replayed(trainer, batch: TokenBatch) -> dict[str, float]:
    """Logprobs and a train step under routing replay of random experts (the router's own
    choice only by chance): how far the logprobs moved, and the step's routing metrics."""
    moe = trainer.shape.moe
    generator = torch.Generator().manual_seed(7)
    routed = tuple(
        torch.rand(len(t) - 1, len(moe.layers), moe.num_experts, generator=generator).argsort(-1)[
            ..., : moe.topk
        ]
        for t in batch.tokens
    )
    forced = TokenBatch(batch.tokens, batch.loss_mask, batch.token_weights, None, routed)
    natural, replay = trainer.logprobs(batch), trainer.logprobs(forced)
    moved = max(
        abs(a - b) for r, s in zip(natural, replay, strict=True) for a, b in zip(r, s, strict=True)
    )
    metrics = trainer.train_step(forced)
    return {"logprobs_moved": moved} | {k: v for k, v in metrics.items() if "mismatch" in k}


def main() -> None:
    layouts = [tuple(map(int, x.split("x"))) for x in sys.argv[1].split(",")]
    models = sys.argv[2:]
    dist.init_process_group(platform.dist_backend("cpu"))
    platform.prepare_megatron("cpu")
    batch = TokenBatch.next_token(SEQUENCES, [1] * len(SEQUENCES))
    report = {}
    for tp, ep, pp in layouts:
        for model_dir in models:
            trainer = trainer_for(model_dir, tp, ep, pp)
            ours = trainer.logprobs(batch)
            case = {"grad_norm": trainer.train_step(batch)["grad_norm"]}
            if ours is not None:  # the last pipeline stage
                theirs = transformers_logprobs(model_dir)
                case["gap"] = max(
                    float((torch.tensor(a) - torch.tensor(b)).abs().max())
                    for a, b in zip(ours, theirs, strict=True)
                )
            report[f"{tp}x{ep}x{pp} {model_dir}"] = case
    report["replay"] = replayed(trainer, batch)
    reports = [None] * dist.get_world_size()
    dist.all_gather_object(reports, report)
    if dist.get_rank() == 0:  # one writer: two ranks' lines could interleave
        for each in reports:
            print(json.dumps(each), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
