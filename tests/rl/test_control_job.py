"""Closed-loop control in a real fully asynchronous job (``algorithm.control``): the stale
samples' mismatch passes the bound, the staleness bound moves from 2 to 1 (logged once), and
from then on no sample two versions old is trained on. The decisions on recorded sequences:
``test_closed_loop_control.py``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_rl_job import run_tiny

pytestmark = pytest.mark.e2e


@pytest.mark.slow  # a fully asynchronous job of its own; the decisions: test_closed_loop_control.py
def test_the_staleness_bound_follows_the_mismatch(tmp_path):
    config = Path(__file__).parent / "async_tiny.yaml"
    # stale samples at lr 1e-3 show mismatch_kl 1e-3 to 1e-2: any of them tightens the bound
    control = ["algorithm.control.staleness.tighten_above=1e-4", "algorithm.num_steps=5"]
    result = run_tiny(config, f"logging.dir={tmp_path}", *control)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    steps = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    bounds = [s["control/max_staleness"] for s in steps]
    first = bounds.index(1.0)  # the step after which the bound is 1
    assert bounds[:first] == [2.0] * first and steps[first]["control/staleness_step"] == -1
    assert steps[first]["staleness"] > 0 and steps[first]["mismatch_kl"] > 1e-4
    for s in steps[first + 1 :]:  # samples two versions old are no longer trained on
        assert s["async/samples_staleness_2"] == s["samples_stale"], s
    assert result.stdout.count("control: max_staleness tightened to 1") == 1
