"""torchrun worker: offload/onload of the real Trainer's state (Megatron-core, CPU, TP=2).

argv: model_dir. Every rank is a trainer rank and prints one JSON line ``{"rank": r, ...}``:

- ``plain``/``offloaded``: 3 fp32 PPO steps with a KL penalty (the reference model scores every
  batch) without, then with, offload(all)/onload(all) after every step; ``identical`` says
  whether every parameter ends bit-identical, ``changed`` that training moved the weights.
- each cycle first offloads grads+optimizer (a train step must then fail), then params (logprobs,
  export and save must fail), checks every storage is empty, onloads and compares the bytes
  with clones taken before; the tensors are collected here, not by the code under test.
- ``bf16``: the same round trip after one bfloat16 step (fp32 main params, main grads).
- ``channel``: rank 0's ``TrainerClient.offload``/``onload`` through the control channel and
  the real ``TrainerWorker`` handlers, and a save while offloaded (its error comes back named).
"""

import json
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

from relax_launch import platform
from relax_launch.placement.plan import TrainerLayout
from relax_launch.runtime.control import ControlChannel, RemoteError, Shutdown
from relax_launch.runtime.distributed import ShardChannel, init_distributed
from relax_launch.runtime.groups import build_trainer_groups
from relax_launch.trainer.batch import TokenBatch
from relax_launch.trainer.config import TrainerConfig
from relax_launch.trainer.losses import LossSpec
from relax_launch.trainer.offload import DISCARDED

SPEC = LossSpec(kl_coef=0.1)
STEPS = 3


def batches(trainer) -> list[TokenBatch]:
    """STEPS PPO batches whose old logprobs are the initial policy's, shifted so some clip."""
    gen = torch.Generator().manual_seed(7)
    out = []
    for step in range(STEPS):
        tokens = [torch.randint(6, 320, (n,), generator=gen).tolist() for n in (9, 12)]
        plain = TokenBatch.next_token(tokens, [3, 4])
        old = [[0.0, *(lp + 0.1 * (step - 1) for lp in row)] for row in trainer.logprobs(plain)]
        advantages = [[1.0 if i % 2 else -0.5 for _ in t] for i, t in enumerate(tokens)]
        out.append(
            TokenBatch(
                plain.tokens,
                plain.loss_mask,
                tuple(map(tuple, advantages)),
                tuple(map(tuple, old)),
            )
        )
    return out


def state_tensors(trainer) -> dict[str, list[torch.Tensor]]:
    """Every tensor of each part, found independently of ``trainer/offload.py``."""
    model_params = list(trainer.model.parameters())
    grads = [b.grad_data for b in trainer.model.buffers]
    grads += [p.main_grad for p in model_params]
    optimizer = []
    for inner in trainer.optimizer.chained_optimizers:
        for group in getattr(inner, "fp32_from_float16_groups", []):
            optimizer += group  # fp32 main params (bfloat16)
            grads += [p.grad for p in group if p.grad is not None]
        for per_param in inner.optimizer.state.values():
            optimizer += [v for v in per_param.values() if isinstance(v, torch.Tensor)]
    params = model_params + list(trainer.reference.parameters())
    return {"params": params, "grads": grads, "optimizer": optimizer}


def empty(tensors: list[torch.Tensor]) -> bool:
    return all(t.untyped_storage().size() == 0 for t in tensors)


def raises(call, *args) -> str:
    from relax_launch.trainer.offload import OffloadedError

    try:
        result = call(*args)
        if hasattr(result, "__next__"):
            next(result)
    except OffloadedError as exc:
        return str(exc)
    return ""


def cycle(trainer, batch: TokenBatch, report: dict) -> None:
    """Offload in two stages, check what must fail and that memory is empty, onload, compare."""
    tensors = state_tensors(trainer)
    before = {part: [t.clone() for t in ts] for part, ts in tensors.items()}
    moved = trainer.offload(("grads", "optimizer"))
    checks = report.setdefault("checks", [])
    checks.append(
        {
            "grads_optimizer_bytes": moved["bytes"],
            "train_step_error": raises(trainer.train_step, batch, SPEC),
            "params_resident": trainer.resident("params") and not empty(tensors["params"]),
            "grads_resident": trainer.resident("grads"),
        }
    )
    checks[-1]["params_bytes"] = trainer.offload(("params", "grads", "optimizer"))["bytes"]
    checks[-1]["again_bytes"] = trainer.offload(("params",))["bytes"]
    with tempfile.TemporaryDirectory() as directory:
        checks[-1]["save_error"] = raises(trainer.save, Path(directory))
    checks[-1]["logprobs_error"] = raises(trainer.logprobs, batch)
    checks[-1]["export_error"] = raises(trainer.export_hf_weights)
    checks[-1]["empty"] = {part: empty(ts) for part, ts in tensors.items()}
    checks[-1]["onload_bytes"] = trainer.onload(("params", "grads", "optimizer"))["bytes"]
    checks[-1]["onload_again_bytes"] = trainer.onload(("grads",))["bytes"]
    checks[-1]["restored"] = {  # bit-exact; grads come back as zeros (a step zeroes them)
        part: all(
            torch.equal(a, torch.zeros_like(b) if part in DISCARDED else b)
            for a, b in zip(ts, before[part], strict=True)
        )
        for part, ts in tensors.items()
    }


def through_channel(trainer, store, layout: TrainerLayout, pgc, directory: str) -> dict:
    """Offload and onload every rank's state by command from rank 0; rank 0 reports."""
    from relax_launch.runtime.session import TrainerClient
    from relax_launch.runtime.workers import TrainerWorker

    rank = dist.get_rank()
    shards = ShardChannel(layout, rank, "cpu", pgc.mp)
    channel = ControlChannel(
        store, rank=rank, roles=dict.fromkeys(layout.ranks, "trainer"), timeout_s=60
    )
    handlers = TrainerWorker(
        trainer=trainer, shards=shards, device="cpu", host="127.0.0.1"
    ).handlers()
    report = {}
    if rank == 0:
        client = TrainerClient(channel, shards, layout, handlers)
        report["offload"] = client.offload()
        try:
            client.save(directory)
        except RemoteError as exc:
            report["save_error"] = str(exc)
        report["onload_params"] = client.onload(("params",))
        report["onload"] = client.onload()
        channel.call(Shutdown(), layout.ranks)
    else:
        channel.serve(handlers)
    channel.close()
    return report


def train(section: TrainerConfig, pgc, offload: bool, report: dict) -> tuple[dict, object]:
    from relax_launch.trainer.trainer import Trainer

    trainer = Trainer(
        section=section, model_dir=Path(section.model), pgc=pgc, device="cpu", reference=True
    )
    initial = {n: p.detach().clone() for n, p in trainer.model.module.named_parameters()}
    for batch in batches(trainer):
        trainer.train_step(batch, SPEC)
        if offload:
            cycle(trainer, batch, report)
        if section.dtype != "float32":
            break
    final = {n: p.detach().clone() for n, p in trainer.model.module.named_parameters()}
    report["changed"] = any(not torch.equal(initial[n], final[n]) for n in final)
    return final, trainer


def main() -> None:
    torch.set_num_threads(1)  # one thread: the float sums run in one order every time
    model_dir = sys.argv[1]
    store = init_distributed("cpu", 60)
    world = dist.get_world_size()
    layout = TrainerLayout(tuple(range(world)), tp_size=2, pp_size=1, dp_size=1, phase="train")
    pgc = build_trainer_groups(layout, platform.dist_backend("cpu"))
    platform.prepare_megatron("cpu")
    section = TrainerConfig(
        model=model_dir, ranks=world, tp_size=2, micro_batch_size=1, lr=1e-2, dtype="float32"
    )
    plain, offloaded, bf16 = {}, {}, {}
    expected, _ = train(section, pgc, False, plain)
    got, trainer = train(section, pgc, True, offloaded)
    train(section.model_copy(update={"dtype": "bfloat16"}), pgc, True, bf16)
    identical = [n for n in expected if torch.equal(expected[n], got[n])]
    with tempfile.TemporaryDirectory() as directory:
        channel = through_channel(trainer, store, layout, pgc, directory)
    report = {"rank": dist.get_rank(), "plain": plain, "offloaded": offloaded, "bf16": bf16}
    report |= {"channel": channel, "per_rank_bytes": offloaded["checks"][0]["onload_bytes"]}
    report |= {"identical": len(identical) == len(expected), "params": len(expected)}
    print(json.dumps(report), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
