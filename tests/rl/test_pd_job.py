"""Prefill/decode disaggregation and pipeline-parallel rollout engines, for real: RL jobs of the
tiny Llama whose rollout is served by a prefill engine and a decode engine (SGLang's
disaggregation, the KV cache moved by Mooncake over TCP), or by one engine of two pipeline
stages, train 3 steps with the trainer's logprobs equal to the engine's after every sync.

The prefill/decode job then keeps serving (its reward is slow from step 4) while the test sends
native, OpenAI chat (SSE too) and completions requests through the gateway to the pair, reads
the pair in discovery and the version both halves serve, and SIGKILLs the prefill engine's
server: the job ends, naming it, and leaves no process. With rollout.fault_tolerance and two
pairs (slow suite), a killed prefill half and then a killed decode half each come back instead.

The parity check can fail on a half that missed a version: the first token of every answer is
sampled by the prefill engine (its logprob comes back with the decode engine's), the others by
the decode engine, and one step at this learning rate moves the tiny model's logprobs by far
more than the tolerance (checked: the pair's logprobs at the last version against the
initial model's, computed by transformers).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
import torch
from harness.processes import TEST_TAG, processes_tagged, seconds_until_gone
from test_rl_job import run_tiny

from relax_launch.models.build import ensure_model
from relax_launch.platform import sglang_server_module
from relax_launch.platform.nccl_semantics import SLOW_BROADCAST_ENV

pytestmark = pytest.mark.e2e
REPO = Path(__file__).parents[2]
CONFIG = REPO / "configs" / "pd_cpu.yaml"
TOLERANCE = 1e-4  # fp32 trainer vs fp32 engine
SLOW_REWARD = "reward.sources=[{name: slow, function: 'slow_reward:slow'}]"
EXACT = "{name: answer, function: 'builtin:exact_numeric'}"
ALL_GONE_S = 30.0


SERVER_MODULE = sglang_server_module("cpu")  # what an engine's server runs as


def rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    complete = path.read_text().split("\n")[:-1] if path.is_file() else []
    return [json.loads(line) for line in complete]


def assert_parity_after_every_sync(steps: list[dict]) -> None:
    assert [s["weight_version"] for s in steps] == [0, 1, 2]
    for s in steps:
        print(f"step {s['step']}: logprob_diff_max {s['logprob_diff_max']:.2e}")
        assert s["logprob_diff_max"] <= TOLERANCE
        assert s["sync/staged_tensors"] == 0  # received in place, on both halves' ranks


class PdJob:
    """``relax-launch run`` of the prefill/decode config, kept serving by a slow 4th step."""

    def __init__(self, run_dir: Path, *overrides: str) -> None:
        self.run_dir, self.tag = run_dir, os.environ[TEST_TAG]
        env = {
            **os.environ,
            "PYTHONPATH": str(REPO / "tests" / "runtime"),  # the slow reward
            "RELAX_TEST_REWARD_LOG": str(run_dir.parent / "rewards.jsonl"),
            "RELAX_TEST_SLOW_FROM": "4",
            "RELAX_TEST_SLOW_S": "300",
            # each broadcast of a sync 1.1 s, as GPU-sized ones take: waits outlast a second
            SLOW_BROADCAST_ENV: "1.1",
        }
        args = [f"logging.dir={run_dir}", "algorithm.num_steps=4", SLOW_REWARD, *overrides]
        self.process = subprocess.Popen(
            [str(Path(sys.executable).with_name("relax-launch")), "run", str(CONFIG), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            start_new_session=True,
        )

    def wait_for_steps(self, steps: int, timeout_s: float = 300) -> list[dict]:
        deadline = time.monotonic() + timeout_s
        while len(found := rows(self.run_dir)) < steps:
            assert self.process.poll() is None, self.process.communicate()[0][-4000:]
            assert time.monotonic() < deadline, f"no {steps} steps within {timeout_s} s"
            time.sleep(0.2)
        return found

    def prefill_server(self, half: str = "prefill") -> int:
        """The PID of the (first) ``half`` engine's SGLang launcher (its server's process
        group)."""
        for p in processes_tagged(self.tag):
            command = " ".join(p.cmdline())
            if SERVER_MODULE in command and f"--disaggregation-mode {half}" in command:
                return p.pid
        raise LookupError(f"no {half} server among the job's processes")

    def seconds_until_gone(self, since: float, limit_s: float = 90) -> float:
        return seconds_until_gone(self.tag, since, limit_s)

    def kill(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


def initial_logprobs(ids: list[int], prompt_length: int) -> torch.Tensor:
    """The starting tiny Llama's logprob of each token after the prompt (transformers, fp32)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(ensure_model("builtin:tiny-llama")))
    logits = model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    positions = torch.arange(prompt_length - 1, len(ids) - 1)
    return logits[positions, torch.tensor(ids[prompt_length:])]


def check_requests_through_the_pair(gateway: str) -> None:
    """Native generation (with the prompt's logprobs, computed by the prefill half), OpenAI chat,
    streamed chat and completions, all through the gateway to the pair."""
    prompt = [5, 17, 42, 99, 7]
    body = {
        "input_ids": prompt,
        "return_logprob": True,
        "logprob_start_len": 0,
        "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True},
    }
    native = httpx.post(f"{gateway}/rollout/generate", json=body, timeout=60)
    assert native.status_code == 200, native.text
    meta = native.json()["meta_info"]
    assert meta["weight_version"] == "3" and len(meta["output_token_logprobs"]) == 6
    assert len(meta["input_token_logprobs"]) == len(prompt)
    served = torch.tensor([lp for lp, *_ in meta["output_token_logprobs"]])
    moved = (served - initial_logprobs(prompt + native.json()["output_ids"], len(prompt))).abs()
    print(f"logprobs moved by training (3 versions): max {moved.max():.2e}")
    assert moved.max() > 100 * TOLERANCE  # a half serving old weights fails the parity
    # one token (how the teacher scores): the decode half answers as soon as the KV arrives,
    # and the prompt's logprobs still come from the prefill half's reply
    body["sampling_params"]["max_new_tokens"] = 1
    scored = httpx.post(f"{gateway}/rollout/generate", json=body, timeout=60).json()
    assert len(scored["meta_info"]["input_token_logprobs"]) == len(prompt)
    client = openai.OpenAI(base_url=f"{gateway}/rollout/v1", api_key="unused")
    model = client.models.list().data[0].id
    messages = [{"role": "user", "content": "What is 2 plus 3?"}]
    fixed = {"max_tokens": 5, "temperature": 0, "extra_body": {"ignore_eos": True}}
    reply = client.chat.completions.create(model=model, messages=messages, **fixed)
    assert reply.choices[0].message.content and reply.usage.completion_tokens == 5
    chunks = list(
        client.chat.completions.create(model=model, messages=messages, stream=True, **fixed)
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == reply.choices[0].message.content  # greedy: the same answer, streamed
    completion = client.completions.create(model=model, prompt="12 plus 7 is", **fixed)
    assert completion.usage.completion_tokens == 5
    client.close()


def test_prefill_decode_job_trains_serves_and_ends_naming_a_dead_prefill(tmp_path):
    job = PdJob(tmp_path / "run")
    try:
        steps = job.wait_for_steps(3)
        assert_parity_after_every_sync(steps[:3])
        for s in steps[:3]:  # the probe reached the decode half too, by generating
            assert s["sync/probe_decode_halves"] == 1 and s["sync/parity_gap"] <= TOLERANCE
        gateway = json.loads((job.run_dir / "gateway.json").read_text())["url"]
        (engine,) = httpx.get(f"{gateway}/rollout/engines").json()["models"]["tiny-llama"][
            "engines"
        ]
        assert engine["state"] == "READY" and engine["prefill"]["bootstrap_port"] > 0
        halves = [engine["base_url"], engine["prefill"]["base_url"]]
        # both halves took every version: the sync after step 3 is the one they serve
        assert [httpx.get(f"{u}/model_info").json()["weight_version"] for u in halves] == [
            "3",
            "3",
        ]
        check_requests_through_the_pair(gateway)
        began = time.monotonic()
        os.killpg(job.prefill_server(), signal.SIGKILL)
        seconds = job.seconds_until_gone(began)
        console = job.process.communicate(timeout=60)[0]
    finally:
        job.kill()
    print(f"\nprefill server SIGKILL: all gone in {seconds:.1f} s, exit {job.process.returncode}")
    assert job.process.returncode not in (0, 75) and seconds < ALL_GONE_S
    cause = (
        "rollout engine 1 (prefill) on rank 2 (rollout[e1 head prefill], node 0): its SGLang "
        "server was killed by SIGKILL"
    )
    last = console.strip().splitlines()[-1]
    assert last.startswith(f"relax-launch: job failed: {cause}; "), console[-3000:]
    assert "fault_tolerance" not in last  # refused with prefill engines: not offered


@pytest.mark.slow
def test_pipeline_parallel_rollout_engine_takes_every_version(tmp_path):
    """One rollout engine of two pipeline stages (tied embeddings: the last stage's head is
    loaded from the embedding each sync); each stage keeps its own layers of every broadcast."""
    result = run_tiny(
        CONFIG,
        f"logging.dir={tmp_path}",
        "trainer.model=builtin:tiny-qwen2",
        "rollout.prefill=null",
        "rollout.ranks=2",
        "rollout.pp_size=2",
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert_parity_after_every_sync(rows(tmp_path))


@pytest.mark.slow
def test_prefill_decode_pair_behind_sglang_router(tmp_path):
    """Route mode ``router``: sglang-router's own prefill/decode mode sends every rollout
    request to the pair (a half alone refuses a request without a bootstrap room); the same
    parity after every sync."""
    result = run_tiny(CONFIG, f"logging.dir={tmp_path}", "gateway.rollout_route_mode=router")
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert_parity_after_every_sync(rows(tmp_path))  # a half alone answers no request


@pytest.mark.slow
def test_teacher_served_by_a_prefill_decode_pair(tmp_path):
    """On-policy distillation with the teacher disaggregated too: its scoring (the prompt's and
    answer's logprobs, computed by its prefill half, merged into its decode half's reply) equals
    the student's own at step 1, where both are the initial model."""
    teacher = ["teacher.model=builtin:tiny-llama", "teacher.ranks=1", "teacher.prefill.ranks=1"]
    result = run_tiny(
        CONFIG,
        f"logging.dir={tmp_path}",
        "cluster.nproc_per_node=5",
        *teacher,
        "teacher.engine.max_total_tokens=2048",
        "algorithm.distill_coef=0.01",
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    steps = rows(tmp_path)
    assert_parity_after_every_sync(steps)
    kl = [s["reverse_kl"] for s in steps]
    print("reverse KL to the teacher by step: " + ", ".join(f"{k:.2e}" for k in kl))
    assert abs(steps[0]["reverse_kl"]) < TOLERANCE  # the same weights, scored by the pair
    assert abs(steps[-1]["reverse_kl"]) > abs(steps[0]["reverse_kl"])  # the student moved


@pytest.mark.slow
def test_a_dead_half_of_a_pair_restarts_and_its_pair_rejoins(tmp_path):
    """rollout.fault_tolerance with two prefill/decode pairs: the SIGKILL of a prefill half,
    then of a decode half, each takes its pair out of routing (the other pair generates what
    it lost), its rank restarts that half, SGLang's KV transfer re-forms (the decode half
    forgets a dead prefill half by its heartbeat and registers again), and the pair (its live
    half held out with it) takes the next sync and serves again; every step keeps
    trainer-engine parity, none is lost."""
    pairs = ["cluster.nproc_per_node=5", "rollout.ranks=2", "rollout.prefill.ranks=2"]
    endless = ["algorithm.num_steps=1000", f"reward.sources=[{EXACT}]"]
    tolerant = ["rollout.fault_tolerance=true", f"checkpoint.dir={tmp_path / 'ck'}"]
    job = PdJob(tmp_path / "run", *pairs, *endless, *tolerant)
    seconds = {}
    try:
        job.wait_for_steps(3, timeout_s=600)
        for restarts, half in enumerate(("prefill", "decode"), start=1):
            os.killpg(job.prefill_server(half), signal.SIGKILL)
            began = time.monotonic()
            while not any(r.get("rollout/engine_restarts") == restarts for r in rows(job.run_dir)):
                assert job.process.poll() is None, job.process.communicate()[0][-4000:]
                assert time.monotonic() - began < 300, f"the {half} half did not come back"
                time.sleep(0.2)
            seconds[half] = time.monotonic() - began
            job.wait_for_steps(len(rows(job.run_dir)) + 2)
        (job.run_dir / "STOP").touch()
        console = job.process.communicate(timeout=120)[0]
    finally:
        job.kill()
    print(f"\nSIGKILL to serving again: {seconds}")
    assert job.process.returncode == 75, console[-4000:]
    steps = rows(job.run_dir)
    assert [s["step"] for s in steps] == list(range(1, len(steps) + 1))  # none lost
    assert max(s["logprob_diff_max"] for s in steps) <= TOLERANCE  # parity after every sync
    serving = [int(s["rollout/engines_serving"]) for s in steps]
    regenerated = sum(s["rollout/prompts_regenerated"] for s in steps)
    print(f"engines serving by step: {serving}; generations sent again: {regenerated:.0f}")
    assert serving[-1] == 4 and min(serving) == 2 and steps[-1]["rollout/engine_restarts"] == 2
