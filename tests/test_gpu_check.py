"""The GPU check (scripts/gpu_check.py) on the CPU, every part but the engines': it runs on a
GPU machine rarely, so it runs here on every test run and cannot rot."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e
REPO = Path(__file__).resolve().parents[1]


def test_the_gpu_check_passes_its_cpu_dry_run(tmp_path):
    table = tmp_path / "table.md"
    done = subprocess.run(
        [sys.executable, "scripts/gpu_check.py", "--device", "cpu", "--no-engines"]
        + ["--out", str(table)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = table.read_text()
    for check in (
        "trainer float32: logprobs vs transformers",
        "trainer bfloat16: 3 train steps",
        "offload: device memory released",
        "onload: logprobs bit-identical",
        "colocated transport (shared memory, 2 processes)",
        "collectives: broadcast 2 s behind a kernel, polled (wait_for)",
        "collectives: the group usable after it",
        "collectives: beside it, wait(timeout=1 s) on the same broadcast",
    ):
        assert f"| {check}" in rows and "| NO |" not in rows, rows
    assert "gpu_check: passed" in done.stdout
