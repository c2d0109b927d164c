"""trainer.clip_grad holds on the CPU: real Megatron-core clips by the global gradient norm.

Two ranks split the tiny Llama by TP or PP; a step whose loss is scaled 1000x has a gradient
norm in the thousands. The trainer must report the pre-clip norm of the whole model (as computed
here from the gradients gathered over both ranks, not Megatron's per-rank share), and with
clip_grad=1 the gradient Adam steps with must be the unclipped one scaled to norm 1. A step
beyond the mismatch guard's bounds (``LossSpec.withhold_above``, known on the last pipeline stage
only) leaves every rank's weights as they were.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from torchrun_worker import run_worker

pytestmark = pytest.mark.e2e
WORKER = Path(__file__).with_name("clip_grad_worker.py")


@pytest.mark.parametrize(
    ("tp", "pp", "dtype"), [(2, 1, "float32"), (1, 2, "float32"), (2, 1, "bfloat16")]
)
def test_clip_grad_scales_the_update_by_the_global_norm(tiny_model, venv_env, tp, pp, dtype):
    unclipped, clipped = run_worker(WORKER, 2, [tiny_model, tp, pp, dtype], venv_env)
    norm = unclipped["unclipped_grad_norm"]
    assert norm > 100, "the step must have a gradient norm far above the clip"
    for report in (unclipped, clipped):  # the metric is the pre-clip norm of the whole model
        assert report["reported_grad_norm"] == pytest.approx(norm, rel=1e-5)
        tolerance = 1e-6 * report["largest_used"]
        assert report["used_minus_scaled_unclipped"] <= tolerance, report
    assert unclipped["used_grad_norm"] == pytest.approx(norm, rel=1e-5), "clip_grad=0 is off"
    assert clipped["grad_norm_after_step"] == pytest.approx(1.0, rel=1e-5), clipped
    assert clipped["used_grad_norm"] == pytest.approx(1.0, rel=1e-5), clipped
    for report in (unclipped, clipped):  # every rank agreed to hold the update back
        assert report["withheld"] == {
            "update_withheld": 1.0,
            "weights_changed": False,
            "step_counted": False,
        }
