"""The CPU harness runs real Megatron-core: a GPT with TP=2 over gloo trains and lowers its loss."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from relax_launch.inference.server import free_port

pytestmark = pytest.mark.e2e
WORKER = Path(__file__).with_name("megatron_tp2_worker.py")


def test_megatron_gpt_tp2_on_two_ranks_lowers_loss(venv_env):
    torchrun = Path(sys.executable).with_name("torchrun")
    result = subprocess.run(
        [
            str(torchrun),
            "--nproc-per-node",
            "2",
            "--master-port",
            str(free_port()),
            str(WORKER),
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=240,
        env=venv_env,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["world"] == 2 and report["tp_size"] == 2
    assert report["local_vocab"] == 64, "logits must be vocab-parallel: 128 / TP 2 per rank"
    losses = report["losses"]
    assert losses[-1] < losses[0] - 0.3, losses
    assert all(b < a for a, b in zip(losses, losses[1:], strict=False)), losses
