"""torchrun worker: the memory a trainer rank's tensors hold, measured, for the memory plan's test.

argv: CASES_JSON. The file holds a list of cases, each ``{"name", "section": TrainerConfig
fields, "model_dir", "layout": {tp, pp, dp, ep}, "sequences": per DP rank, "tokens": per
sequence, "kl_coef", "steps"}`` (a vision-language model's with ``"image_grid"``: each prompt
opens with one image of that patch grid, [t, h, w]); every rank runs every case in order (all
ranks of the world are trainer ranks); rank 0 prints one JSON line per rank ``{"rank": r,
"runtime": {...}, "cases": {name: ...}}``.

The measure is the bytes held by tensors: under ``torch.profiler`` with ``profile_memory`` every
CPU allocation and free of the case (build, then ``steps`` train steps on a batch of the size the
job implies) is an event with its address, and the live bytes are summed in time order. An
allocation at an address still live means the block was freed where the profiler does not see
it (gloo's threads free the copies it made for a collective): the old block is dropped then.
The first step allocates Adam's state after its backward pass; from the second on the state is
resident through the step, so ``steps`` >= 2 gives the steady peak the memory plan estimates.

Per case: ``peak`` (of the whole case), ``build_peak`` (model build and checkpoint load),
``resident`` (live when the last step starts: parameters, gradients, optimizer state and any
reference model) and ``step_peak`` (of the last step); a case with ``"rss": true`` is not
profiled and gives the process's peak resident set instead (``peak_rss``, and ``rss_before``
the build). ``runtime`` is this process's resident set (RSS) and proportional set (PSS, shared
pages split between the processes mapping them) once it has imported what a job's trainer rank
imports and its process group is up.
"""

import contextlib
import gc
import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile, record_function

from relax_launch import platform
from relax_launch.placement.plan import TrainerLayout
from relax_launch.runtime.groups import build_trainer_groups
from relax_launch.trainer.batch import RowImages, TokenBatch
from relax_launch.trainer.config import TrainerConfig
from relax_launch.trainer.losses import LossSpec

ALLOCATION = "_ExtraFields_Allocation"


def process_memory() -> dict[str, int]:
    """This process's RSS, PSS and anonymous (private, not file-backed) resident bytes
    (/proc/self/smaps_rollup)."""
    found = {}
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("Rss", "Pss", "Anonymous", "Shared_Clean", "Private_Clean"):
            found[key.lower()] = int(rest.split()[0]) * 1024
    return found


def events(prof: profile) -> tuple[list[tuple[int, int, int]], dict[str, tuple[int, int]]]:
    """The allocations (time, address, signed bytes), in time order, and the window of every
    ``record_function`` region named ``case:...``."""
    allocations, windows = [], {}
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        fields = node.extra_fields
        if type(fields).__name__ == ALLOCATION and fields.device.type == "cpu":
            allocations.append((node.start_time_ns, fields.ptr, fields.alloc_size))
        elif node.name.startswith("case:"):
            windows[node.name] = (node.start_time_ns, node.end_time_ns)
        stack.extend(node.children)
    allocations.sort()
    return allocations, windows


def live_bytes(prof: profile, steps: int) -> dict[str, int]:
    """Peaks and levels of the bytes held by tensors over the profiled case."""
    allocations, windows = events(prof)
    build, last = windows["case:build"], windows[f"case:step{steps - 1}"]
    live: dict[int, int] = {}
    total = peak = build_peak = step_peak = 0
    resident = None
    for when, address, size in allocations:
        if resident is None and when >= last[0]:
            resident = total
        if size > 0:
            total += size - live.pop(address, 0)  # a block freed unseen (another thread)
            live[address] = size
        elif address in live:
            total -= live.pop(address)
        peak = max(peak, total)
        if build[0] <= when <= build[1]:
            build_peak = max(build_peak, total)
        if last[0] <= when <= last[1]:
            step_peak = max(step_peak, total)
    return {"peak": peak, "build_peak": build_peak, "resident": resident, "step_peak": step_peak}


def batch(sequences: int, tokens: int, vocab: int, seed: int) -> TokenBatch:
    """``sequences`` PPO sequences of ``tokens`` tokens (half prompt), with old logprobs."""
    gen = torch.Generator().manual_seed(seed)
    ids = [torch.randint(10, vocab, (tokens,), generator=gen).tolist() for _ in range(sequences)]
    plain = TokenBatch.next_token(ids, [tokens // 2] * sequences)
    old = tuple(tuple(-2.0 for _ in row) for row in ids)
    advantages = tuple(tuple(1.0 if i % 2 else -1.0 for _ in row) for i, row in enumerate(ids))
    return TokenBatch(plain.tokens, plain.loss_mask, advantages, old)


def with_images(plain: TokenBatch, grid: list[int], model_dir: Path, seed: int) -> TokenBatch:
    """``plain`` with one random image of patch ``grid`` opening every prompt: its vision
    markers around one image placeholder token per merged 2 x 2 patches."""
    config = json.loads((model_dir / "config.json").read_text())
    image_tokens = grid[0] * grid[1] * grid[2] // 4
    markers = [config["vision_start_token_id"], config["image_token_id"]]
    gen = torch.Generator().manual_seed(seed)
    tokens, images = [], []
    for row in plain.tokens:
        opening = [markers[0]] + [markers[1]] * image_tokens + [config["vision_end_token_id"]]
        tokens.append((*opening, *row[len(opening) :]))
        pixels = torch.randn(4 * image_tokens, 3 * 2 * 14 * 14, generator=gen)
        images.append(RowImages(pixels, torch.tensor([grid])))
    return TokenBatch(
        tuple(tokens), plain.loss_mask, plain.token_weights, plain.old_logprobs, None, tuple(images)
    )


class Groups:
    """One ProcessGroupCollection per layout, created in the same order on every rank."""

    def __init__(self) -> None:
        self.built: dict[tuple, object] = {}

    def get(self, layout: dict[str, int]) -> tuple[object, TrainerLayout]:
        world = dist.get_world_size()
        plan = TrainerLayout(
            tuple(range(world)),
            layout["tp"],
            layout["pp"],
            layout["dp"],
            "train",
            ep_size=layout["ep"],
        )
        key = (plan.tp_size, plan.pp_size, plan.dp_size, plan.ep_size)
        if key not in self.built:
            self.built[key] = build_trainer_groups(plan, platform.dist_backend("cpu"))
        return self.built[key], plan


def run_case(case: dict, groups: Groups, profiled: bool) -> tuple[profile | None, float]:
    """Build the case's trainer and take its steps (under the profiler when ``profiled``,
    each part in a ``case:`` region); the profile and the seconds it took."""
    from relax_launch.trainer.trainer import Trainer

    pgc, layout = groups.get(case["layout"])
    section = TrainerConfig.model_validate(case["section"])
    config = json.loads((Path(case["model_dir"]) / "config.json").read_text())
    vocab = (config.get("text_config") or config)["vocab_size"]  # a VLM's is its language model's
    dp_rank = layout.coordinates(dist.get_rank())[1]
    shard = batch(case["sequences"], case["tokens"], vocab, seed=dp_rank)
    if "image_grid" in case:
        shard = with_images(shard, case["image_grid"], Path(case["model_dir"]), seed=dp_rank)
    spec = LossSpec(kl_coef=case["kl_coef"])
    start = time.perf_counter()
    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True) if profiled else None
    with prof or contextlib.nullcontext():
        with record_function("case:build"):
            trainer = Trainer(
                section=section,
                model_dir=Path(case["model_dir"]),
                pgc=pgc,
                device="cpu",
                reference=case["kl_coef"] > 0,
            )
        for step in range(case["steps"]):
            with record_function(f"case:step{step}"):
                trainer.train_step(shard, spec)
    seconds = time.perf_counter() - start
    del trainer
    gc.collect()
    return prof, seconds


def measure(case: dict, groups: Groups) -> dict:
    """The case's tensor bytes (profiled), or with ``rss`` the process's peak resident set
    over build and steps (not profiled: the profiler's own records would count), its
    high-water mark reset first (/proc/self/clear_refs)."""
    if not case.get("rss"):
        prof, seconds = run_case(case, groups, profiled=True)
        return live_bytes(prof, case["steps"]) | {"seconds": seconds}
    Path("/proc/self/clear_refs").write_text("5")
    before = process_memory()
    _, seconds = run_case(case, groups, profiled=False)
    peak = high_water_mark()
    return {
        "rss_before": before["rss"],
        "shared_clean_before": before["shared_clean"],
        "peak_rss": peak,
        "seconds": seconds,
    }


def high_water_mark() -> int:
    """This process's peak RSS since the last reset, in bytes (VmHWM)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def main() -> None:
    cases = json.loads(Path(sys.argv[1]).read_text())
    dist.init_process_group(platform.dist_backend("cpu"))
    platform.prepare_megatron("cpu")
    # what a job's trainer rank imports (relax_launch/launch.py), before its runtime is measured
    import relax_launch.launch  # noqa: F401
    import relax_launch.rl.program  # noqa: F401
    import relax_launch.runtime.job  # noqa: F401
    import relax_launch.trainer.trainer  # noqa: F401

    gc.collect()
    report = {"rank": dist.get_rank(), "runtime": process_memory(), "cases": {}}
    report["runtime"]["threads"] = torch.get_num_threads()
    groups = Groups()
    for case in cases:
        report["cases"][case["name"]] = measure(case, groups)
        dist.barrier()
    reports = [None] * dist.get_world_size()
    dist.all_gather_object(reports, report)
    if dist.get_rank() == 0:  # one writer: the ranks' lines cannot interleave
        print("\n".join(json.dumps(r) for r in reports), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
