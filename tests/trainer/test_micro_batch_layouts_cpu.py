"""Micro-batch layouts: a token budget, packed sequences and context parallelism change how a
batch is computed, never what it computes.

Unit tests of the grouping and packing (``trainer/micro_batches.py``), then the real Trainer
(Megatron-core, CPU, fp32) on one ragged batch: logprobs (<= 1e-5), gradients of a PPO step
(<= 1e-6) and the loss, under a per-token loss and under every per-sequence operation (GSPO's
ratio, the mean per sequence, masked importance sampling), against fixed micro-batches of 8.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from layout_invariance_worker import LENGTHS, batch
from torchrun_worker import run_worker

from relax_launch.models.build import ensure_model
from relax_launch.trainer import micro_batches
from relax_launch.trainer.attention import positions_of

WORKER = Path(__file__).with_name("layout_invariance_worker.py")
LOGPROBS_TOLERANCE, GRAD_TOLERANCE = 1e-5, 1e-6
REFERENCE = "fixed8=micro_batch_size:8"
ONE_RANK = [
    "fixed2=micro_batch_size:2",
    "budget=max_tokens_per_micro_batch:64",
    "packed=max_tokens_per_micro_batch:64,pack_sequences:true",
    "packed_fixed4=micro_batch_size:4,pack_sequences:true",
]
TWO_RANKS = [
    "cp2=cp_size:2,micro_batch_size:8",
    "cp2_packed=cp_size:2,max_tokens_per_micro_batch:64,pack_sequences:true",
    "dp2_budget=max_tokens_per_micro_batch:48",  # the DP ranks run 2 and 3 micro-batches
    "pp2_packed=pp_size:2,max_tokens_per_micro_batch:64,pack_sequences:true",
]
EP2 = "ep2_budget=ep_size:2,max_tokens_per_micro_batch:48"
LENGTHS_TRAINED = [n - 1 for n in LENGTHS]


# -- grouping and packing ------------------------------------------------------------------------


@pytest.mark.parametrize("packed", [False, True])
def test_a_budget_holds_every_sequence_once_and_no_micro_batch_exceeds_it(packed):
    for budget, multiple in ((40, 1), (64, 1), (64, 4), (200, 2)):
        groups = micro_batches.group_sequences(
            LENGTHS_TRAINED, micro_batch_size=1, max_tokens=budget, packed=packed, multiple=multiple
        )
        assert sorted(i for g in groups for i in g) == list(range(len(LENGTHS)))
        for group in groups:
            lengths = [LENGTHS_TRAINED[i] for i in group]
            if packed:
                cost = micro_batches.round_up(sum(lengths), multiple)
            else:
                cost = len(group) * micro_batches.round_up(max(lengths), multiple)
            assert cost <= budget, (budget, multiple, group)
    assert len(groups) == (1 if packed else 2)  # 200 tokens: the 154 packed; 4 x 40 padded


def test_a_sequence_over_the_budget_is_refused_naming_the_setting():
    with pytest.raises(ValueError, match="max_tokens_per_micro_batch=32"):
        micro_batches.group_sequences(
            LENGTHS_TRAINED, micro_batch_size=1, max_tokens=32, packed=True
        )


def test_split_to_reaches_the_count_with_empty_micro_batches_last():
    assert micro_batches.split_to([[0, 1, 2, 3]], 3) == [[0], [1], [2, 3]]
    assert micro_batches.split_to([[0]], 3) == [[0], [], []]


@pytest.mark.parametrize("packed", [False, True])
def test_an_empty_micro_batch_is_padding_that_trains_nothing(packed):
    full, empty = micro_batches.build(batch(), [[0], []], packed=packed, multiple=2)
    assert empty.keys() == full.keys() - {"gather"}  # the loss reads the same fields
    assert not empty["mask"].any() and not empty["valid"].any() and empty["order"].numel() == 0
    assert empty["positions"].tolist() == [[0, 1]]  # one causal sequence: attention is defined


def test_a_packed_row_restarts_positions_masks_across_sequences_and_unpacks():
    shard = batch()
    padded, packed = (
        micro_batches.build(shard, [[1, 5, 3]], packed=p, multiple=4)[0] for p in (False, True)
    )
    lengths = [LENGTHS_TRAINED[i] for i in (1, 5, 3)]  # 3, 2, 8 -> 13, padded to 16
    assert packed["inputs"].shape == (1, 16) and padded["inputs"].shape == (3, 8)
    # each sequence starts at position 0, the tail's padding too (one more sequence)
    assert packed["positions"][0].tolist() == [0, 1, 2, 0, 1, *range(8), 0, 1, 2]
    unpacked = packed["inputs"].reshape(-1)[packed["gather"]]
    real = padded["valid"][:, : max(lengths)] > 0
    assert torch.equal(unpacked[real], padded["inputs"][:, : max(lengths)][real])
    assert torch.equal(packed["mask"], padded["mask"][:, : max(lengths)])
    assert packed["order"].tolist() == [1, 5, 3]


def test_attention_finds_each_packed_sequence_from_the_positions():
    class One:
        def size(self) -> int:
            return 1

    packed = micro_batches.build(batch(), [[1, 5, 3]], packed=True, multiple=4)[0]
    assert positions_of(packed["positions"], One()).sequences == [
        [(0, 3), (3, 5), (5, 13), (13, 16)]
    ]
    padded = micro_batches.build(batch(), [[1, 5, 3]], packed=False)[0]
    assert positions_of(padded["positions"], One()).sequences is None  # one fused call


def test_context_parallel_ranks_hold_contiguous_slices():
    shard = batch()
    whole = micro_batches.build(shard, [[0, 1]], packed=True, multiple=2)[0]
    halves = [
        micro_batches.build(shard, [[0, 1]], packed=True, multiple=2, cp=(r, 2))[0]
        for r in range(2)
    ]
    assert torch.equal(torch.cat([h["inputs"] for h in halves], 1), whole["inputs"])
    assert torch.equal(torch.cat([h["positions"] for h in halves], 1), whole["positions"])


# -- the real trainer ----------------------------------------------------------------------------


def assert_same(out: Path, model: str, variants: list[str]) -> None:
    reference = torch.load(out / model / "fixed8.pt")
    for variant in (v.split("=")[0] for v in variants):
        other = torch.load(out / model / f"{variant}.pt")
        off = max(
            max(abs(a - b) for a, b in zip(x, y, strict=True))
            for x, y in zip(other["logprobs"], reference["logprobs"], strict=True)
        )
        assert off <= LOGPROBS_TOLERANCE, f"{model} {variant}: logprobs differ by {off:.2e}"
        for loss in ("token", "sequence"):
            grads, expected = other[loss]["grads"], reference[loss]["grads"]
            assert grads and max(float(g.abs().max()) for g in expected.values()) > 1e-4
            off = max(float((g - expected[n]).abs().max()) for n, g in grads.items())
            assert off <= GRAD_TOLERANCE, f"{model} {variant} {loss}: gradients differ by {off:.2e}"
            assert other[loss]["metrics"]["loss"] == pytest.approx(
                reference[loss]["metrics"]["loss"], abs=1e-6
            )


@pytest.mark.e2e
@pytest.mark.slow  # in the default run: CP's weights, test_distributed_optimizer_cpu.py; any
# micro-batching's gradient, test_loss_aggregation_cpu.py; packed rows in a job, test_moe_job.py
def test_budget_packing_and_context_parallelism_compute_the_same_step(venv_env, tmp_path):
    """A dense and a mixture-of-experts model: fixed micro-batches, a budget, packed rows (by
    budget and by count) on one rank; CP=2, DP=2 with a budget, PP=2 packed on two; the MoE
    model's experts over two ranks with a budget."""
    models = [ensure_model(f"builtin:{name}") for name in ("tiny-llama", "tiny-qwen3-moe")]
    run_worker(WORKER, 1, [tmp_path, *models, REFERENCE, *ONE_RANK], venv_env)
    run_worker(WORKER, 2, [tmp_path, *models, *TWO_RANKS], venv_env)
    # experts exchange tokens in every micro-batch: the EP ranks run as many as the most
    run_worker(WORKER, 2, [tmp_path, models[1], EP2], venv_env)
    for model in models:
        assert_same(tmp_path, model.name, ONE_RANK + TWO_RANKS)
        assert torch.load(tmp_path / model.name / "dp2_budget.pt")["micro_batches"] == [2, 3]
    assert_same(tmp_path, models[1].name, [EP2])
    assert torch.load(tmp_path / models[1].name / "ep2_budget.pt")["micro_batches"] == [3, 3]


@pytest.mark.e2e
@pytest.mark.slow
def test_packed_logprobs_and_gradients_equal_the_padded_ones_for_every_family(venv_env, tmp_path):
    names = ("tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-qwen3-moe", "tiny-qwen2-moe")
    models = [ensure_model(f"builtin:{name}") for name in names]
    variants = ["packed=max_tokens_per_micro_batch:64,pack_sequences:true"]
    run_worker(WORKER, 1, [tmp_path, *models, REFERENCE, *variants], venv_env)
    for model in models:
        assert_same(tmp_path, model.name, variants)
