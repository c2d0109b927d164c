"""trainer.optimizer_offload with real Megatron-core (HybridDeviceOptimizer inside the
distributed optimizer), two ranks of DP on the CPU, DDP's parameter buffers standing in for
device memory (``optimizer_offload_worker.py`` says how and why).

The offloaded optimizer keeps its master weights and Adam state off the device, steps to the
parameters the plain distributed optimizer reaches (torch's fused AdamW on the host against
its foreach one: the same to float rounding), and resumes from a checkpoint bit-exactly. On
the plain CPU it has nothing to offload, which is why the config refuses it there.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from torchrun_worker import run_worker

pytestmark = pytest.mark.e2e
WORKER = Path(__file__).with_name("optimizer_offload_worker.py")
# Adam's normalised update (m / (sqrt(v) + eps)) turns rounding differences in gradients near
# eps into update differences far above float rounding; a wrong step moves a weight by ~lr (1e-2).
# The host's fused AdamW and the foreach one round differently by CPU (5.8e-5 on an AVX2-only
# EPYC, under 5e-5 on others): still 50x below a wrong step.
TOLERANCE = {"float32": 2e-4, "bfloat16": 1e-3}  # a bf16 weight may round the other way


@pytest.fixture(scope="module")
def reports(tiny_model: Path, venv_env: dict[str, str], tmp_path_factory) -> list[dict]:
    (found,) = run_worker(WORKER, 2, [tiny_model, tmp_path_factory.mktemp("ckpt")], venv_env)
    assert len(found["ranks"]) == 2
    return found["ranks"]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_offloaded_optimizer_keeps_its_state_off_the_device(reports, dtype):
    for report in reports:
        got = report[dtype]
        assert got["optimizer"] == "HybridDeviceOptimizer", got
        assert got["host_optimizers"] >= 1 and not got["device_optimizer"], got
        assert got["host_copies"] > 0, got  # every shard this rank steps has a host copy
        assert got["state_tensors"] == 4 * got["host_copies"], got  # step, moments, master
        assert got["state_on_the_device"] == 0, got


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_offloaded_step_reaches_the_plain_distributed_optimizers_parameters(reports, dtype):
    for report in reports:
        got = report[dtype]
        print(f"{dtype}: offloaded vs plain {got['offload_vs_plain']:.1e} (moved {got['moved']})")
        assert got["moved"] > 1e-2, "the steps must move the weights"
        assert got["offload_vs_plain"] <= TOLERANCE[dtype], got


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_an_offloaded_optimizer_resumes_bit_exactly(reports, dtype):
    for report in reports:
        assert report[dtype]["resumed_vs_uninterrupted"] == 0.0, report[dtype]


def test_on_the_plain_cpu_there_is_nothing_to_offload(reports):
    assert [r["plain_cpu_host_copies"] for r in reports] == [0, 0]
