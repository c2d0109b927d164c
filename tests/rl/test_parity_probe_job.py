"""The parity probe after every weight sync, against real engines whose weights are corrupted on
purpose (the test fault plugin's ``RELAX_TEST_CORRUPT_AT``: noise on one weight right after the
engine takes the version): a decoupled job and issue 50's split LoRA job end before step 1
trains, naming the engine, the version and the gap. The probe passing every
sync is asserted by the default jobs (``test_colocated_job.py``'s split LoRA job,
``test_rl_job.py``'s three roles)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_colocated_job import LORA

pytestmark = pytest.mark.e2e
HERE = Path(__file__).parent
FAULT_PLUGIN = HERE.parent / "weights" / "fault_plugin"  # the engines' test-only SGLang plugin


def run_corrupted(
    config: Path, log_dir: Path, *overrides: str, at: str = "0", half: str = ""
) -> subprocess.CompletedProcess:
    """The job with every engine's weights (``half``: only that half of a disaggregated pair's)
    corrupted right after it takes version ``at``."""
    cli = Path(sys.executable).with_name("relax-launch")
    plugin_path = os.pathsep.join([str(FAULT_PLUGIN), str(HERE), os.environ.get("PYTHONPATH", "")])
    return subprocess.run(
        [str(cli), "run", str(config), f"logging.dir={log_dir}", "logging.level=warning"]
        + list(overrides),
        capture_output=True,
        text=True,
        timeout=600,
        env={
            **os.environ,
            "PYTHONPATH": plugin_path,
            "RELAX_TEST_CORRUPT_AT": at,
            "RELAX_TEST_CORRUPT_HALF": half,
        },
    )


def assert_stopped_by_the_probe(result: subprocess.CompletedProcess, log_dir: Path) -> str:
    """The job failed on the probe of version 0 before any step trained; returns its output."""
    output = result.stdout + result.stderr
    assert result.returncode != 0, output[-4000:]
    assert "weight sync to version 0 failed its parity probe" in output, output[-4000:]
    assert "rollout engine 0 (rank" in output and "largest |trainer - engine| logprob" in output
    assert "Likely causes:" in output and "LoRA merge" in output
    metrics = log_dir / "metrics.jsonl"
    assert not metrics.exists() or not metrics.read_text().strip()  # no step trained
    end = json.loads((log_dir / "end.json").read_text())
    assert end["state"] == "failed" and "parity probe" in end["reason"], end
    return output


def test_a_corrupted_engine_fails_its_first_sync_and_the_job_ends(tmp_path):
    """Decoupled: the probe runs inside the sync, before its commit (the engine never serves)."""
    fast = ["algorithm.num_steps=1", "algorithm.max_staleness=0"]  # no producer to start
    result = run_corrupted(HERE / "async_tiny.yaml", tmp_path, *fast)
    output = assert_stopped_by_the_probe(result, tmp_path)
    assert "job is up" not in output  # the first sync failed: the engine never served


@pytest.mark.slow  # the decoupled probe is the default run's; this is issue 50's split LoRA job
def test_a_corrupted_split_lora_engine_stops_the_job_before_step_1_trains(tmp_path):
    """Colocated: the engine scores the probe once its KV cache is back, before generating."""
    result = run_corrupted(HERE / "split_tiny.yaml", tmp_path, *LORA, "algorithm.num_steps=1")
    output = assert_stopped_by_the_probe(result, tmp_path)
    assert "phase rollout of batch 0 failed" in output  # before the first generation


@pytest.mark.slow  # the guard's stop is the default run's (tests/rl/test_mismatch_guard.py)
def test_skip_withholds_the_corrupted_step_and_the_next_sync_repairs_the_engine(tmp_path):
    """The probe off, the engine corrupted as it takes version 1: step 2 samples from it, the
    trainer withholds that step's update, the sync after it sends the weights again (the
    corruption is the plugin's, once), and step 3 is on-policy again."""
    on_policy = ["algorithm.num_steps=3", "algorithm.max_staleness=0"]
    skip = ["weight_sync.parity_probe.enabled=false", "algorithm.mismatch_guard.action=skip"]
    result = run_corrupted(HERE / "async_tiny.yaml", tmp_path, *on_policy, *skip, at="1")
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    engine_log = (tmp_path / "rollout-engine0.log").read_text()
    assert "relax-test: corrupted" in engine_log and "at weight version 1" in engine_log
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["guard/tripped"] for r in rows] == [0.0, 1.0, 0.0]
    assert [r["update_withheld"] for r in rows] == [0.0, 1.0, 0.0]
    assert rows[1]["logprob_diff_max"] > 0.01 and rows[1]["grad_norm"] == 0.0
    assert rows[2]["logprob_diff_max"] < 1e-3  # the sync after step 2 repaired the engine
    assert rows[0]["grad_norm"] > 0 and rows[2]["grad_norm"] > 0
    assert "the trainer withheld this step's update" in output
    assert "withheld 1 of algorithm.mismatch_guard.max_skips=2" in output


@pytest.mark.slow  # a prefill/decode job of its own; the default PD job asserts the probe passes
def test_a_corrupted_decode_half_fails_the_first_sync(tmp_path):
    """The decode half computes no prompt logprobs: the probe has the pair generate and the
    trainer score what it generated, so a decode half alone holding other weights is caught."""
    pd = HERE.parents[1] / "configs" / "pd_cpu.yaml"
    result = run_corrupted(pd, tmp_path, "algorithm.num_steps=1", half="decode")
    output = assert_stopped_by_the_probe(result, tmp_path)
    assert "decode half: largest |trainer - engine| logprob" in output
    assert "prefill" not in output.split("failed its parity probe")[1].split("What was")[0]
