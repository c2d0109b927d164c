"""The GPU check: what only a GPU can show, sized for one GPU, no network and a few minutes.

usage: python scripts/gpu_check.py [--device cuda|cpu] [--out TABLE.md]

Parts, each rows of one table (exit 1 if any row fails):
  device       the GPU seen, its memory, and device binding (platform.bind_device)
  trainer      the Megatron trainer built from a tiny HF Llama on the device, in fp32 and in
               bf16: per-token logprobs against transformers on the same device, three train
               steps that lower the loss, Megatron's model-parallel RNG seeded
  offload      trainer state (params, grads, optimizer) offloaded: the device memory it held is
               free (CUDA allocator, or this process's RSS on the CPU), then onloaded bit-exact
  collectives  the weight sync's wait on its own backend (NCCL on a GPU; on the CPU gloo with
               NCCL's semantics): a broadcast queued 2 s behind a kernel, waited for by the
               project's helper without an abort, and beside it what ``wait(timeout)`` does
               to the same kind of broadcast (it aborts the group)
  colocated    the colocated weight transport between two processes on the one device: buckets
               handed over by CUDA IPC (shared memory on the CPU) into a receiving process's
               model through the engines' receiver code, every byte checked
  engines      only where SGLang is installed (it does not fit on a machine without network):
               a job whose trainer and SGLang rollout engine sync weights and compare logprobs,
               then two RL steps; elsewhere the row says it did not run
``--device cpu`` runs the same parts on the CPU (the default tests do: the script cannot rot);
docs/gpu.md says how to run it on a one-GPU machine and on a full GPU node.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the project itself needs no install: its source travels
SEQUENCES = [[1, 42, 99, 7, 150, 23, 61, 88, 31, 4], [1, 270, 12, 55, 200, 13, 77]]
TOLERANCE = {"float32": 1e-4, "bfloat16": 6e-2}  # |trainer - transformers| per-token logprob
Row = tuple[str, str, bool]


def device_rows(device: str) -> list[Row]:
    import torch

    from relax_launch import platform

    if device == "cpu":
        return [("device", f"CPU, torch {torch.__version__} (dry run)", True)]
    if not torch.cuda.is_available():
        return [("device", f"torch {torch.__version__} sees no CUDA device", False)]
    platform.bind_device("cuda", 0)
    props = torch.cuda.get_device_properties(0)
    bound = torch.cuda.current_device() == 0 and torch.empty(1, device="cuda").device.index == 0
    gpu = f"{props.name}, {props.total_memory / 2**30:.0f} GiB, torch {torch.__version__}"
    return [("device", gpu, True), ("device binding (local rank 0 -> cuda:0)", "bound", bound)]


def trainer_group(device: str):
    """A one-rank job: torch.distributed, the trainer's groups and Megatron's set-up."""
    import torch.distributed as dist

    from relax_launch import platform
    from relax_launch.inference.process import free_port
    from relax_launch.placement.plan import TrainerLayout
    from relax_launch.runtime.groups import build_trainer_groups

    backend = platform.dist_backend(device)
    dist.init_process_group(
        backend, init_method=f"tcp://127.0.0.1:{free_port()}", world_size=1, rank=0
    )
    layout = TrainerLayout(ranks=(0,), tp_size=1, pp_size=1, dp_size=1, phase="train")
    pgc = build_trainer_groups(layout, backend)
    platform.prepare_megatron(device, seed=1234)
    return pgc


def hf_logprobs(model_dir: Path, dtype: str, device: str) -> list[list[float]]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype))
    model = model.to(device).eval()
    rows = []
    with torch.no_grad():
        for tokens in SEQUENCES:
            ids = torch.tensor([tokens], device=device)
            logits = model(ids).logits.float().log_softmax(-1)[0, :-1]
            rows.append(logits.gather(-1, ids[0, 1:, None])[:, 0].tolist())
    return rows


def trainer_rows(device: str, model_dir: Path, pgc, dtype: str) -> tuple[list[Row], object]:
    import torch

    from relax_launch.trainer.batch import TokenBatch
    from relax_launch.trainer.config import TrainerConfig
    from relax_launch.trainer.trainer import Trainer

    section = TrainerConfig(model=str(model_dir), ranks=1, dtype=dtype, micro_batch_size=1, lr=1e-2)
    trainer = Trainer(section=section, model_dir=model_dir, pgc=pgc, device=device)
    batch = TokenBatch.next_token(SEQUENCES, [1] * len(SEQUENCES))
    ours = trainer.logprobs(batch)
    theirs = hf_logprobs(model_dir, dtype, trainer.torch_device)
    worst = max(
        float((torch.tensor(a) - torch.tensor(b)).abs().max())
        for a, b in zip(ours, theirs, strict=True)
    )
    on_device = all(p.device.type == device for p in trainer.model.parameters())
    losses = [trainer.train_step(batch)["loss"] for _ in range(3)]
    rows = [
        (f"trainer {dtype}: logprobs vs transformers", f"{worst:.2e}", worst <= TOLERANCE[dtype]),
        (f"trainer {dtype}: parameters on {device}", str(on_device), on_device),
        (
            f"trainer {dtype}: 3 train steps",
            "loss " + " > ".join(f"{x:.3f}" for x in losses),
            losses[2] < losses[0],
        ),
    ]
    if device == "cuda":
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        states = get_cuda_rng_tracker().get_states()
        seeded = (f"trainer {dtype}: model-parallel RNG seeded", str(sorted(states)), bool(states))
        rows.append(seeded)
    return rows, trainer


def offload_rows(device: str, trainer) -> list[Row]:
    """On a GPU the CUDA allocator's count must drop by what was moved; on the CPU the bytes
    only change places (host to host), so the check is that the state's storages are empty."""
    import torch

    from relax_launch.trainer.batch import TokenBatch

    batch = TokenBatch.next_token(SEQUENCES, [1] * len(SEQUENCES))
    before_values = trainer.logprobs(batch)
    if device == "cuda":
        torch.cuda.synchronize()
    before = torch.cuda.memory_allocated() if device == "cuda" else 0
    moved = trainer.offload()["bytes"]
    if device == "cuda":
        freed = before - torch.cuda.memory_allocated()
        released = freed >= 0.9 * moved
        result = f"{moved / 1e6:.1f} MB moved, {freed / 1e6:.1f} MB freed on the GPU"
    else:
        left = sum(p.untyped_storage().size() for p in trainer.model.parameters())
        released = left == 0 and moved > 0
        result = f"{moved / 1e6:.1f} MB moved, parameter storages left {left} B"
    trainer.onload()
    same = trainer.logprobs(batch) == before_values
    if device == "cuda":
        torch.cuda.empty_cache()
    return [
        ("offload: device memory released", result, released),
        ("onload: logprobs bit-identical", str(same), same),
    ]


def _receive(payloads: mp.Queue, results: mp.Queue, shapes: dict) -> None:
    """The receiving process: a model of the given shapes on the device, filled by the engines'
    own receiver code from each handed-over bucket; reports a checksum per tensor."""
    import torch

    from relax_launch.weights import colocated, receiver

    device = "cuda" if torch.cuda.is_available() else "cpu"

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            for name, shape in shapes.items():
                self.register_parameter(name, torch.nn.Parameter(torch.zeros(shape, device=device)))

    class Updater:  # what receiver.load_bucket reads of SGLang's weight updater
        def __init__(self) -> None:
            self.model, self.device = Model(), device

        def get_model(self):
            return self.model

    updater = Updater()
    while (payload := payloads.get()) is not None:
        ok, message = receiver.load_bucket(
            None,
            updater,
            named_tensors=colocated.taken_over(payload),
            load_format=receiver.IN_PLACE,
        )
        results.put(message)
    sums = {n: float(p.detach().double().sum()) for n, p in updater.model.named_parameters()}
    results.put(json.dumps(sums))


def colocated_rows(device: str) -> list[Row]:
    """Two buckets' worth of tensors handed to a second process, as BucketSender does."""
    import torch

    from relax_launch.weights import colocated

    torch.manual_seed(0)
    where = torch.device("cuda", 0) if device == "cuda" else torch.device("cpu")
    weights = {f"w{i}": torch.randn(256, 1024, device=where) for i in range(8)}  # 8 MiB
    shapes = {n: list(t.shape) for n, t in weights.items()}
    context = mp.get_context("spawn")
    payloads, results = context.Queue(), context.Queue()
    process = context.Process(target=_receive, args=(payloads, results, shapes))
    process.start()
    began, reports = time.monotonic(), []
    half = len(weights) // 2
    for number, names in enumerate((list(weights)[:half], list(weights)[half:])):
        nbytes = sum(weights[n].numel() * 4 for n in names)
        if device == "cuda":
            bucket = handle = torch.empty(nbytes, dtype=torch.uint8, device=where)
        else:  # as BucketSender does on the CPU: a file in /dev/shm, mapped by both sides
            path = f"{colocated.SHM_DIR}/relax-launch-gpu-check-{os.getpid()}-{number}"
            Path(path).write_bytes(b"")
            os.truncate(path, nbytes)
            bucket, handle = colocated.shared_file(path, nbytes), (path, nbytes)
        layout, offset = [], 0
        for name in names:
            size = weights[name].numel() * 4
            bucket[offset : offset + size].view(torch.float32).view(shapes[name]).copy_(
                weights[name]
            )
            layout.append((name, "float32", shapes[name], offset))
            offset += size
        payloads.put(colocated.handover(handle, layout))
        reports.append(results.get(timeout=120))  # the bucket lives until its load is done
        if device == "cpu":
            os.unlink(path)
    payloads.put(None)
    sums = json.loads(results.get(timeout=120))
    process.join(60)
    seconds = time.monotonic() - began
    exact = all(abs(sums[n] - float(t.double().sum())) < 1e-6 for n, t in weights.items())
    in_place = all('"staged": 0' in r for r in reports)
    how = "CUDA IPC" if device == "cuda" else "shared memory"
    return [
        (f"colocated transport ({how}, 2 processes)", f"{len(weights)} tensors, {seconds:.2f} s",
         exact and process.exitcode == 0),
        ("colocated transport: into the parameters", reports[-1].split("receiver: ")[-1], in_place),
    ]  # fmt: skip


def slow_broadcast(device: str, seconds: float):
    """A one-rank group of the weight sync's backend and a broadcast in it that completes
    ``seconds`` from now: on a GPU queued behind a kernel that sleeps that long (NCCL's stream
    waits for the current one), on the CPU slowed by the CPU backend's test setting."""
    import torch
    import torch.distributed as dist

    from relax_launch import platform
    from relax_launch.platform.nccl_semantics import SLOW_BROADCAST_ENV

    os.environ[SLOW_BROADCAST_ENV] = str(seconds if device == "cpu" else 0)
    group = dist.new_group([0], backend=platform.weight_sync_backend(device))
    tensor = torch.ones(1024, device=platform.torch_device(device))
    if device == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(10**7)
        end.record()
        end.synchronize()
        cycles_per_s = 10**7 / (start.elapsed_time(end) / 1000)
        torch.cuda._sleep(int(seconds * cycles_per_s))
    return group, dist.broadcast(tensor, group=group, group_src=0, async_op=True)


def collective_rows(device: str) -> list[Row]:
    """The wait the weight sync uses, and the one it must not use, on queued broadcasts."""
    from datetime import timedelta

    import torch.distributed as dist

    from relax_launch.deadline import Deadline
    from relax_launch.weights.collective_wait import wait_for

    group, work = slow_broadcast(device, 2.0)
    waited = wait_for(work, Deadline(60), "the check's broadcast")
    rows = [("collectives: broadcast 2 s behind a kernel, polled (wait_for)",
             f"waited {waited:.1f} s", waited >= 1.5)]  # fmt: skip
    rows.append(("collectives: the group usable after it", "yes", _usable(device, group)))
    group_b, work_b = slow_broadcast(device, 2.0)
    try:
        work_b.wait(timedelta(seconds=1))
        outcome, aborted = "returned without an error", False
    except Exception as exc:  # noqa: BLE001 - what NCCL raises is the row's content
        outcome, aborted = f"raised {type(exc).__name__}", True
    usable = _usable(device, group_b)
    name = "collectives: beside it, wait(timeout=1 s) on the same broadcast"
    rows.append((name, f"{outcome}; group usable after: {usable}", aborted and not usable))
    for done in (group, group_b):
        dist.destroy_process_group(done)
    return rows


def _usable(device: str, group) -> bool:
    import torch
    import torch.distributed as dist

    from relax_launch import platform

    try:
        tensor = torch.ones(4, device=platform.torch_device(device))
        dist.broadcast(tensor, group=group, group_src=0)
        return True
    except Exception:  # noqa: BLE001 - an aborted group's error, whatever its type
        return False


def engine_rows(device: str, work: Path) -> list[Row]:
    """The engine parts, where SGLang is installed: the sync-and-parity job, then RL steps."""
    if importlib.util.find_spec("sglang") is None:
        return [("engines", "not run: SGLang is not installed here", True)]
    import torch

    gpus = torch.cuda.device_count() if device == "cuda" else 2
    config = REPO / "configs" / "gpu_check.yaml"
    overrides = [] if device == "cuda" else ["cluster.device=cpu"]
    if gpus < 2:  # trainer and engine share the GPU: colocated, weights over CUDA IPC
        overrides += ["cluster.nproc_per_node=1", "placement.mode=split", "trainer.ranks=null"]
    cli = [str(Path(sys.executable).with_name("relax-launch")), "run", str(config)]
    logs = work / "rl-logs"
    began = time.monotonic()
    done = subprocess.run(
        [*cli, *overrides, f"logging.dir={logs}"], capture_output=True, text=True, timeout=600
    )
    seconds = time.monotonic() - began
    metrics = logs / "metrics.jsonl"
    steps = [json.loads(x) for x in metrics.read_text().splitlines()] if metrics.is_file() else []
    rows = [("engines: RL job, 2 steps", f"{seconds:.0f} s", len(steps) == 2)]
    for step in steps:
        rows.append(
            (f"  step {step['step']}", f"reward {step['reward']:.3f}, {step['time/step']:.1f} s",
             True)
        )  # fmt: skip
    if len(steps) != 2:
        print(done.stdout[-3000:] + done.stderr[-3000:])
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--out", type=Path, help="also write the table here (Markdown)")
    parser.add_argument("--no-engines", action="store_true", help="skip the engine parts")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    warnings.simplefilter("ignore")  # libraries' notes (no Apex, no Transformer Engine)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    from relax_launch.models.build import ensure_model

    began = time.monotonic()
    rows = device_rows(args.device)
    if all(ok for _, _, ok in rows):
        model_dir = ensure_model("builtin:tiny-llama")
        pgc = trainer_group(args.device)
        for dtype in ("float32", "bfloat16"):
            trainer_part, trainer = trainer_rows(args.device, model_dir, pgc, dtype)
            rows += trainer_part
        rows += offload_rows(args.device, trainer)
        del trainer
        rows += collective_rows(args.device)
        rows += colocated_rows(args.device)
        if not args.no_engines:
            rows += engine_rows(args.device, Path(tempfile.mkdtemp(prefix="relax-gpu-check-")))
    rows.append(("whole check", f"{time.monotonic() - began:.0f} s", True))
    table = ["| check | result | ok |", "|---|---|---|"]
    table += [f"| {name} | {value} | {'yes' if ok else 'NO'} |" for name, value, ok in rows]
    print("\n".join(table))
    if args.out:
        args.out.write_text("\n".join(table) + "\n")
    failed = [name for name, _, ok in rows if not ok]
    print(f"\ngpu_check: {'FAILED: ' + ', '.join(failed) if failed else 'passed'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
