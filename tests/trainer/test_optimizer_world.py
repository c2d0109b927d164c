"""Megatron's optimizer factory gathers over the trainer's ranks only, and only its module sees
that: the rest of the process (the watchdog's thread, the weight sync) keeps the default world."""

from __future__ import annotations

from pathlib import Path

import pytest
from torchrun_worker import run_worker

pytestmark = pytest.mark.e2e
WORKER = Path(__file__).with_name("optimizer_world_worker.py")


def test_the_factory_gathers_over_the_trainer_and_the_process_keeps_its_world(venv_env):
    (report,) = run_worker(WORKER, 2, [], venv_env)
    assert report["factory_world"] == 1, "the factory must size its gather by the trainer group"
    assert report["param_groups"] >= 1
    assert report["process_world"] == 2, "torch.distributed outside the factory is untouched"
    assert report["restored"], "the factory's module gets torch back when the scope ends"
