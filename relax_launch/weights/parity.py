"""The parity probe's decisions (``runtime/parity_probe.py`` runs it after every weight sync):
the fixed probe sequences, the engine request that scores them and its reply read back, the
largest trainer-vs-engine logprob gap, the tolerance of the precisions in use, and the error
that fails the sync naming the engine, the version, the gap and the likely causes.

The engines score the probe as the teacher scores samples (``input_token_logprobs`` of one
prefill, greedy, one new token); the trainer with the forward the RL step uses for its own
logprobs. Same weights, same precision: the two agree to float32 rounding.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from relax_launch.weights.config import ParityProbeConfig
from relax_launch.weights.update_session import WeightSyncError

# Measured on the CPU jobs (float32 trainer and engines, SmolLM2-135M and the tiny test models):
# the probe's largest gap stays below 2e-5 (docs/benchmarks.md, "Parity probe"); an engine
# holding other weights misses by whole nats. 1e-3 leaves 50x room for kernels and TP layouts.
FP32_TOLERANCE = 1e-3
# bfloat16 on either side (both, or a float32 trainer with bf16 engines), measured on the CPU
# with SmolLM2-135M over 5 syncs each: largest gaps 0.15-0.43 (both bf16) and 0.21-0.46
# (mixed); issue 50's broken LoRA merge missed by 13-18. GPU kernels are not measured yet.
BF16_TOLERANCE = 2.0
MEASURED = {"float32", "bfloat16"}
# The probe's text: fixed, ordinary prose (a model's logprobs of random ids are extreme, and
# extreme logprobs are where float32 rounding grows), cut into sequences at distinct offsets.
PROBE_TEXT = (
    "The river rose slowly through the night, and by morning the low fields along the valley "
    "were under water. Farmers moved their animals to higher ground while the children watched "
    "from the bridge. Twelve plus thirty is forty-two; seven times eight is fifty-six. In the "
    "afternoon the rain stopped, the clouds broke apart, and the sun came out over the hills. "
    "People walked down to the river to see how far it had risen and talked about the flood of "
    "years ago, when the old mill was carried away and the road to town was closed for a week."
)


def tolerance_for(
    config: ParityProbeConfig, trainer_dtype: str, engine_dtype: str, device: str
) -> float | None:
    """The gap a probe token may have: the configured one, else the measured bound of the
    precisions in use (float32 both sides; bfloat16 on either side, measured on the CPU only);
    None (the probe is off) for precisions without a measured bound on ``device`` (float16;
    bfloat16 on a GPU, whose kernels reduce in other orders), rather than a guess."""
    if not config.enabled:
        return None
    if config.tolerance is not None:
        return config.tolerance
    if trainer_dtype == engine_dtype == "float32":
        return FP32_TOLERANCE
    measured = {trainer_dtype, engine_dtype} <= MEASURED and device == "cpu"
    return BF16_TOLERANCE if measured else None


def probe_sequences(encode: Callable[[str], list[int]], count: int, tokens: int) -> list[list[int]]:
    """``count`` sequences of ``tokens // count`` token ids (at least 8) of the probe text, each
    from its own offset (the text repeated as often as needed): the same on every call."""
    ids = encode(PROBE_TEXT)
    length = max(8, tokens // count)
    stride = max(1, len(ids) // (count + 1))
    longest = stride * (count - 1) + length
    ids = (ids * (longest // len(ids) + 1))[:longest]
    return [ids[i * stride : i * stride + length] for i in range(count)]


def engine_request(sequences: Sequence[Sequence[int]], extra: dict[str, Any]) -> dict[str, Any]:
    """One ``/generate`` body scoring every probe sequence in a batch (``extra``: a
    disaggregated half's bootstrap address, a served adapter's name)."""
    return {
        "input_ids": [list(s) for s in sequences],
        "return_logprob": True,
        "logprob_start_len": 0,  # SGLang leaves position 0 without a logprob
        "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
        **extra,
    }


def decode_request(prompt: Sequence[int], tokens: int, extra: dict[str, Any]) -> dict[str, Any]:
    """One ``/generate`` body continuing ``prompt`` greedily for ``tokens`` tokens, with their
    logprobs (a disaggregated pair's decode half computes no prompt logprobs)."""
    sampling = {"max_new_tokens": tokens, "temperature": 0.0, "ignore_eos": True}
    return {"input_ids": list(prompt), "return_logprob": True, "sampling_params": sampling, **extra}


def decoded(reply: Any) -> tuple[list[int], list[float]]:
    """The generated token ids and their logprobs from an engine's reply to one prompt."""
    reply = reply[0] if isinstance(reply, list) else reply
    entries = reply["meta_info"]["output_token_logprobs"]
    if not entries:
        raise WeightSyncError("the decode half generated no token for the probe")
    return [int(e[1]) for e in entries], [float(e[0]) for e in entries]


def engine_rows(reply: Any, sequences: Sequence[Sequence[int]]) -> list[list[float]]:
    """Each sequence's logprobs of ``tokens[1:]`` from the engine's batched reply."""
    replies = reply if isinstance(reply, list) else [reply]
    if len(replies) != len(sequences):
        raise WeightSyncError(f"the engine scored {len(replies)} of {len(sequences)} probes")
    rows = [[float(lp) for lp, *_ in r["meta_info"]["input_token_logprobs"][1:]] for r in replies]
    for row, tokens in zip(rows, sequences, strict=True):
        if len(row) != len(tokens) - 1:
            raise WeightSyncError(f"the engine scored {len(row)} of {len(tokens) - 1} tokens")
    return rows


@dataclass(frozen=True)
class EngineGap:
    """One engine's largest |trainer - engine| logprob over the probe, and where it was."""

    label: str
    gap: float
    sequence: int
    position: int


def largest_gap(
    label: str, trainer: Sequence[Sequence[float]], engine: Sequence[Sequence[float]]
) -> EngineGap:
    """The engine's worst probe token (a NaN on either side counts as an infinite gap)."""
    worst = EngineGap(label, 0.0, 0, 0)
    for s, (ours, theirs) in enumerate(zip(trainer, engine, strict=True)):
        for p, (a, b) in enumerate(zip(ours, theirs, strict=True)):
            gap = abs(a - b)
            gap = float("inf") if gap != gap else gap
            if gap > worst.gap:
                worst = EngineGap(label, gap, s, p + 1)
    return worst


class ParityError(WeightSyncError):
    """A synced engine scores the probe away from the trainer: it holds other weights."""


def parity_error(
    version: int, failed: list[EngineGap], tolerance: float, synced: str
) -> ParityError:
    """The error that fails the sync, on one line (the job's end record and console carry an
    error's first line): every failing engine with its gap, what was synced, the likely
    causes."""
    engines = "; ".join(
        f"{g.label}: largest |trainer - engine| logprob {g.gap:.3g} (probe sequence "
        f"{g.sequence}, token {g.position})"
        for g in failed
    )
    return ParityError(
        f"weight sync to version {version} failed its parity probe (tolerance {tolerance:g}, "
        f"weight_sync.parity_probe): {engines}. The engine is not routed and nothing was "
        f"trained on it; the checkpoints written so far are intact. What was synced: {synced}. "
        "Likely causes: the engine holds other weights than the trainer's: a LoRA merge "
        "(trainer.lora) that did not reach the engine, a tensor in the wrong layout (fused "
        "qkv/gate_up, TP cuts, stacked experts), or a dtype change on the way."
    )
