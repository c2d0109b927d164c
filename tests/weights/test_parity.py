"""The parity probe's decisions (``weights/parity.py``): the tolerance of the precisions in use,
the fixed probe, the engine's batched reply read back, the worst token, and the error that
names the engine, the version, the gap and the likely causes. The probe against real engines:
``tests/rl/test_rl_job.py`` (passing every sync) and ``tests/rl/test_parity_probe_job.py``
(an engine's weight corrupted: the job ends before step 1 trains)."""

from __future__ import annotations

import math

import pytest

from relax_launch.weights.config import ParityProbeConfig
from relax_launch.weights.parity import (
    FP32_TOLERANCE,
    EngineGap,
    engine_request,
    engine_rows,
    largest_gap,
    parity_error,
    probe_sequences,
    tolerance_for,
)
from relax_launch.weights.update_session import WeightSyncError

# largest probe gaps of healthy syncs, recorded: quickstart (SmolLM2-135M) 5 syncs each, CPU
BF16_GAPS = [0.427, 0.251, 0.241, 0.149, 0.201]  # trainer and engines bfloat16
MIXED_GAPS = [0.405, 0.341, 0.207, 0.349, 0.462]  # trainer float32, rollout engines bfloat16
BROKEN_LORA_GAPS = [13.0, 18.0]  # issue 50's split LoRA job, engines holding other weights


def test_tolerance_is_measured_for_float32_and_bfloat16_and_never_guessed_for_float16():
    config = ParityProbeConfig()
    assert tolerance_for(config, "float32", "float32", "cpu") == FP32_TOLERANCE
    for dtypes, healthy in ((("bfloat16",) * 2, BF16_GAPS), (("float32", "bfloat16"), MIXED_GAPS)):
        tolerance = tolerance_for(config, *dtypes, "cpu")
        assert max(healthy) * 4 < tolerance < min(BROKEN_LORA_GAPS) / 5
    assert tolerance_for(config, "float16", "float16", "cpu") is None
    assert tolerance_for(config, "float32", "float16", "cpu") is None
    assert tolerance_for(ParityProbeConfig(tolerance=0.05), "bfloat16", "bfloat16", "cuda") == 0.05
    assert tolerance_for(config, "bfloat16", "bfloat16", "cuda") is None  # not measured there
    off = ParityProbeConfig(enabled=False, tolerance=0.05)
    assert tolerance_for(off, "float32", "float32", "cpu") is None


def test_the_probe_is_the_same_every_time_and_its_sequences_differ():
    encode = lambda text: [ord(c) for c in text]  # noqa: E731 - a tokenizer of characters
    first = probe_sequences(encode, 8, 256)
    assert first == probe_sequences(encode, 8, 256)
    assert len(first) == 8 and {len(s) for s in first} == {32}
    assert len({tuple(s) for s in first}) == 8
    short = probe_sequences(lambda text: [1, 2, 3], 4, 16)  # repeated as needed, 8 at least
    assert [len(s) for s in short] == [8] * 4


def scored(logprobs: list[float | None]) -> dict:
    """An SGLang reply's input logprobs: (logprob, token id, top) per position."""
    return {"meta_info": {"input_token_logprobs": [[lp, 0, None] for lp in logprobs]}}


def test_the_engine_scores_the_batch_and_its_rows_line_up_with_the_trainers():
    sequences = [[5, 6, 7], [8, 9, 10, 11]]
    body = engine_request(sequences, {"lora_path": "v3"})
    assert body["input_ids"] == sequences and body["logprob_start_len"] == 0
    assert body["sampling_params"]["max_new_tokens"] == 1 and body["lora_path"] == "v3"
    reply = [scored([None, -1.0, -2.0]), scored([None, -1, -2, -3])]
    assert engine_rows(reply, sequences) == [[-1.0, -2.0], [-1.0, -2.0, -3.0]]
    with pytest.raises(WeightSyncError, match="scored 1 of 2 probes"):
        engine_rows(reply[:1], sequences)
    with pytest.raises(WeightSyncError, match="scored 2 of 3 tokens"):
        engine_rows([reply[0], reply[0]], sequences)


def test_the_largest_gap_is_found_and_nan_counts_as_infinite():
    trainer = [[-1.0, -2.0], [-3.0, -4.0]]
    gap = largest_gap("rollout engine 0", trainer, [[-1.0, -2.00001], [-3.0, -4.5]])
    assert gap.sequence == 1 and gap.position == 2 and gap.gap == pytest.approx(0.5)
    assert largest_gap("e", trainer, trainer).gap == 0.0
    assert math.isinf(largest_gap("e", trainer, [[-1.0, math.nan], [-3.0, -4.0]]).gap)


def test_the_error_names_engine_version_gap_and_causes():
    failed = [EngineGap("rollout engine 1 (rank 3)", 4.2, 2, 17)]
    error = parity_error(5, failed, 1e-3, "290 tensors, 538.0 MB by broadcast, 0 staged")
    assert isinstance(error, WeightSyncError)  # fails the sync like a failed broadcast
    text = str(error)
    assert "weight sync to version 5 failed its parity probe" in text
    assert "rollout engine 1 (rank 3): largest |trainer - engine| logprob 4.2" in text
    assert "290 tensors" in text and "not routed" in text and "LoRA merge" in text
    assert "\n" not in text  # the job's end record and console carry an error's first line
