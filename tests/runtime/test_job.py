"""One torchrun job for real: Megatron trainer and SGLang engines on their ranks, weight sync,
and failures that end the job with the rank and role named, leaving no process behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from relax_launch.config import load_config
from relax_launch.inference.process import free_port
from relax_launch.placement import plan
from relax_launch.runtime.launcher import explain_failure, torchrun_command

pytestmark = pytest.mark.e2e
HERE = Path(__file__).parent
WORKER = HERE / "job_worker.py"
PARITY_TOLERANCE = 1e-3


def sglang_pids(tag: str) -> set[int]:
    """SGLang processes started by the test job tagged ``tag`` (others on the machine ignored)."""
    pids = set()
    for process in psutil.process_iter():
        try:
            if "sglang" in " ".join(process.cmdline()) and process.environ().get(
                "RELAX_TEST_JOB"
            ) == str(tag):
                pids.add(process.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return pids


def start(program: str, config: str, out: Path, tmp_path: Path, *overrides: str):
    job = load_config(HERE / config, overrides)
    args = [program, str(HERE / config), str(out), f"logging.dir={tmp_path / 'logs'}", *overrides]
    command = torchrun_command(WORKER, args, plan(job), free_port())
    process = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        env={**os.environ, "RELAX_TEST_JOB": str(tmp_path)},  # inherited by every SGLang server
    )
    return process, plan(job)


def finish(process, timeout_s: float) -> tuple[int, str]:
    try:
        output, _ = process.communicate(timeout=timeout_s)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    return process.returncode, output


def assert_no_sglang_left(tmp_path: Path) -> None:
    deadline = time.monotonic() + 15
    while (left := sglang_pids(str(tmp_path))) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not left, f"SGLang processes left behind: {left}"


@pytest.mark.parametrize(
    "config,engines,transport,model,tensors",
    [
        # Qwen2: 2 layers x (fused qkv weight and bias, o, fused gate_up, down, 2 norms) +
        # embeddings (tied: no lm_head) and the final norm; the trainer has TP=2.
        ("decoupled_4rank.yaml", 2, "broadcast", "tiny-qwen2", 16),
        # Qwen3: 2 layers x (fused qkv, q/k norms, o, fused gate_up, down, 2 norms) +
        # embeddings, final norm, lm_head; the trainer has DP=2.
        ("split_2rank.yaml", 1, "shared_memory", "tiny-qwen3", 19),
    ],
)
def test_train_sync_and_engines_serve_new_weights(
    tmp_path, config, engines, transport, model, tensors
):
    out = tmp_path / "report.json"
    process, _ = start("sync", config, out, tmp_path, f"trainer.model=builtin:{model}")
    code, output = finish(process, 400)
    assert code == 0, output[-4000:]
    report = json.loads(out.read_text())
    assert report["versions"] == ["1"] * engines
    assert report["weight_changed"] and report["engines_agree"]
    assert report["sync0"][0]["num_tensors"] == report["sync1"][0]["num_tensors"] == tensors
    assert report["sync1"][0]["transport"] == transport  # split shares the host: no network
    # The trainer's per-token logprobs equal what the engines compute, before and after a sync.
    assert report["parity_before"] <= PARITY_TOLERANCE
    assert report["parity_after"] <= PARITY_TOLERANCE
    assert report["train"][1]["loss"] < report["train"][0]["loss"]
    # Readiness: alive but not routable until the first sync commits, then serving.
    before_sync = report["gateway_before_sync"]
    assert before_sync["alive"] and before_sync["state"] == "ONLOADING"
    assert before_sync["generate"] == 503 and before_sync["retry_after"] == "1"
    assert report["gateway_after_sync"]["generate"] == 200
    assert report["gateway_after_sync"]["weight_version"] == "0"
    assert report["gateway_after_sync1"]["weight_version"] == "1"
    parity = f"{report['parity_before']:.2e} / {report['parity_after']:.2e}"
    print(f"{config} {model}: logprob parity {parity}")
    assert_no_sglang_left(tmp_path)


@pytest.mark.slow
def test_failed_sync_restores_the_previous_weights_and_reports_it(tmp_path):
    out = tmp_path / "report.json"
    process, _ = start("rollback", "decoupled_4rank.yaml", out, tmp_path)
    code, output = finish(process, 400)
    assert code == 0, output[-4000:]
    report = json.loads(out.read_text())
    assert "'weights.send' failed on rank 0 (trainer[tp0 pp0 dp0])" in report["error"]
    assert "engines restored to version 0" in report["error"]
    assert report["versions_after_failure"] == ["0", "0"] and report["weights_restored"]
    # The rolled-back sync leaves the gateway serving version 0, as before it started.
    failed = report["gateway_after_failure"]
    assert failed["generate"] == 200 and failed["weight_version"] == "0"
    assert report["versions_after_retry"] == ["2", "2"] and report["weights_changed_after_retry"]
    assert_no_sglang_left(tmp_path)


def rank_pid(torchrun_pid: int, rank: int) -> int:
    for child in psutil.Process(torchrun_pid).children():
        if child.environ().get("RANK") == str(rank):
            return child.pid
    raise AssertionError(f"no worker with RANK={rank} under torchrun {torchrun_pid}")


def test_sigkill_of_an_inference_rank_ends_the_job_naming_it(tmp_path):
    out = tmp_path / "urls.json"
    process, placement = start("hold", "decoupled_4rank.yaml", out, tmp_path)
    deadline = time.monotonic() + 600
    while not out.exists():
        assert process.poll() is None and time.monotonic() < deadline, "job did not come up"
        time.sleep(0.5)
    os.kill(rank_pid(process.pid, 2), signal.SIGKILL)
    code, output = finish(process, 120)  # the job ends, it does not hang (else: TimeoutExpired)
    assert code != 0
    assert explain_failure(placement, output) == "rank 2 (rollout[e0 head]) was killed by SIGKILL"
    assert_no_sglang_left(tmp_path)


@pytest.mark.slow
def test_rank_stuck_in_a_collective_times_out_naming_rank_role_and_op(tmp_path):
    out = tmp_path / "unused.json"
    process, _ = start(
        "stuck", "decoupled_4rank.yaml", out, tmp_path, "cluster.collective_timeout_s=20"
    )
    code, output = finish(process, 300)
    assert code != 0
    rank0 = (tmp_path / "logs" / "rank0.log").read_text()  # the controller's error, in its log
    assert "'trainer.train_step'" in rank0 and "rank 1 (trainer[tp1 pp0 dp0])" in rank0
    assert "no reply within 20 s" in rank0 or "timed out" in rank0.lower()
    assert_no_sglang_left(tmp_path)
