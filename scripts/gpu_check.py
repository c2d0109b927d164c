"""The GPU check scripts/gpu_check.sh runs once its environment is set up.

usage: python scripts/gpu_check.py GPUS
1. A torchrun job of configs/gpu_check.yaml (this file is the ranks' program): the trainer's
   weights synced into the rollout engine, trainer vs engine logprobs on the same tokens, one
   train step, a second sync, the logprobs again.
2. ``relax-launch run configs/gpu_check.yaml``: two RL steps through the product's own loop.
Prints one table; exits 1 on any failure, 2 on a machine with one GPU (the decoupled job needs
two: NCCL cannot join a trainer and an engine on one GPU until a CUDA IPC transport exists).
$GPU_CHECK_OVERRIDES (key=value ...) changes the config, e.g. ``cluster.device=cpu`` to try the
script itself on a machine without GPUs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "gpu_check.yaml"
OVERRIDES = os.environ.get("GPU_CHECK_OVERRIDES", "").split()
PARITY_TOLERANCE = 1e-3
SEQUENCES = [  # as many as trainer.micro_batch_size in configs/gpu_check.yaml
    [1, 504, 3147, 314, 2579, 30, 216, 1343, 28, 940],
    [1, 28, 32, 34, 36, 38, 40],
    [1, 1204, 17, 9, 4401, 283, 12, 77],
    [1, 600, 601, 602, 603, 604],
]


def parity(session, url: str) -> float:
    """Largest |trainer - engine| logprob over SEQUENCES (prompt logprobs, the engine's own)."""
    from relax_launch.trainer.batch import TokenBatch
    from relax_launch.weights.engine_client import post

    trainer = session.logprobs(TokenBatch.next_token(SEQUENCES, [1] * len(SEQUENCES)))
    worst = 0.0
    for tokens, row in zip(SEQUENCES, trainer, strict=True):
        body = {"input_ids": tokens, "return_logprob": True, "logprob_start_len": 0}
        body["sampling_params"] = {"max_new_tokens": 1, "temperature": 0}
        engine = post(url, "/generate", body, 120)["meta_info"]["input_token_logprobs"][1:]
        worst = max(worst, *(abs(e[0] - t) for e, t in zip(engine, row, strict=True)))
    return worst


def sync_program(session) -> dict:
    """Rank 0's part of step 1."""
    from relax_launch.trainer.batch import TokenBatch

    url = session.wait_for_engines()["rollout"][0]
    session.connect_weight_sync()
    first = session.sync_weights(0)[0]
    report = {"parity_before": parity(session, url), "sync0": first}
    report["train"] = session.train_step(TokenBatch.next_token(SEQUENCES, [1] * len(SEQUENCES)))
    report["sync1"] = session.sync_weights(1)[0]
    report["parity_after"] = parity(session, url)
    return report


def rank_main(out: str) -> None:
    from relax_launch.config import load_config
    from relax_launch.placement import plan
    from relax_launch.runtime.job import run_rank

    job = load_config(CONFIG, [*OVERRIDES, f"logging.dir={Path(out).parent / 'sync-logs'}"])
    report = run_rank(job, plan(job), sync_program)
    if report is not None:
        Path(out).write_text(json.dumps(report))


def run(command: list[str], timeout_s: float) -> tuple[bool, float, str]:
    start = time.monotonic()
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, cwd=REPO)
    except subprocess.TimeoutExpired:
        return False, time.monotonic() - start, f"timed out after {timeout_s:.0f} s"
    return done.returncode == 0, time.monotonic() - start, done.stdout[-3000:] + done.stderr[-3000:]


def main(gpus: int) -> int:
    from relax_launch.config import load_config
    from relax_launch.placement import plan
    from relax_launch.runtime.launcher import torchrun_command

    if gpus < 2:
        print("gpu_check: the check needs 2 GPUs (trainer and rollout engine on their own GPU)")
        return 2
    rows, failed = [], False
    work = Path(tempfile.mkdtemp(prefix="relax-gpu-check-"))
    out = work / "sync.json"
    command = torchrun_command(
        Path(__file__), ["--rank", str(out)], plan(load_config(CONFIG, OVERRIDES))
    )
    ok, seconds, output = run(command, 600)
    if not ok:
        print(output)
        return 1
    report = json.loads(out.read_text())
    for key in ("parity_before", "parity_after"):
        good = report[key] <= PARITY_TOLERANCE
        failed |= not good
        rows.append((f"trainer vs engine logprobs ({key[7:]} a sync)", f"{report[key]:.2e}", good))
    for key in ("sync0", "sync1"):
        sync = report[key]
        gb_per_s = sync["num_bytes"] / sync["seconds"] / 1e9
        rows.append((f"weight sync v{key[-1]} ({sync['num_bytes'] / 1e6:.0f} MB)",
                     f"{sync['seconds']:.3f} s, {gb_per_s:.2f} GB/s", True))  # fmt: skip
    rows.append(("sync job (start to end)", f"{seconds:.0f} s", True))
    logs = work / "rl-logs"
    cli = [str(Path(sys.executable).with_name("relax-launch")), "run", str(CONFIG)]
    ok, seconds, output = run([*cli, *OVERRIDES, f"logging.dir={logs}"], 600)
    steps = [json.loads(x) for x in (logs / "metrics.jsonl").read_text().splitlines()] if ok else []
    failed |= len(steps) != 2
    rows.append(("RL job, 2 steps (start to end)", f"{seconds:.0f} s", len(steps) == 2))
    for s in steps:
        rows.append(
            (f"  step {s['step']}", f"{s['time/step']:.2f} s, reward {s['reward']:.3f}", True)
        )
    print(f"\n{'check':<48} {'result':<28} ok")
    for name, value, good in rows:
        print(f"{name:<48} {value:<28} {'yes' if good else 'NO'}")
    if len(steps) != 2:
        print(output)
    print(f"\ngpu_check: {'FAILED' if failed else 'passed'} (logs: {work})")
    return 1 if failed else 0


if __name__ == "__main__":
    if sys.argv[1] == "--rank":
        rank_main(sys.argv[2])
    else:
        sys.exit(main(int(sys.argv[1])))
