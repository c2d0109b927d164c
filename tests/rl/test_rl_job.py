"""A short real RL job through ``relax-launch run``, shared by the tests below: tiny Llama
policy (PP=2), two rollout engines one step off-policy, teacher and GenRM engines; metrics
written, weights synced every step, every role's engines reached in process, KL to the initial
policy, the final policy exported and served."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from harness.prometheus_text import total

pytestmark = pytest.mark.e2e
CONFIG = Path(__file__).parent / "three_roles_off_policy_tiny.yaml"


@dataclass
class Run:
    result: subprocess.CompletedProcess
    run_dir: Path
    steps: list[dict]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    run_dir = tmp_path_factory.mktemp("three-roles-off-policy")
    result = run_tiny(CONFIG, f"logging.dir={run_dir}", "logging.level=warning")
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    rows = (run_dir / "metrics.jsonl").read_text().splitlines()
    return Run(result, run_dir, [json.loads(line) for line in rows])


def test_rl_job_runs_three_roles_and_syncs_every_step(run: Run):
    steps, result, run_dir = run.steps, run.result, run.run_dir
    assert [s["step"] for s in steps] == [1, 2, 3]
    for s in steps:
        assert {"reward", "reward/alternating", "reward/judge", "loss", "grad_norm"} <= set(s)
        # every reply of the random judge, decoded under the score regex, parsed into a reward
        assert s["reward/judge/failed"] == 0 and 0.0 <= s["reward/judge"] <= 1.0
        assert "reverse_kl" in s and s["time/step"] > 0
    # Teacher = initial policy: at step 1 the engines' logprobs (raw, not temperature-scaled)
    # equal the teacher's, so the reverse KL starts at zero.
    assert abs(steps[0]["reverse_kl"]) < 1e-3
    assert (run_dir / "curves.png").stat().st_size > 0
    assert "finished 3 steps" in result.stdout
    # the plan's lines for a fourth engine, a second stage's sync group and the off-policy note
    assert_calm_console(result, run_dir, ranks=6, steps=3, plan_lines=3)
    # where start-up went: every rank's phases, and the job waited on the last one to finish
    startup = json.loads((run_dir / "startup.json").read_text())
    assert sorted(startup["ranks"]) == [str(rank) for rank in range(6)]
    ends = [p["end_s"] for r in startup["ranks"].values() for p in r["phases"]]
    assert startup["up_s"] == max(ends) and startup["critical"]["end_s"] <= startup["up_s"]
    assert any(p["phase"] == "trainer built" for p in startup["ranks"]["0"]["phases"])
    assert "up in " in result.stdout and "waited on rank" in result.stdout
    # logging.level=warning holds on every rank: only the operator's lines are below it
    for rank in range(6):
        text = (run_dir / f"rank{rank}.log").read_text()
        assert not [
            x for x in text.splitlines() if " INFO " in x and "relax_launch.console" not in x
        ]
    # every role's engines took the loop's requests from the controller, in process: each one
    # counted by the control plane, none by the gateway (the door for external clients);
    # 3 steps x 2 prompts x 4 samples, one request each per role
    counted = (run_dir / "gateway_metrics.txt").read_text()
    for role in ("teacher", "genrm", "rollout"):
        ok = {"role": role, "endpoint": "generate", "model": "tiny-llama", "status": "200"}
        assert total(counted, "relax_controller_requests_total", **ok) == 24, counted
        assert total(counted, "relax_controller_requests_total", role=role) == 24, counted
        assert total(counted, "relax_gateway_requests_total", role=role) == 0, counted


def test_off_policy_job_with_kl_to_the_initial_policy(run: Run):
    """Also: a trainer with PP=2 syncs each step into two rollout engines (its stages' broadcast
    groups each span both engines, so they must not send at once)."""
    steps, result, run_dir = run.steps, run.result, run.run_dir
    # step k+1's samples were generated with step k's weights, while step k trained
    assert [s["weight_version"] for s in steps] == [0, 0, 1]
    assert [s["staleness"] for s in steps] == [0, 1, 1]
    assert [s["samples_stale"] for s in steps] == [0, 0, 0]
    assert "time/wait" in steps[0] and "time/wait" not in steps[-1]
    # the policy starts as the reference: no KL; after two updates at lr 1e-2 it has moved (the
    # alternating reward gives every group signal, so every step has a gradient)
    assert steps[0]["kl_ref"] == pytest.approx(0.0, abs=1e-6)
    assert steps[-1]["kl_ref"] > 1e-4
    # off-policy turns the token-level correction on: step 1's samples come from the trainer's
    # own weights (no mismatch), later ones from the weights one step older
    assert "rollout_correction=auto" in result.stdout
    assert steps[0]["mismatch_kl"] < 1e-4 and steps[0]["is_ratio_max"] == pytest.approx(1, abs=0.02)
    assert steps[-1]["mismatch_kl"] > 10 * steps[0]["mismatch_kl"]
    assert "stale 1" in result.stdout and "KL-ref" in result.stdout
    assert "rollout x2" in result.stdout
    # checkpoint.dir unset, yet the run leaves its final policy as a Hugging Face model (PP=2
    # stages each wrote their shards), which SGLang serves
    assert "Hugging Face export of step 3" in result.stdout
    export = run_dir / "hf" / "step_000003"
    assert (export / "model.safetensors.index.json").is_file()
    assert "rl-three-roles-off-policy-tiny" in (export / "README.md").read_text()
    assert_served_as_exported(export)


def assert_calm_console(result, log_dir: Path, ranks: int, steps: int, plan_lines: int = 0) -> None:
    """The console has the plan, one line per step and the summary; what libraries print is in
    the ranks' own logs. ``plan_lines``: the plan's lines beyond those of a three-engine job."""
    lines = result.stdout.splitlines()
    progress = [x for x in lines if x.startswith("relax-launch: step ")]
    assert len(progress) == steps and progress[-1].endswith("ETA 0:00"), progress
    # the plan, its memory line; + the export
    assert len(lines) <= 22 + plan_lines + steps, result.stdout
    assert not [x for x in lines if "warn" in x.lower() or x.startswith("[rank")], result.stdout
    assert result.stderr == ""
    assert sorted(p.name for p in log_dir.glob("rank*.log")) == sorted(
        f"rank{r}.log" for r in range(ranks)
    )
    # the ranks' library noise (Megatron's UserWarnings on the trainer rank) is in its log
    assert "py.warnings" in (log_dir / "rank0.log").read_text()


def run_tiny(config: Path, *overrides: str) -> subprocess.CompletedProcess:
    cli = Path(sys.executable).with_name("relax-launch")
    return subprocess.run(
        [str(cli), "run", str(config), *overrides],
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parent)},  # the reward's module
    )


@pytest.mark.slow
def test_checkpoints_and_resume_continue_the_run(tmp_path):
    config = Path(__file__).parent / "off_policy_kl_tiny.yaml"
    ckpt = tmp_path / "ckpt"
    common = [f"logging.dir={tmp_path}", f"checkpoint.dir={ckpt}", "checkpoint.every_steps=1"]
    first = run_tiny(config, *common, "algorithm.num_steps=3")
    assert first.returncode == 0, first.stdout[-4000:] + first.stderr[-2000:]
    before = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert sorted(d.name for d in ckpt.iterdir()) == ["step_000002", "step_000003"]  # keep_last
    step2 = ckpt / "step_000002"
    assert sorted(f.name for f in step2.iterdir()) == [
        "COMPLETE", "controller.json", "model", "model.json", "trainer_tp0_pp0.pt",
        "trainer_tp0_pp1.pt",
    ]  # fmt: skip
    # Off-policy: step 3's prompts were drawn while step 2 trained, yet the checkpoint of step
    # 2 points right after step 2's prompts, so a resume from it draws step 3's prompts again.
    assert json.loads((step2 / "controller.json").read_text())["prompts"]["seen"] == 4

    second = run_tiny(config, *common, "algorithm.num_steps=4", "--resume")
    assert second.returncode == 0, second.stdout[-4000:] + second.stderr[-2000:]
    assert "step 3, trainer at optimizer step 3, prompt 6" in second.stdout
    rows = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert rows[:3] == before  # the first run's steps are kept
    last = json.loads(rows[3])
    assert last["step"] == 4
    assert last["weight_version"] == 3 and last["staleness"] == 0  # synced from the checkpoint
    # the reference is the initial model, the policy the checkpoint: they differ from the start
    assert last["kl_ref"] > 1e-4
    assert sorted(d.name for d in ckpt.iterdir()) == ["step_000003", "step_000004"]
    assert "finished 4 steps" in second.stdout
    # each run exported its final policy while it ran (checkpoint.export_hf.at_end)
    assert sorted(d.name for d in (tmp_path / "hf").iterdir()) == ["step_000003", "step_000004"]
    assert "Hugging Face export of step 4" in second.stdout
    # `relax-launch export RUN_DIR` (its newest checkpoint, PP=2 shards) writes the tensors of
    # the export the run wrote at that step, bit for bit
    import torch
    from safetensors.torch import load_file

    from relax_launch.commands.export import export_checkpoint

    offline = export_checkpoint(tmp_path, tmp_path / "exported")
    ours = load_file(str(offline / "model.safetensors"))
    theirs = {}  # one file per pipeline stage
    for path in (tmp_path / "hf" / "step_000004").glob("model-*-of-00002.safetensors"):
        theirs.update(load_file(str(path)))
    assert sorted(ours) == sorted(theirs)
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)


def assert_served_as_exported(export: Path) -> None:
    """SGLang serves an exported model directory, with transformers' logprobs for it."""
    import torch
    from transformers import AutoModelForCausalLM

    from relax_launch.inference.server import SGLangServer
    from relax_launch.processes import group_alive

    server = SGLangServer(
        model_path=export,
        device="cpu",
        log_path=export.parent / "export-engine.log",
        engine={"max_total_tokens": 1024, "random_seed": 0, "dtype": "float32"},
    )
    server.start(timeout_s=300)
    try:
        tokens = [5, 17, 42, 99, 7, 150, 23, 61]
        body = {
            "input_ids": tokens,
            "return_logprob": True,
            "logprob_start_len": 0,
            "sampling_params": {"max_new_tokens": 4, "temperature": 0},
        }
        reply = httpx.post(server.url + "/generate", json=body, timeout=60).json()
    finally:
        pid = server.pid
        server.stop()
        assert not group_alive(pid)
    assert len(reply["output_ids"]) == 4
    engine = torch.tensor([lp for lp, _, _ in reply["meta_info"]["input_token_logprobs"][1:]])
    model = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits.log_softmax(-1)[0, :-1]
    hf = logits.gather(-1, torch.tensor(tokens[1:])[:, None])[:, 0]
    assert float((engine - hf).abs().max()) < 1e-3


@pytest.mark.slow
def test_a_lora_job_trains_resumes_and_exports_its_adapter(tmp_path):
    """LoRA on the PP=2 off-policy job with KL: the reference is the policy with its adapters off
    (no KL at step 1), checkpoints hold the adapters, a resume continues them, and the run's
    checkpoint exports as a PEFT adapter and, merged, as the model the run exported live."""
    import torch
    from safetensors.torch import load_file

    from relax_launch.commands.export import export_checkpoint

    config = Path(__file__).parent / "off_policy_kl_tiny.yaml"
    ckpt = tmp_path / "ckpt"
    common = [
        f"logging.dir={tmp_path}", f"checkpoint.dir={ckpt}", "checkpoint.every_steps=1",
        "trainer.lora.rank=4", "trainer.lora.alpha=8", "trainer.lora.dropout=0.1",
    ]  # fmt: skip
    first = run_tiny(config, *common, "algorithm.num_steps=2")
    assert first.returncode == 0, first.stdout[-4000:] + first.stderr[-2000:]
    second = run_tiny(config, *common, "algorithm.num_steps=3", "--resume")
    assert second.returncode == 0, second.stdout[-4000:] + second.stderr[-2000:]
    assert "step 2, trainer at optimizer step 2" in second.stdout
    steps = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps[0]["kl_ref"] == pytest.approx(0.0, abs=1e-6)  # B starts at zero
    assert steps[-1]["kl_ref"] > 1e-5  # the adapters moved the policy off its base
    # only the 2 x 4 targeted weights per stage are synced: 8 of the model's tensors in all
    shard = torch.load(ckpt / "step_000003" / "trainer_tp0_pp1.pt", weights_only=False)
    assert sorted({k.rsplit(".", 1)[1] for k in shard["model"]}) == ["lora_a", "lora_b"]
    adapter = export_checkpoint(tmp_path, tmp_path / "adapter")
    assert (adapter / "adapter_model.safetensors").is_file()
    merged = export_checkpoint(tmp_path, tmp_path / "merged", merge_lora=True)
    ours = load_file(str(merged / "model.safetensors"))
    theirs = {}
    for path in (tmp_path / "hf" / "step_000003").glob("model-*.safetensors"):
        theirs.update(load_file(str(path)))
    assert sorted(ours) == sorted(theirs)
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
