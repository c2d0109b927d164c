"""One torchrun job for real: Megatron trainer and SGLang engines on their ranks, weight sync,
and failures that end the job with the rank and role named, leaving no process behind."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from relax_launch.commands.launcher import explain_failure, torchrun_command
from relax_launch.config import load_config
from relax_launch.inference.process import free_port
from relax_launch.placement import plan
from relax_launch.platform.nccl_semantics import SLOW_BROADCAST_ENV

pytestmark = pytest.mark.e2e
HERE = Path(__file__).parent
WORKER = HERE / "job_worker.py"
FAULT_PLUGIN = HERE.parent / "weights" / "fault_plugin"  # an engine that dies mid-sync
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


def start(
    program: str,
    config: str,
    out: Path,
    tmp_path: Path,
    *overrides: str,
    env: dict[str, str] | None = None,
):
    job = load_config(HERE / config, overrides)
    args = [program, str(HERE / config), str(out), f"logging.dir={tmp_path / 'logs'}", *overrides]
    command = torchrun_command(WORKER, args, plan(job), free_port())
    process = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        # inherited by every SGLang server
        env={**os.environ, "RELAX_TEST_JOB": str(tmp_path), **(env or {})},
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
    described = []
    for pid in left:
        with contextlib.suppress(psutil.Error):
            process = psutil.Process(pid)
            described.append(
                f"{pid} (parent {process.ppid()}): {' '.join(process.cmdline())[:100]}"
            )
    assert not left, f"SGLang processes left behind: {described}"


LORA = ("trainer.lora.rank=4", "trainer.lora.alpha=8")
ADAPTER = "trainer.lora.engines=adapter"


@pytest.mark.parametrize(
    "config,engines,transport,model,tensors,lora",
    [
        # Qwen2: 2 layers x (fused qkv weight and bias, o, fused gate_up, down, 2 norms) +
        # embeddings (tied: no lm_head) and the final norm; the trainer has TP=2.
        # (slow: the RL jobs of tests/rl sync whole models into decoupled engines each step)
        pytest.param(
            "decoupled_4rank.yaml", 2, "broadcast", "tiny-qwen2", 16, (), marks=pytest.mark.slow
        ),
        # Qwen3: 2 layers x (fused qkv, q/k norms, o, fused gate_up, down, 2 norms) +
        # embeddings, final norm, lm_head; the trainer has DP=2.
        # (slow: split's bucket sync runs in tests/rl/test_colocated_job.py, the Qwen3 layout in
        # the MoE job of tests/rl/test_moe_job.py, both with the parity probe after each sync)
        pytest.param("split_2rank.yaml", 1, "bucket", "tiny-qwen3", 19, (), marks=pytest.mark.slow),
        # LoRA on every linear, trainer TP=2: only the 2 x 4 targeted weights go, merged.
        # (slow: a merged LoRA sync, probed for parity, runs in the split job of
        # tests/rl/test_colocated_job.py)
        pytest.param(
            "decoupled_4rank.yaml", 2, "broadcast", "tiny-qwen2", 8, LORA, marks=pytest.mark.slow
        ),
        # LoRA served as an adapter: 2 layers x 7 projections x (A, B) in PEFT's layout
        ("decoupled_4rank.yaml", 2, "adapter", "tiny-qwen2", 28, (*LORA, ADAPTER)),
    ],
    ids=["decoupled-qwen2", "split-qwen3", "decoupled-qwen2-lora", "decoupled-qwen2-adapter"],
)
def test_train_sync_and_engines_serve_new_weights(
    tmp_path, config, engines, transport, model, tensors, lora
):
    out = tmp_path / "report.json"
    process, _ = start("sync", config, out, tmp_path, f"trainer.model=builtin:{model}", *lora)
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
    print(f"{config} {model} {transport}: logprob parity {parity}")
    if transport == "adapter":  # the engines read the current version; earlier ones are gone
        assert [d.name for d in (tmp_path / "logs" / "adapters").iterdir()] == ["policy-v1"]
    assert_no_sglang_left(tmp_path)


@pytest.fixture(scope="session")
def wide_model(tmp_path_factory) -> Path:
    """A random Llama of 268 MB (hidden 1024, 4 layers): a sync of it outgrows the socket
    buffers, so an engine that stops reading stalls the broadcast to every engine."""
    import shutil

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from relax_launch.models.build import ensure_model

    tiny = ensure_model("builtin:tiny-llama")
    out = tmp_path_factory.mktemp("wide-llama")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(tiny / name, out / name)
    base = json.loads((tiny / "config.json").read_text())
    config = LlamaConfig(
        **{k: base[k] for k in ("vocab_size", "bos_token_id", "eos_token_id", "pad_token_id")},
        hidden_size=1024,
        intermediate_size=4096,
        num_hidden_layers=4,
        num_attention_heads=16,
        num_key_value_heads=8,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(out, safe_serialization=True)
    return out


@pytest.mark.slow  # the sync alone: tests/weights/test_sync_engine.py, in the default run
def test_an_engine_dying_mid_sync_never_lets_a_half_updated_engine_serve(tmp_path, wide_model):
    """Two rollout engines with fault tolerance; in the sync to version 1 one engine stops
    reading (the other has then received part of the weights only) and is killed 3 s later.
    Meanwhile the gateway is asked for a generation every 20 ms: while the sync runs it never
    answers from the survivor (503: the rollout model is out of routing until the survivor holds
    version 1 whole, sent to it again in a new group), and afterwards the survivor's logprobs
    are the trainer's."""
    out = tmp_path / "report.json"
    env = {
        "PYTHONPATH": os.pathsep.join([str(FAULT_PLUGIN), os.environ.get("PYTHONPATH", "")]),
        "RELAX_TEST_FAULT_AT": "1",
        "RELAX_TEST_FAULT_DIR": str(tmp_path),
        # each broadcast 0.25 s, as GPU-sized ones queue: the resend's waits outlast a second
        SLOW_BROADCAST_ENV: "0.25",
    }
    overrides = (
        f"trainer.model={wide_model}",
        "rollout.fault_tolerance=true",
        "weight_sync.timeout_s=60",  # the death must fail the sync at once, not at its deadline
    )
    process, _ = start("midsync", "decoupled_4rank.yaml", out, tmp_path, *overrides, env=env)
    code, output = finish(process, 600)
    assert code == 0, output[-4000:]
    report = json.loads(out.read_text())
    assert (tmp_path / "victim").is_file()  # one engine did die in the sync
    assert report["error"] is None, report["error"]
    assert report["during"] == [503], report  # never an answer from a half-updated engine
    assert report["before"] == [200] and report["after"] == [200]
    assert report["sync"][0]["repaired"] == 1
    assert report["serving"] == 1 and report["versions"] == ["1"]
    assert report["parity"] <= PARITY_TOLERANCE
    print(f"\nmid-sync death: the sync and its repair took {report['sync_s']:.1f} s, all 503")
    assert_no_sglang_left(tmp_path)


@pytest.mark.slow
def test_a_failed_send_is_sent_again_and_the_engines_hold_the_version_whole(tmp_path):
    out = tmp_path / "report.json"
    process, _ = start("rollback", "decoupled_4rank.yaml", out, tmp_path)
    code, output = finish(process, 400)
    assert code == 0, output[-4000:]
    report = json.loads(out.read_text())
    assert report["error"] is None and report["sync1"][0]["repaired"] == 1
    assert report["versions"] == ["1", "1"] and report["weights_changed"]
    assert report["parity"] <= PARITY_TOLERANCE  # whole: the trainer's version 1 everywhere
    assert report["gateway"]["generate"] == 200 and report["gateway"]["weight_version"] == "1"
    assert_no_sglang_left(tmp_path)


def rank_pid(torchrun_pid: int, rank: int) -> int:
    for child in psutil.Process(torchrun_pid).children():
        if child.environ().get("RANK") == str(rank):
            return child.pid
    raise AssertionError(f"no worker with RANK={rank} under torchrun {torchrun_pid}")


@pytest.mark.slow  # in the default run: test_job_ends.py, a dead rank 1
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
