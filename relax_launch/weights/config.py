"""Config section owned by weight sync (trainer -> rollout broadcast)."""

from __future__ import annotations

from pydantic import Field

from relax_launch.config.section import Section


class ParityProbeConfig(Section):
    """Fixed sequences scored by the trainer and every rollout engine after each sync."""

    enabled: bool = Field(
        True,
        description="Probe every sync; a gap beyond the tolerance fails the sync (the engines "
        "stay out of routing) and ends the job naming the engine, the version and the gap.",
    )
    tolerance: float | None = Field(
        None,
        gt=0,
        description="Largest |trainer - engine| logprob of a probe token that passes. Unset: "
        "1e-3 when trainer and rollout engines both compute in float32 (measured gaps stay "
        "below 2e-5); 2.0 with bfloat16 on either side (measured on the CPU: 0.15-0.46; a "
        "broken LoRA merge misses by 13-18), on the CPU only; float16, and bfloat16 on a GPU, have "
        "no measured bound, so the probe is off there (said once) unless this is set.",
    )
    tokens: int = Field(
        64,
        ge=16,
        description="Probe tokens in all, spread over the smallest batch the trainer takes "
        "(one micro-batch per data-parallel rank; 8 tokens a sequence at least). A wrong "
        "weight moves every token's logprob, so a few suffice; each costs a forward on both "
        "sides.",
    )


class WeightSyncConfig(Section):
    """How trained weights reach the rollout engines."""

    timeout_s: float = Field(
        300.0,
        gt=0,
        description="Deadline of one send of the weights to every engine; past it the send "
        "fails, the engines stay out of routing and the same version is sent once more (a "
        "second failure ends the job).",
    )
    parity_probe: ParityProbeConfig = Field(
        default_factory=ParityProbeConfig,
        description="Trainer-vs-engine logprob parity checked after every sync.",
    )
