"""The CPU harness runs real Megatron-core: a GPT with TP=2 over gloo trains and lowers its loss."""

from __future__ import annotations

from pathlib import Path

import pytest
from torchrun_worker import run_worker

pytestmark = pytest.mark.e2e
WORKER = Path(__file__).with_name("megatron_tp2_worker.py")


def test_megatron_gpt_tp2_on_two_ranks_lowers_loss(venv_env):
    (report,) = run_worker(WORKER, 2, ["2"], venv_env)
    assert report["world"] == 2 and report["tp_size"] == 2
    assert report["local_vocab"] == 64, "logits must be vocab-parallel: 128 / TP 2 per rank"
    losses = report["losses"]
    assert losses[-1] < losses[0] - 0.3, losses
    assert all(b < a for a, b in zip(losses, losses[1:], strict=False)), losses
