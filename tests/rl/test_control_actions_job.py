"""The closed-loop control's actions on the train step in real jobs (``algorithm.control``,
``rl/control.py``), each on an engine whose weights are corrupted on purpose at version 0 (the
test fault plugin's ``RELAX_TEST_CORRUPT_AT``), with the parity probe off and the mismatch guard
warning, so that the wrong samples reach the trainer as a silently broken engine's would:

- ``ratio_mask``, one-step off-policy with no rollout correction: step 1 measures the corrupted
  engine's sequence ratios, the mask engages, step 2 (trained on samples of the same corrupted
  version) drops them, and the job goes on.
- ``routing_replay``, the tiny MoE job with replay off: step 1's routing differs from the
  engine's, replay turns on, and step 2 (the same corrupted version's samples) dispatches every
  trained token to the engine's experts while the trainer's own router still disagrees.

The decisions on recorded sequences: ``test_control_actions.py``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e
HERE = Path(__file__).parent
FAULT_PLUGIN = HERE.parent / "weights" / "fault_plugin"  # the engines' test-only SGLang plugin
# the corrupted samples reach the trainer: no probe to fail the sync, a guard that only warns
UNGUARDED = ["weight_sync.parity_probe.enabled=false", "algorithm.mismatch_guard.action=warn"]


def run_on_corrupted_engine(config: Path, log_dir: Path, *overrides: str) -> list[dict]:
    """Run the job with the engines' version 0 corrupted; its step metrics (it must succeed)."""
    cli = Path(sys.executable).with_name("relax-launch")
    plugin_path = os.pathsep.join([str(FAULT_PLUGIN), str(HERE), os.environ.get("PYTHONPATH", "")])
    result = subprocess.run(
        [str(cli), "run", str(config), f"logging.dir={log_dir}", *UNGUARDED, *overrides],
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "PYTHONPATH": plugin_path, "RELAX_TEST_CORRUPT_AT": "0"},
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    (log_dir / "console.txt").write_text(result.stdout + result.stderr)
    return [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow  # a job of its own; the decisions: test_control_actions.py
def test_the_ratio_mask_engages_on_a_corrupted_engine_and_drops_its_sequences(tmp_path):
    # the tiny random model's corruption moves its sequence ratios to 1.06 (healthy on-policy:
    # 1 + 1e-5), one step of drift at lr 1e-2 to 1.2: bounds for this model, not the defaults
    bounds = "{bound: 1.03, release_below: 1.01}"
    mask = [f"algorithm.control.ratio_mask={bounds}", "algorithm.rollout_correction=none"]
    steps = run_on_corrupted_engine(HERE / "off_policy_kl_tiny.yaml", tmp_path, *mask)
    for s in steps:
        print(
            f"step {s['step']}: staleness {s['staleness']}, sequence_ratio_max "
            f"{s['sequence_ratio_max']:.3g}, mismatch_kl {s['mismatch_kl']:.3g}, mask "
            f"{s['control/ratio_mask']}, masked {s['control/masked_sequences']:.3f}"
        )
    console = (tmp_path / "console.txt").read_text()
    assert [s["step"] for s in steps] == [1, 2, 3]  # the job went on
    first, second = steps[0], steps[1]
    # step 1: samples of the corrupted version 0, trained without a mask; it engages
    assert first["sequence_ratio_max"] > 1.03 and first["control/masked_sequences"] == 0.0
    assert first["control/ratio_mask"] == 1.0 and first["control/ratio_mask_step"] == 1.0
    # step 2: the same version's samples (one step stale): the mask drops them
    assert second["weight_version"] == 0 and second["control/masked_sequences"] > 0.5
    assert console.count("control: sequence ratio mask engaged") == 1


@pytest.mark.slow  # a job of its own; the decisions: test_control_actions.py
def test_routing_replay_turns_on_when_the_routing_drifts(tmp_path):
    config = Path(__file__).parents[2] / "configs" / "qwen3_moe_tiny_cpu.yaml"
    replay = ["algorithm.routing_replay=false", "algorithm.control.routing_replay={}"]
    off_policy = ["algorithm.off_policy_steps=1"]  # step 2 trains version 0's samples too
    steps = run_on_corrupted_engine(config, tmp_path, *replay, *off_policy)
    for s in steps:
        print(
            f"step {s['step']}: version {s['weight_version']}, routing_mismatch "
            f"{s['moe/routing_mismatch']:.3g}, dispatch_mismatch {s['moe/dispatch_mismatch']:.3g}"
            f", logprob_diff_max {s['logprob_diff_max']:.3g}, replay {s['control/routing_replay']}"
        )
    console = (tmp_path / "console.txt").read_text()
    assert [s["step"] for s in steps] == [1, 2, 3]
    first, second = steps[0], steps[1]
    # step 1: the trainer routes by itself (what it dispatched is what it chose), and differs
    assert first["moe/dispatch_mismatch"] == first["moe/routing_mismatch"] > 0.01
    assert first["control/routing_replay"] == 1.0
    # step 2, the same corrupted version's samples: its router still disagrees, yet every
    # trained token went to the experts the engine routed it to
    assert second["weight_version"] == 0 and second["moe/routing_mismatch"] > 0.01
    assert second["moe/dispatch_mismatch"] == 0.0
    assert all(s["control/routing_replay"] == 1.0 for s in steps[1:])
    assert console.count("control: routing replay turned on after step 1") == 1
