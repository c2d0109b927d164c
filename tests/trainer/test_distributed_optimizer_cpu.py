"""trainer.distributed_optimizer on the CPU with real Megatron-core (gloo, torchrun).

The distributed optimizer shards fp32 master weights and Adam's state over the data-parallel
(x context-parallel) ranks: gradients reduce-scattered, parameters all-gathered after each step.
Against the plain optimizer on the same batches: the same weights, and the same HF export, after
3 steps (DP=2 on tiny Llama, Qwen3 and Qwen3 with LoRA; TP=2 x DP=2; PP=2 x DP=2 with tied
embeddings; CP=2 x DP=2; Qwen3-MoE with DP=4 x EP=2), with the optimizer memory per rank divided
by the ranks sharing it. Checkpoints resume exactly in fresh processes; into another DP size or
the other optimizer they are refused before anything loads. Offload/onload is bit-exact.
Three torchrun launches (2, 2 and 4 ranks, distributed_optimizer_worker.py) serve every check.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from torchrun_worker import run_worker

from relax_launch.models.build import ensure_model

pytestmark = pytest.mark.e2e
WORKER = Path(__file__).with_name("distributed_optimizer_worker.py")
# fp32: the clip's gradient norm is summed in another order (the last bit of its coefficient);
# without the clip the runs are bit-identical
TOLERANCE = 1e-6


@pytest.fixture(scope="module")
def out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("distributed-optimizer")


@pytest.fixture(scope="module")
def dense(out: Path, tiny_model: Path, venv_env: dict[str, str]) -> list[dict]:
    qwen3 = ensure_model("builtin:tiny-qwen3")
    return ranks(run_worker(WORKER, 2, ["dense", out, tiny_model, qwen3], venv_env), 2)


@pytest.fixture(scope="module")
def resumed(dense: list[dict], out: Path, tiny_model: Path, venv_env: dict[str, str]) -> list:
    return ranks(run_worker(WORKER, 2, ["resume", out, tiny_model], venv_env), 2)


@pytest.fixture(scope="module")
def parallel(dense: list[dict], out: Path, tiny_model: Path, venv_env: dict[str, str]) -> list:
    qwen2, moe = (ensure_model(f"builtin:{name}") for name in ("tiny-qwen2", "tiny-qwen3-moe"))
    args = ["parallel", out, tiny_model, qwen2, moe]
    return ranks(run_worker(WORKER, 4, args, venv_env), 4)


def ranks(reports: list[dict], count: int) -> list[dict]:
    assert [r["rank"] for r in reports] == list(range(count)), reports
    return reports


def assert_same_training(case: dict, exact: bool = False) -> None:
    assert case["changed"] > 1e-3, f"training barely moved the weights: {case}"
    limit = 0.0 if exact else TOLERANCE
    assert case["diff"] <= limit and case["export_diff"] <= limit, case
    for plain, distributed in zip(*case["grad_norms"].values(), strict=True):
        assert distributed == pytest.approx(plain, rel=1e-6), case["grad_norms"]


def assert_halved(case: dict, shards: list[int]) -> None:
    """Each chained optimizer's master weights and state on this rank: its plain size over the
    DP ranks sharing it, within 10 % (Megatron pads each bucket to a multiple of them)."""
    for plain, distributed, count in zip(*case["bytes"].values(), shards, strict=True):
        for kind in ("master", "state"):
            assert distributed[kind] == pytest.approx(plain[kind] / count, rel=0.1), case


@pytest.mark.parametrize("model", ["llama", "qwen3", "qwen3_lora"])
def test_dp2_weights_after_3_steps_equal_the_plain_optimizers(dense, model):
    for report in dense:
        assert report["grad_stats_is_trainer"], "the grad norm must be summed over the trainer"
        assert_same_training(report[model])
        assert report[model]["exported"] > 0 or report["rank"] == 1  # DP replica 0 exports


def test_without_the_clip_the_distributed_optimizer_is_bit_identical(dense):
    for report in dense:
        assert_same_training(report["llama_unclipped"], exact=True)


def test_tp_pp_cp_and_moe_ep_weights_equal_the_plain_optimizers(parallel):
    for report in parallel:
        assert_same_training(report["tp2_dp2"])
        assert_same_training(report["pp2_dp2"], exact=True)
        assert_same_training(report["cp2_dp2"])
        assert_same_training(report["moe_dp4_ep2"])
        assert report["moe_expert_dp"] == 2  # experts are sharded too, over their own DP


def test_optimizer_memory_per_rank_is_divided_by_the_dp_size(dense, parallel):
    for report in dense:
        for model in ("llama", "qwen3", "qwen3_lora"):
            assert_halved(report[model], [2])
        assert_halved({"bytes": report["bf16_bytes"]}, [2])
    for report in parallel:
        assert_halved(report["tp2_dp2"], [2])
        assert_halved(report["pp2_dp2"], [2])
        assert_halved(report["cp2_dp2"], [4])  # over DP x CP
        assert_halved(report["moe_dp4_ep2"], [4, 2])  # dense over DP=4, experts over 2


def test_a_checkpoint_resumes_exactly_in_fresh_processes(dense, resumed):
    # every DP rank writes its optimizer shard; the first also the model
    assert dense[0]["distributed_file"].endswith("trainer_tp0_pp0.pt"), dense[0]
    assert dense[1]["distributed_file"].endswith("trainer_tp0_pp0_dp1.pt"), dense[1]
    assert dense[1]["plain_file"] is None  # the plain optimizer's replicas hold the same state
    for report in resumed:
        assert report["loaded_step"] == 2
        assert report["identical"], f"rank {report['rank']}: step 3 differs by {report['diff']}"
        assert report["step0_loaded"] == 0 and report["step0_then_step"] == 1, report
        assert_cycles_exact(report["cycles"], 1)  # the loaded state offloads like its own


def test_moe_checkpoint_resumes_exactly(parallel):
    for report in parallel:
        assert report["moe_loaded_step"] == 2 and report["moe_resumed_identical"], report


def test_the_other_optimizer_or_another_dp_size_is_refused_before_loading(resumed, parallel):
    for report in resumed:
        for key, was in (("plain_refused", "false"), ("distributed_refused", "true")):
            error = report[key]
            assert f"was saved with trainer.distributed_optimizer={was}" in error, error
            assert f"resume with trainer.distributed_optimizer={was}" in error, error
            assert "BUT THE MODEL CHANGED" not in error
    for report in parallel:
        error = report["resized_refused"]
        assert "shards for 2 data-parallel" in error and "this trainer has 4" in error, error
        assert "trainer.distributed_optimizer" in error and "trainer.ranks" in error, error
        assert "BUT THE MODEL CHANGED" not in error


def test_offload_and_onload_are_bit_exact(dense):
    for report in dense:
        assert_cycles_exact(report["cycles"], 4)  # 3 fp32 steps, 1 bfloat16
        assert report["offload_identical"], f"rank {report['rank']}: offloading changed steps"


def assert_cycles_exact(cycles: list[dict], count: int) -> None:
    assert len(cycles) == count
    for cycle in cycles:
        assert cycle["same"] and cycle["moved"] == cycle["back"] > 0, cycle
        # what stays: Megatron's one-element flags (_scale_one, _dummy_overflow_buf)
        assert all(shape == [1] for shape in cycle["left"]) and len(cycle["left"]) <= 2, cycle
