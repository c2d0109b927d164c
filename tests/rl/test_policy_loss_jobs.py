"""A real short job with each policy loss (CISPO, SAPO, M2PO) and with REINFORCE++'s group
baseline: the tiny Llama one step off-policy (``off_policy_kl_tiny.yaml``: PP=2, KL to the
reference, lr 1e-2), so from step 2 on the samples come from the previous weights and the
losses' weights, gates and masks have ratios away from 1 to act on."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from test_rl_job import run_tiny

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
CONFIG = Path(__file__).parent / "off_policy_kl_tiny.yaml"
M2PO_THRESHOLD = 0.01  # below the stale batches' second moment (0.045 and 0.067 measured)


def check_cispo(steps: list[dict]) -> None:
    for s in steps:
        assert 0.0 <= s["cispo_capped_fraction"] <= 1.0
        assert "clip_fraction" not in s and "is_cut_fraction" not in s  # no PPO clip, no TIS
    assert steps[0]["cispo_capped_fraction"] == 0.0  # on policy in float32: every ratio ~1
    # stale ratios past the cap (16% and 22% of the tokens measured), their gradient kept
    assert max(s["cispo_capped_fraction"] for s in steps[1:]) > 0.0


def check_sapo(steps: list[dict]) -> None:
    for s in steps:
        assert 0.0 < s["sapo_gate_mean"] <= 1.0 + 1e-6
    assert steps[0]["sapo_gate_mean"] == pytest.approx(1.0, abs=1e-4)  # on policy: r = 1
    assert min(s["sapo_gate_mean"] for s in steps[1:]) < 1.0 - 1e-6  # stale ratios: gated


def check_m2po(steps: list[dict]) -> None:
    for s in steps:
        assert 0.0 <= s["m2po_masked_fraction"] < 1.0
        assert s["m2po_m2_kept_max"] <= M2PO_THRESHOLD + 1e-9
        assert "clip_fraction" not in s and "is_cut_fraction" not in s
    assert steps[0]["m2po_masked_fraction"] == 0.0  # on policy: nothing to mask
    stale = steps[1:]
    assert max(s["m2po_m2"] for s in stale) > M2PO_THRESHOLD  # the stale batches exceed it
    assert max(s["m2po_masked_fraction"] for s in stale) > 0.0  # and the mask acts


def check_reinforce_pp(steps: list[dict]) -> None:
    for s in steps:
        assert 0.0 <= s["clip_fraction"] <= 1.0 and s["is_cut_fraction"] >= 0.0


CASES = {
    "cispo": (["algorithm.policy_loss=cispo"], check_cispo),
    "sapo": (  # no correction, so that the gate sees the stale ratios (with one it sees 1)
        ["algorithm.policy_loss=sapo", "algorithm.rollout_correction=none"],
        check_sapo,
    ),
    "m2po": (
        ["algorithm.policy_loss=m2po", f"algorithm.m2po_threshold={M2PO_THRESHOLD}"],
        check_m2po,
    ),
    "reinforce_pp_baseline": (
        ["algorithm.advantage_estimator=reinforce_pp_baseline"],
        check_reinforce_pp,
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_real_job_trains_with_each_policy_loss(case, tmp_path):
    overrides, check = CASES[case]
    result = run_tiny(CONFIG, f"logging.dir={tmp_path}", *overrides)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    steps = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(steps) == 3 and steps[-1]["staleness"] == 1  # stale samples from step 2 on
    for s in steps:
        assert math.isfinite(s["loss"]) and s["grad_norm"] > 0
        assert math.isfinite(s["reward"]) and s["train_skipped"] == 0
        assert s["kl_ref"] >= 0.0  # the KL to the reference composes with every loss
    check(steps)
