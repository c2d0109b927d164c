"""torchrun worker (TP = the world size): the ``Trainer`` with a Qwen2.5-VL policy on a batch
with images, as the RL step gives it: packed and unpacked as the shard channel sends it, padded
micro-batches of two rows, the loss masking the prompt (image placeholders included).

argv: model_dir, freeze_vision (0/1). Prints one JSON line on rank 0: {"logprob_diff": largest
|Trainer.logprobs - transformers| over every row, "tokens": compared, "image_rows": rows with
images, "export_mismatches": HF tensors of ``export_hf_weights`` not bit-equal to the
checkpoint's (before the step), "exported": their count, "vision_changed": tower tensors the
step changed, "language_changed": language tensors it changed, "synced": names a decoupled
sync sends after the step, "loss": the step's loss}.
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from vlm_parity_worker import prompts, tp_world_groups, transformers_logprobs

from relax_launch.models.vlm_processor import VisionProcessor
from relax_launch.trainer.batch import RowImages, TokenBatch
from relax_launch.trainer.config import TrainerConfig
from relax_launch.trainer.hf_dir import read_weights
from relax_launch.trainer.losses import LossSpec
from relax_launch.trainer.trainer import Trainer
from relax_launch.trainer.vlm_conversion import checkpoint_names


def batch_of(rows, prompt_lengths) -> TokenBatch:
    """The RL step's batch of ``rows``: the prompt (images included) masked, advantage 1."""
    tokens = tuple(tuple(r.ids) for r in rows)
    masks = tuple(
        tuple(float(j >= n) for j in range(len(t)))
        for t, n in zip(tokens, prompt_lengths, strict=True)
    )
    old = tuple(
        tuple(0.0 if j < n else -1.0 for j in range(len(t)))
        for t, n in zip(tokens, prompt_lengths, strict=True)
    )
    images = tuple(
        None if r.pixel_values is None else RowImages(r.pixel_values, r.image_grid_thw)
        for r in rows
    )
    batch = TokenBatch(tokens, masks, masks, old, None, images)
    packed = batch.pack()
    return TokenBatch.unpack(packed[0], packed[1], batch.shape(), *packed[2:])


def main() -> None:
    pgc = tp_world_groups()
    world = pgc.tp.size()
    model_dir, freeze = sys.argv[1], sys.argv[2] == "1"
    section = TrainerConfig(
        model=model_dir,
        ranks=world,
        tp_size=world,
        dtype="float32",
        micro_batch_size=2,
        lr=1e-2,
        freeze_vision=freeze,
    )
    trainer = Trainer(section=section, model_dir=Path(model_dir), pgc=pgc, device="cpu")
    processor = VisionProcessor(model_dir)
    rows = prompts(processor)
    rows = rows + rows[:1]  # four rows: two micro-batches of two
    reply = len(processor.tokenizer("The answer is 3.<|im_end|>")["input_ids"])
    batch = batch_of(rows, [len(r.ids) - reply for r in rows])
    ours = trainer.logprobs(batch)
    diff, tokens = 0.0, 0
    for row, mine in zip(rows, ours, strict=True):
        theirs = transformers_logprobs(model_dir, row)
        diff = max(diff, float((torch.tensor(mine) - theirs).abs().max()))
        tokens += len(mine)
    original = checkpoint_names(read_weights(Path(model_dir)))
    # clones: a whole tensor is exported as the parameter itself
    exported = {name: t.clone() for name, t in trainer.export_hf_weights()}
    bad = [n for n in original if n not in exported or not torch.equal(exported[n], original[n])]
    metrics = trainer.train_step(batch, LossSpec())
    after = dict(trainer.export_hf_weights())
    changed = {n for n in after if not torch.equal(after[n], exported[n])}
    synced = [name for name, *_ in trainer.export_manifest(changed_only=True)]
    if dist.get_rank() == 0:
        report = {"logprob_diff": diff, "tokens": tokens, "image_rows": 3}
        report |= {"export_mismatches": len(bad) + len(set(exported) - set(original))}
        report |= {"exported": len(exported), "loss": metrics.get("loss")}
        report |= {"vision_changed": sum(n.startswith("visual.") for n in changed)}
        report |= {"language_changed": sum(not n.startswith("visual.") for n in changed)}
        report |= {"synced_vision": sum(n.startswith("visual.") for n in synced)}
        report |= {"synced": len(synced)}
        print(json.dumps(report), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
