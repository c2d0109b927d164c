"""Bounds derived from the work: gateway.request_timeout_s=auto and the rollout's wait follow
the step's batch and the rollout engines, so a GPU-sized rollout does not fail by a default
sized for a CPU toy, while the CPU examples keep the bounds they had (300 s, 900 s)."""

from __future__ import annotations

from pathlib import Path

import pytest

from relax_launch.config import ConfigError, load_config
from relax_launch.inference.config import GatewayConfig

REPO = Path(__file__).resolve().parents[2]
GPU_CONFIG = REPO / "configs/qwen3_8b_decoupled_2x8.yaml"
# the step: 512 samples x 4,096 response tokens on two rollout engines
GPU_STEP = (
    "data.prompts_per_step=64",
    "algorithm.n_samples_per_prompt=8",
    "data.max_prompt_tokens=256",
    "data.max_response_tokens=4096",
)
OLD_REQUEST_TIMEOUT_S, OLD_ROLLOUT_WAIT_S = 300.0, 900.0


def test_a_gpu_sized_step_gets_bounds_beyond_the_old_constants():
    job = load_config(GPU_CONFIG, GPU_STEP)
    assert job.rollout.num_engines == 2
    queued = 256 * (256 + 4096)  # samples per engine x their longest tokens
    assert job.request_timeout_s() == pytest.approx(queued / 500, abs=1)  # 2,229 s
    assert job.request_timeout_s() > 1800 > OLD_REQUEST_TIMEOUT_S
    assert job.rollout_wait_s() == 3 * job.request_timeout_s() > OLD_ROLLOUT_WAIT_S


def test_more_engines_or_fewer_tokens_shorten_the_bound():
    job = load_config(GPU_CONFIG, GPU_STEP)
    four = load_config(GPU_CONFIG, (*GPU_STEP, "rollout.ranks=8"))
    short = load_config(GPU_CONFIG, (*GPU_STEP, "data.max_response_tokens=1024"))
    assert four.rollout.num_engines == 4
    assert four.request_timeout_s() < job.request_timeout_s()
    assert short.request_timeout_s() < job.request_timeout_s()


@pytest.mark.parametrize(
    "path", sorted((REPO / "configs").glob("*_cpu.yaml")), ids=lambda p: p.stem
)
def test_cpu_examples_keep_their_bounds(path):
    job = load_config(path)
    assert job.request_timeout_s() == OLD_REQUEST_TIMEOUT_S
    assert job.rollout_wait_s() == OLD_ROLLOUT_WAIT_S


def test_a_stated_request_timeout_is_used_as_stated():
    job = load_config(GPU_CONFIG, (*GPU_STEP, "gateway.request_timeout_s=45"))
    assert job.request_timeout_s() == 45.0 and job.rollout_wait_s() == 135.0
    assert GatewayConfig().timeout_s() == OLD_REQUEST_TIMEOUT_S  # auto, no batch known: floor


@pytest.mark.parametrize("value", ["0", "-5", "soon"])
def test_a_request_timeout_that_is_neither_positive_nor_auto_is_refused(value):
    with pytest.raises(ConfigError, match="gateway.request_timeout_s"):
        load_config(GPU_CONFIG, (f"gateway.request_timeout_s={value}",))
