"""The loss of a batch does not depend on how it is split: micro-batch size 1, 2 and 4 and data
parallelism 1 and 2 give the same gradient (real Megatron-core, fp32, CPU).

A mean per micro-batch (then averaged over micro-batches and DP ranks) weights a token of a short
micro-batch more than one of a long one; the per-token loss divides once by the global count.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torchrun_worker import run_worker

pytestmark = pytest.mark.e2e
WORKER = Path(__file__).with_name("grad_invariance_worker.py")
TOLERANCE = 1e-6


def test_gradient_is_the_same_for_any_micro_batching_and_data_parallelism(
    tiny_model, venv_env, tmp_path
):
    run_worker(WORKER, 1, [tiny_model, tmp_path, 1, 2, 4], venv_env)
    run_worker(WORKER, 2, [tiny_model, tmp_path, 1, 2], venv_env)
    for aggregation in ("token", "sequence"):
        assert_same_gradients(tmp_path, aggregation)


def assert_same_gradients(out: Path, aggregation: str) -> None:
    reference = torch.load(out / f"{aggregation}_dp1_mbs4.pt")
    largest = max(float(g.abs().max()) for g in reference["grads"].values())
    assert largest > 1e-3, "the step must make a gradient"
    for split in ("dp1_mbs1", "dp1_mbs2", "dp2_mbs1", "dp2_mbs2"):
        other = torch.load(out / f"{aggregation}_{split}.pt")
        off = max(float((other["grads"][n] - g).abs().max()) for n, g in reference["grads"].items())
        assert off <= TOLERANCE, (
            f"{aggregation} {split}: gradient differs by {off:.2e} from dp1_mbs4"
        )
        assert other["metrics"]["loss"] == pytest.approx(reference["metrics"]["loss"], abs=1e-6)
