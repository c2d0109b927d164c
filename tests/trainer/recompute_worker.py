"""torchrun worker (two ranks): activation recomputation (trainer.recompute) on the real Trainer
(Megatron-core, CPU, fp32) gives the gradients of no recomputation, and keeps less.

argv: dense_model moe_model memory_model. Each case trains one PPO step on one ragged batch
(``layout_invariance_worker.batch``) with recompute none, selective and full, each a fresh
Trainer, and reports per mode the largest |gradient - none's gradient| of this rank's
parameters, the largest gradient, the step's metrics, and how many core attentions and layers
ran inside a recomputation. One-rank cases run on each rank alone, in parallel (rank 0 dense,
rank 1 MoE), then two-rank cases on both. ``backward_in_a_thread`` (rank 0): a forward here,
its backward in a new thread (a fresh context, as autograd's device threads on GPUs).
``memory`` (rank 1) and ``memory_cp2`` (both, context parallel): the bytes a training forward
keeps for its backward, per mode, on ``memory_model``. Rank 0 prints one JSON line
{case: report}.
"""

import json
import sys
import threading
from pathlib import Path

import torch
import torch.distributed as dist
from layout_invariance_worker import batch

from relax_launch import platform
from relax_launch.placement.plan import TrainerLayout
from relax_launch.runtime.groups import build_trainer_groups
from relax_launch.trainer.batch import TokenBatch
from relax_launch.trainer.config import TrainerConfig
from relax_launch.trainer.losses import LossSpec

MODES = ("none", "selective", "full")
BUDGET = {"max_tokens_per_micro_batch": 64}
LORA_DROPOUT = {"rank": 4, "dropout": 0.2}
# name: (model, TrainerConfig fields, routing replay of random experts)
SOLO = {
    0: {
        "dense_fixed2": ("dense", {"micro_batch_size": 2}, False),
        "dense_packed": ("dense", {**BUDGET, "pack_sequences": True}, False),
        "dense_lora": ("dense", {"micro_batch_size": 4, "lora": {"rank": 4}}, False),
        # the recomputation draws the adapters' dropout masks again: the checkpoint restores
        # the generator (the CPU's here) to its forward's state
        "dense_lora_dropout": ("dense", {"micro_batch_size": 4, "lora": LORA_DROPOUT}, False),
    },
    1: {"moe_replay": ("moe", {**BUDGET, "pack_sequences": True}, True)},
}
BOTH = {
    "dense_pp2_packed": ("dense", {"pp_size": 2, **BUDGET, "pack_sequences": True}, False),
    "dense_cp2_packed": ("dense", {"cp_size": 2, **BUDGET, "pack_sequences": True}, False),
    "moe_tp2_sp_replay": ("moe", {"tp_size": 2, **BUDGET}, True),
    "moe_pp2_replay": ("moe", {"pp_size": 2, **BUDGET, "pack_sequences": True}, True),
}


def with_routing(plain: TokenBatch, trainer) -> TokenBatch:
    """``plain`` carrying random experts to replay (not the router's own choice)."""
    moe = trainer.shape.moe
    generator = torch.Generator().manual_seed(7)
    routed = tuple(
        torch.rand(len(t) - 1, len(moe.layers), moe.num_experts, generator=generator).argsort(-1)[
            ..., : moe.topk
        ]
        for t in plain.tokens
    )
    return TokenBatch(
        plain.tokens, plain.loss_mask, plain.token_weights, plain.old_logprobs, routed
    )


def count_recomputation(trainer) -> dict[str, int]:
    """Counters of core attentions and layers run inside a recomputation."""
    from megatron.core.transformer.transformer_layer import TransformerLayer

    from relax_launch.trainer.attention import CoreAttention
    from relax_launch.trainer.recompute import recomputing

    counts = {"attention": 0, "layer": 0}

    def counter(key: str):
        def hook(*_) -> None:
            counts[key] += recomputing()

        return hook

    for module in trainer.model.module.modules():
        if isinstance(module, CoreAttention):
            module.register_forward_hook(counter("attention"))
        elif isinstance(module, TransformerLayer):
            module.register_forward_hook(counter("layer"))
    return counts


def grads_of(trainer) -> dict[str, torch.Tensor]:
    return {
        n: p.main_grad.clone()
        for n, p in trainer.model.module.named_parameters()
        if getattr(p, "main_grad", None) is not None
    }


def step(model_dir: str, pgc, layout: TrainerLayout, settings: dict, replay: bool, mode: str):
    from relax_launch.trainer.trainer import Trainer

    section = TrainerConfig(
        model=model_dir,
        ranks=len(layout.ranks),
        lr=1e-3,
        clip_grad=0.0,
        dtype="float32",
        recompute=mode,
        **settings,
    )
    trainer = Trainer(section=section, model_dir=Path(model_dir), pgc=pgc, device="cpu")
    counts = count_recomputation(trainer)
    shard = batch().shards(layout.dp_size)[layout.coordinates(dist.get_rank())[1]]
    if replay:
        shard = with_routing(shard, trainer)
    metrics = trainer.train_step(shard, LossSpec())
    return trainer, grads_of(trainer), metrics, counts


def run_case(model_dir: str, pgc, layout: TrainerLayout, settings: dict, replay: bool) -> dict:
    report, reference = {}, None
    for mode in MODES:
        _, grads, metrics, counts = step(model_dir, pgc, layout, settings, replay, mode)
        reference = reference or grads
        off = max(float((grads[n] - g).abs().max()) for n, g in reference.items())
        largest = max(float(g.abs().max()) for g in grads.values())
        report[mode] = {"off": off, "largest": largest, "metrics": metrics, **counts}
    return report


def backward_in_a_thread(model_dir: str, pgc, layout: TrainerLayout) -> dict:
    """One packed micro-batch's forward here and its backward in a new thread, per mode; the
    largest gradient difference from none's."""
    report, reference = {}, None
    settings = {**BUDGET, "pack_sequences": True}
    for mode in MODES:
        trainer, *_ = step(model_dir, pgc, layout, settings, False, mode)
        micro = trainer._micro_batches(batch())[0]
        trainer.model.zero_grad_buffer()
        loss = trainer.model(micro["inputs"], micro["positions"], None, labels=micro["targets"])
        errors = []

        def backward(loss=loss, errors=errors) -> None:
            try:
                loss.sum().backward()
            except (LookupError, RuntimeError) as error:  # reported, not lost with the thread
                errors.append(repr(error))

        thread = threading.Thread(target=backward)
        thread.start()
        thread.join()
        grads = grads_of(trainer)
        reference = reference or grads
        off = max(float((grads[n] - g).abs().max()) for n, g in reference.items())
        report[mode] = {"off": off, "errors": errors}
    return report


def activation_bytes(model_dir: Path, pgc, layout: TrainerLayout, settings: dict) -> dict:
    """Per mode, the bytes of the tensors a training forward of 4 sequences of 256 tokens keeps
    for its backward on this rank (autograd's saved tensors, by storage, parameters excluded)."""
    from relax_launch.trainer.trainer import Trainer

    tokens = [[(7 * i + 3 * j) % 300 + 6 for j in range(256)] for i in range(4)]
    plain = TokenBatch.next_token(tokens, [16] * 4)
    held = {}
    for mode in MODES:
        section = TrainerConfig(
            model=str(model_dir),
            ranks=len(layout.ranks),
            micro_batch_size=4,
            dtype="float32",
            recompute=mode,
            **settings,
        )
        trainer = Trainer(section=section, model_dir=model_dir, pgc=pgc, device="cpu")
        micro = trainer._micro_batches(plain)[0]
        params = {p.untyped_storage().data_ptr() for p in trainer.model.parameters()}
        kept = {}

        def pack(tensor: torch.Tensor, kept=kept, params=params) -> torch.Tensor:
            storage = tensor.untyped_storage()
            if storage.data_ptr() not in params:
                kept[storage.data_ptr()] = storage.nbytes()
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            loss = trainer.model(micro["inputs"], micro["positions"], None, labels=micro["targets"])
        loss.sum().backward()
        held[mode] = sum(kept.values())
    return held


def main() -> None:
    models = {"dense": sys.argv[1], "moe": sys.argv[2]}
    dist.init_process_group(platform.dist_backend("cpu"))
    platform.prepare_megatron("cpu")
    torch.set_num_threads(1)
    rank, backend = dist.get_rank(), platform.dist_backend("cpu")
    solo = {r: TrainerLayout((r,), 1, 1, 1, "train") for r in (0, 1)}
    solo_groups = {r: build_trainer_groups(solo[r], backend) for r in (0, 1)}  # every rank calls
    report = {}
    for name, (model, settings, replay) in SOLO[rank].items():
        report[name] = run_case(models[model], solo_groups[rank], solo[rank], settings, replay)
    if rank == 0:
        report["backward_in_a_thread"] = backward_in_a_thread(
            models["dense"], solo_groups[0], solo[0]
        )
    else:
        report["memory"] = activation_bytes(Path(sys.argv[3]), solo_groups[1], solo[1], {})
    for name, (model, settings, replay) in BOTH.items():
        pp, cp, tp = (settings.get(k, 1) for k in ("pp_size", "cp_size", "tp_size"))
        layout = TrainerLayout((0, 1), tp, pp, 2 // (tp * pp * cp), "train", cp_size=cp)
        pgc = build_trainer_groups(layout, backend)
        report[f"{name} rank{rank}"] = run_case(models[model], pgc, layout, settings, replay)
    # context parallelism: core attention holds its scores over the gathered keys
    layout = TrainerLayout((0, 1), 1, 1, 1, "train", cp_size=2)
    pgc = build_trainer_groups(layout, backend)
    memory = activation_bytes(Path(sys.argv[3]), pgc, layout, {"cp_size": 2})
    report[f"memory_cp2 rank{rank}"] = memory
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, report)
    if rank == 0:
        print(json.dumps({k: v for part in gathered for k, v in part.items()}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
