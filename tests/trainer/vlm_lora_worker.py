"""torchrun worker (TP = the world size): the ``Trainer`` with LoRA on a Qwen2.5-VL policy, on the
RL step's batch with images (``vlm_trainer_worker.batch_of``).

argv: model_dir, scratch directory (shared by the ranks). Prints one JSON line on rank 0:
{"init_diff": largest |Trainer.logprobs - transformers' base| at init (B = 0), "tokens":
compared, "adapters": adapter tensors, "adapters_changed": those two steps changed,
"others_changed": any other parameter they changed (the base, the tower), "merge_diff": largest
|merged export - (base + scale·B@A)| of a targeted weight, "merged": targeted weights checked,
"untouched_mismatches": other exported tensors not bit-equal to the base checkpoint's,
"synced": names a decoupled sync sends, "synced_vision": the tower's among them,
"export_diff": largest |transformers on the written merged export - Trainer.logprobs| after the
steps, "trained_vs_base": largest |trained - base| logprob, "resume_diff": largest |logprobs
of a fresh trainer loading the checkpoint - the trained one's|, "checkpoint_keys": the kinds
of tensors the checkpoint holds}.
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from vlm_parity_worker import prompts, tp_world_groups, transformers_logprobs
from vlm_trainer_worker import batch_of

from relax_launch.models.vlm_processor import VisionProcessor
from relax_launch.trainer.config import LoraConfig, TrainerConfig
from relax_launch.trainer.hf_dir import finish, read_weights
from relax_launch.trainer.lora import COLUMN, PEFT_PREFIX, SPLIT, is_adapter, peft_tensors
from relax_launch.trainer.losses import LossSpec
from relax_launch.trainer.trainer import Trainer
from relax_launch.trainer.vlm_conversion import LANGUAGE, checkpoint_names


def gathered(tensor: torch.Tensor, dim: int | None, group) -> torch.Tensor:
    if dim is None or group.size() == 1:
        return tensor.detach()
    parts = [torch.empty_like(tensor) for _ in range(group.size())]
    dist.all_gather(parts, tensor.detach().contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def expected_merged(trainer: Trainer, base: dict) -> dict[str, torch.Tensor]:
    """{HF weight: base + scale·B@A} of every targeted weight, from the adapters gathered whole
    and split per projection as PEFT names them (independent of the export's merge)."""
    out, tp = {}, trainer.pgc.tp
    for name, linear in trainer.lora.items():
        column = SPLIT[name.rsplit(".", 2)[-2]] == COLUMN
        a = gathered(linear.lora_a, None if column else 1, tp)
        b = gathered(linear.lora_b, 0 if column else None, tp)
        linear_name = name.removesuffix(".weight")[len(LANGUAGE) :]
        pairs = dict(peft_tensors(linear_name, a, b, trainer.shape, tp.size(), 0))
        for key in (k for k in pairs if k.endswith(".lora_A.weight")):
            stem = key.removesuffix(".lora_A.weight")
            hf = stem[len(PEFT_PREFIX) :] + ".weight"
            delta = pairs[stem + ".lora_B.weight"].double() @ pairs[key].double()
            out[hf] = base[hf].double() + trainer.section.lora.scale * delta
    return out


def largest_gap(a: list[list[float]], b: list[list[float]]) -> float:
    pairs = zip(a, b, strict=True)
    return max(float((torch.tensor(x) - torch.tensor(y)).abs().max()) for x, y in pairs)


def lora_trainer(model_dir: Path, pgc) -> Trainer:
    world = pgc.tp.size()
    section = TrainerConfig(
        model=str(model_dir),
        ranks=world,
        tp_size=world,
        dtype="float32",
        micro_batch_size=2,
        lr=1e-2,
        lora=LoraConfig(rank=8, alpha=16),
    )
    return Trainer(section=section, model_dir=model_dir, pgc=pgc, device="cpu")


def exports(trainer: Trainer, model_dir: Path, trained: list) -> dict:
    """The merged export against base + scale·B@A, what a sync sends, and transformers' logprobs
    of the export written as a model directory against the trainer's."""
    base = checkpoint_names(read_weights(model_dir))
    exported = {name: t.clone() for name, t in trainer.export_hf_weights()}
    expected = expected_merged(trainer, base)
    synced = [name for name, *_ in trainer.export_manifest(changed_only=True)]
    out = Path(sys.argv[2]) / "merged"
    out.mkdir(exist_ok=True)
    weight_map = trainer.export_hf(out, "float32")
    if dist.get_rank() != 0:
        return {}
    finish(out, weight_map, model_dir, "float32", "test")
    rows = prompts(VisionProcessor(str(model_dir)))
    merged_rows = [transformers_logprobs(str(out), row).tolist() for row in rows]
    return {
        "merge_diff": max(float((exported[k] - v).abs().max()) for k, v in expected.items()),
        "merged": len(expected),
        "untouched_mismatches": sum(
            not torch.equal(t, base[k]) for k, t in exported.items() if k not in expected
        ),
        "exported": len(exported),
        "synced": sorted(synced) == sorted(expected),
        "synced_vision": sum(n.startswith("visual.") for n in synced),
        "export_diff": largest_gap(merged_rows, trained[: len(rows)]),
    }


def main() -> None:
    pgc = tp_world_groups()
    model_dir, scratch = Path(sys.argv[1]), Path(sys.argv[2])
    trainer = lora_trainer(model_dir, pgc)
    processor = VisionProcessor(str(model_dir))
    rows = prompts(processor)
    rows = rows + rows[:1]  # four rows: two micro-batches of two
    reply = len(processor.tokenizer("The answer is 3.<|im_end|>")["input_ids"])
    batch = batch_of(rows, [len(r.ids) - reply for r in rows])
    base_rows = [transformers_logprobs(str(model_dir), row).tolist() for row in rows]
    report = {"init_diff": largest_gap(trainer.logprobs(batch), base_rows)}
    report |= {"tokens": sum(len(r) for r in base_rows)}

    before = {n: p.detach().clone() for n, p in trainer.model.module.named_parameters()}
    for _ in range(2):  # the first step moves B alone (A's gradient is B's, zero at init)
        trainer.train_step(batch, LossSpec())
    changed = {
        n for n, p in trainer.model.module.named_parameters() if not torch.equal(p, before[n])
    }
    report |= {"adapters": sum(is_adapter(n) for n in before)}
    report |= {"adapters_changed": sum(is_adapter(n) for n in changed)}
    report |= {"others_changed": sorted(n for n in changed if not is_adapter(n))}
    trained = trainer.logprobs(batch)
    report |= {"trained_vs_base": largest_gap(trained, base_rows)}
    report |= exports(trainer, model_dir, trained)

    trainer.save(scratch)  # every rank its shard (one data-parallel replica)
    dist.barrier()
    resumed = lora_trainer(model_dir, pgc)
    resumed.load(scratch)
    report |= {"resume_diff": largest_gap(resumed.logprobs(batch), trained)}
    if dist.get_rank() == 0:
        state = torch.load(scratch / trainer.shard_name, weights_only=False)["model"]
        report |= {"checkpoint_keys": sorted({k.rsplit(".", 1)[-1] for k in state})}
        print(json.dumps(report), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
