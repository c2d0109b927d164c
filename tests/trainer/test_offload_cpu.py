"""Trainer offload/onload on the CPU with real Megatron-core (two TP ranks, one torchrun job).

While offloaded, every storage of the params (policy and reference), grad buffers and optimizer
state is empty; onloading restores their bytes exactly; 3 steps with offload/onload between
them end bit-identical to 3 steps without; calls that need an offloaded part fail by name.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from torchrun_worker import run_worker

pytestmark = pytest.mark.e2e
WORKER = Path(__file__).with_name("offload_worker.py")


@pytest.fixture(scope="module")
def reports(tiny_model: Path, venv_env: dict[str, str]) -> list[dict]:
    """One JSON report per rank of the worker's run (see offload_worker.py)."""
    found = run_worker(WORKER, 2, [tiny_model], venv_env)
    assert sorted(r["rank"] for r in found) == [0, 1], found
    return found


def all_checks(reports: list[dict]) -> list[dict]:
    return [c for r in reports for run in ("offloaded", "bf16") for c in r[run]["checks"]]


def test_offloaded_storage_is_empty_and_onload_restores_it_exactly(reports):
    checks = all_checks(reports)
    assert len(checks) == 2 * (3 + 1)  # per rank: 3 fp32 cycles, 1 bfloat16
    for check in checks:
        assert check["empty"] == {"params": True, "grads": True, "optimizer": True}, check
        assert check["restored"] == {"params": True, "grads": True, "optimizer": True}, check
        moved = check["grads_optimizer_bytes"] + check["params_bytes"]
        assert check["grads_optimizer_bytes"] > 0 and check["params_bytes"] > 0, check
        assert check["onload_bytes"] == moved, check
        # offloading an offloaded part, or onloading a resident one, moves nothing
        assert check["again_bytes"] == 0 and check["onload_again_bytes"] == 0, check


def test_steps_with_offload_between_them_are_bit_identical(reports):
    for report in reports:
        assert report["plain"]["changed"] and report["offloaded"]["changed"], "no learning"
        assert report["identical"], f"rank {report['rank']}: weights differ after offloading"


def test_calls_needing_an_offloaded_part_fail_by_name(reports):
    for check in all_checks(reports):
        assert check["params_resident"] and not check["grads_resident"], check
        assert "train_step needs its grads, optimizer" in check["train_step_error"], check
        assert "offloaded; onload them first" in check["train_step_error"], check
        assert "save needs its params, optimizer" in check["save_error"], check
        assert "logprobs needs its params" in check["logprobs_error"], check
        assert "export_hf_weights needs its params" in check["export_error"], check


def test_trainer_client_offloads_every_rank_by_command(reports):
    channel = next(r for r in reports if r["rank"] == 0)["channel"]
    total = sum(r["per_rank_bytes"] for r in reports)  # both TP ranks, the same shapes
    assert channel["offload"]["bytes"] == total, channel
    assert channel["onload_params"]["bytes"] + channel["onload"]["bytes"] == total, channel
    assert 0 < channel["onload_params"]["bytes"] < total, channel
    assert 0 < channel["offload"]["seconds"] < 60, channel  # the slowest rank's copy, timed
    error = channel["save_error"]
    assert "'trainer.save' failed on rank 0 (trainer)" in error and "rank 1 (trainer)" in error
    assert "save needs its params, optimizer" in error, error
