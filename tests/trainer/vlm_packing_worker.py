"""torchrun worker (TP = the world size): the ``Trainer`` with a Qwen2.5-VL policy on packed
micro-batches (several sequences with images end to end in one row) against padded ones and
transformers, as the RL step gives the batch (through the shard channel's packing).

argv: model_dir. Prints one JSON line on rank 0: {"packed_vs_padded": largest |packed - padded|
``Trainer.logprobs``, "packed_vs_transformers": largest |packed - transformers|, "tokens":
compared, "sequences_per_row": the packed micro-batch's sequences, "grad_diff": largest |packed -
padded| gradient of a weight relative to that weight's largest padded gradient, over every
weight (the tower's included), "grad_tensors": weights with a non-zero gradient, "tensors":
weights, "loss_diff": |packed - padded| step loss, "padded_tokens"/"packed_tokens": tokens
each layout computes}.
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from vlm_parity_worker import prompts, tp_world_groups, transformers_logprobs
from vlm_trainer_worker import batch_of

from relax_launch.models.vlm_processor import VisionProcessor
from relax_launch.trainer.config import TrainerConfig
from relax_launch.trainer.losses import LossSpec
from relax_launch.trainer.trainer import Trainer


def trainer(model_dir: str, pgc, world: int, **layout) -> Trainer:
    section = TrainerConfig(
        model=model_dir, ranks=world, tp_size=world, dtype="float32", lr=1e-2, **layout
    )
    return Trainer(section=section, model_dir=Path(model_dir), pgc=pgc, device="cpu")


def step_grads(ours: Trainer, batch) -> tuple[dict[str, torch.Tensor], float]:
    """The weights' gradients (Megatron's DDP buffers, kept after the step) and the loss."""
    metrics = ours.train_step(batch, LossSpec())
    grads = {n: p.main_grad.clone() for n, p in ours.model.module.named_parameters()}
    return grads, float(metrics["loss"])


def computed_tokens(ours: Trainer, batch) -> int:
    return sum(b["inputs"].numel() for b in ours._micro_batches(batch))


def main() -> None:
    pgc = tp_world_groups()
    world = pgc.tp.size()
    model_dir = sys.argv[1]
    processor = VisionProcessor(model_dir)
    rows = prompts(processor)
    rows = rows + rows[1:2]  # four rows, three with images (four images)
    reply = len(processor.tokenizer("The answer is 3.<|im_end|>")["input_ids"])
    batch = batch_of(rows, [len(r.ids) - reply for r in rows])
    padded = trainer(model_dir, pgc, world, micro_batch_size=2)
    packed = trainer(model_dir, pgc, world, micro_batch_size=4, pack_sequences=True)
    (row,) = packed._micro_batches(batch)
    ours, theirs = packed.logprobs(batch), padded.logprobs(batch)
    report = {"sequences_per_row": len(row["order"]), "tokens": sum(map(len, ours))}
    report["packed_vs_padded"] = max(
        float((torch.tensor(a) - torch.tensor(b)).abs().max())
        for a, b in zip(ours, theirs, strict=True)
    )
    report["packed_vs_transformers"] = max(
        float((torch.tensor(mine) - transformers_logprobs(model_dir, r)).abs().max())
        for r, mine in zip(rows, ours, strict=True)
    )
    report |= {"padded_tokens": computed_tokens(padded, batch)}
    report |= {"packed_tokens": computed_tokens(packed, batch)}
    grads, loss = step_grads(packed, batch)
    reference, reference_loss = step_grads(padded, batch)
    report["loss_diff"] = abs(loss - reference_loss)
    report["grad_diff"] = max(
        float((grads[n] - g).abs().max() / g.abs().max()) for n, g in reference.items() if g.any()
    )
    report["grad_tensors"] = sum(bool(g.any()) for g in reference.values())
    report["tensors"] = len(reference)
    if dist.get_rank() == 0:
        print(json.dumps(report), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
