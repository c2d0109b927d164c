"""A real job with builtin:code_tests (tests/rl/code_tests_tiny.yaml): every sample of every
step is scored in a sandbox, and no sandbox outlives the job."""

from __future__ import annotations

import json
from pathlib import Path

import psutil
import pytest
from test_rl_job import run_tiny

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_a_job_scores_code_in_sandboxes(tmp_path):
    config = Path(__file__).parent / "code_tests_tiny.yaml"
    result = run_tiny(config, f"logging.dir={tmp_path}")
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    steps = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2]
    for s in steps:
        assert s["reward/ran"] == 0.5  # 2 of 4 tests: only a sandbox that ran them says so
        assert s["reward/code"] == 0.0  # no ```python block from the tiny model
        for name in ("code", "ran"):
            assert s[f"reward/{name}/failed"] == 0 and s[f"reward/{name}/timeouts"] == 0
        assert s["samples_invalid"] == 0
    uids = set(range(63000, 63004)) | {63100, 63101}
    left = [p.pid for p in psutil.process_iter(["uids"]) if p.info["uids"].real in uids]
    assert not left, f"sandbox processes outlived the job: {left}"
