"""The parity probe after every weight sync (``weight_sync.parity_probe``; decisions in
``weights/parity.py``): rank 0 has the trainer score a fixed probe with the weights it just
sent, and every synced rollout engine score the same tokens, before the engines serve the
version. A gap beyond the tolerance raises ``ParityError`` inside ``WeightSync.sync``, which
then keeps the rollout model out of routing, as after a failed broadcast, and the job ends.

Decoupled engines are probed inside the sync, before its commit. Colocated engines (``split``,
``defer``) hold no KV cache during their sync turn, so the trainer scores the probe in the sync
(its parameters are still on the device) and the engines right after their KV cache is back,
before the batch's first generation (``check_engines``, from ``rl/colocated.py``); the version
is committed, and the rollout model routable for the gateway's clients, only once they pass.

A disaggregated pair's prefill half scores the probe alone (SGLang's partner-less bootstrap).
Its decode half computes no prompt logprobs, so it generates: the pair continues the start of
the first probe sequence greedily for ``DECODE_TOKENS`` tokens (the prefill half computes the
prompt's KV cache and the first token, the decode half the others), and the trainer scores the
prompt and those tokens in a second forward, after the engines answer.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from relax_launch.console import operator_log
from relax_launch.inference.disaggregation import ALONE, PrefillTarget, bootstrapped
from relax_launch.inference.engine import EngineControl, EngineHandle, result
from relax_launch.inference.policy_adapter import adapter_name
from relax_launch.models.build import ensure_model
from relax_launch.models.registry import is_vision_language
from relax_launch.runtime.image_probe import ImageProbe, image_probe
from relax_launch.trainer.batch import TokenBatch
from relax_launch.weights.parity import (
    EngineGap,
    decode_request,
    decoded,
    engine_request,
    engine_rows,
    largest_gap,
    parity_error,
    probe_sequences,
    tolerance_for,
)
from relax_launch.weights.update_session import EngineTarget

if TYPE_CHECKING:
    from relax_launch.config.job import JobConfig
    from relax_launch.placement.plan import PlacementPlan

TrainerLogprobs = Callable[[TokenBatch], list[list[float]]]
DECODE_TOKENS = 8  # what a decode half generates for the probe (the first by its prefill half)


@dataclass(frozen=True)
class ProbeTarget:
    """A synced engine; its disaggregated half, and a decode half's prefill partner (a decode
    half without one known is not probed)."""

    engine: EngineTarget
    half: str | None = None
    prefill: PrefillTarget | None = None


@dataclass(frozen=True)
class Decoding:
    """A decode half's probe in flight: its prompt, and the pair's two replies to come."""

    engine: EngineTarget
    prompt: list[int]
    decode: Future
    prefill: Future


@dataclass
class Pending:
    """A synced version whose engines are still to score the probe (colocated)."""

    version: int
    trainer_rows: list[list[float]]
    targets: list[ProbeTarget]
    synced: str
    seconds: float


class ParityProbe:
    """Scores the probe on the trainer and on every synced engine, after each sync."""

    def __init__(
        self,
        sequences: list[list[int]],
        tolerance: float,
        trainer_logprobs: TrainerLogprobs,
        *,
        colocated: bool,
        adapters: bool,
        timeout_s: float,
        image: ImageProbe | None = None,
    ) -> None:
        self.sequences, self.tolerance = sequences, tolerance
        self.image = image  # a vision-language policy's image sequence (runtime/image_probe.py)
        self.trainer_logprobs = trainer_logprobs  # the trainer's forward of the RL step
        self.colocated, self.adapters, self.timeout_s = colocated, adapters, timeout_s
        self.pending: Pending | None = None
        self.last: dict[str, float] = {}  # the last probe's metrics
        self.trainer_s = 0.0  # the trainer's half of the last probe

    def after_sync(
        self,
        version: int,
        targets: list[ProbeTarget],
        reports: list[dict[str, Any]],
        control: EngineControl,
    ) -> None:
        """The trainer's half now; the engines' at the same time (they are other processes)
        unless colocated, where they score later (``check_engines``); then the decode halves'
        generations, scored by the trainer."""
        began = time.perf_counter()
        scoring = [] if self.colocated else self._submit(version, targets, control)
        decoding = [] if self.colocated else self._submit_decodes(version, targets, control)
        rows = self.trainer_logprobs(self._trainer_batch())
        self.trainer_s = time.perf_counter() - began
        pending = Pending(version, rows, targets, synced_summary(reports), 0.0)
        if self.colocated:
            self.pending = replace(pending, seconds=time.perf_counter() - began)
        else:
            self._judge(pending, scoring, began, decoding)

    def check_engines(self, control: EngineControl) -> None:
        """Every pending engine scores the probe; ``ParityError`` names those beyond the
        tolerance. Nothing pending: nothing to do."""
        pending, self.pending = self.pending, None
        if pending is not None:
            began = time.perf_counter() - pending.seconds  # the trainer's half counts too
            self._judge(pending, self._submit(pending.version, pending.targets, control), began)

    def _trainer_batch(self) -> TokenBatch:
        """The text sequences and, for a vision-language policy, the image sequence as many
        times (the batch then splits over DP ranks and micro-batches as the text alone does)."""
        text = TokenBatch.next_token(self.sequences, [1] * len(self.sequences))
        if self.image is None:
            return text
        count = len(self.sequences)
        image = TokenBatch.next_token([self.image.ids] * count, [1] * count)
        return TokenBatch.join([text, replace(image, images=(self.image.images,) * count)])

    def _submit(
        self, version: int, targets: list[ProbeTarget], control: EngineControl
    ) -> list[tuple[EngineTarget, Future, Future | None]]:
        """Every engine's scoring requests (text; the image sequence), started now (decode
        halves generate instead)."""
        started = []
        for t in (t for t in targets if t.half != "decode"):
            body = self._body(version, t.half)
            text = control.submit(t.engine.url, "/generate", body, self.timeout_s)
            image = None
            if self.image is not None:
                extra = {k: v for k, v in body.items() if k == "lora_path"}
                image_body = self.image.request(extra)
                image = control.submit(t.engine.url, "/generate", image_body, self.timeout_s)
            started.append((t.engine, text, image))
        return started

    def _submit_decodes(
        self, version: int, targets: list[ProbeTarget], control: EngineControl
    ) -> list[Decoding]:
        """Every decode half's generation with its prefill partner, started now."""
        prompt = self.sequences[0][: max(1, len(self.sequences[0]) - DECODE_TOKENS)]
        extra = {"lora_path": adapter_name(version)} if self.adapters else {}
        started = []
        for t in (t for t in targets if t.half == "decode" and t.prefill is not None):
            body = bootstrapped(decode_request(prompt, DECODE_TOKENS, extra), t.prefill)
            prefill = control.submit(t.prefill.url, "/generate", body, self.timeout_s)
            decode = control.submit(t.engine.url, "/generate", body, self.timeout_s)
            started.append(Decoding(t.engine, prompt, decode, prefill))
        return started

    def _decode_gap(self, decoding: Decoding) -> EngineGap:
        """A decode half's generated tokens: its logprobs against the trainer's forward of the
        prompt and those tokens (the other probe sequences fill the trainer's batch)."""
        result(decoding.prefill, self.timeout_s)  # the prefill half's own reply: its errors
        tokens, engine_row = decoded(result(decoding.decode, self.timeout_s))
        engine, prompt = decoding.engine, decoding.prompt
        sequences = [prompt + tokens, *self.sequences[1:]]
        batch = TokenBatch.next_token(sequences, [1] * len(sequences))
        row = self.trainer_logprobs(batch)[0]
        trainer_row = row[len(prompt) - 1 : len(prompt) - 1 + len(tokens)]
        gap = largest_gap(f"{engine.label}, decode half", [trainer_row], [engine_row])
        return replace(gap, position=gap.position + len(prompt) - 1)

    def _judge(
        self,
        pending: Pending,
        scoring: list[tuple[EngineTarget, Future, Future | None]],
        began: float,
        decoding: list[Decoding] = (),
    ) -> None:
        """The engines' replies against the trainer's rows; the probe's metrics; the error
        naming every engine beyond the tolerance."""
        count, wait = len(self.sequences), self.timeout_s
        replies = [
            (t.label, result(text, wait), image and result(image, wait))
            for t, text, image in scoring
        ]
        text_rows = pending.trainer_rows[:count]
        gaps = [
            largest_gap(label, text_rows, engine_rows(reply, self.sequences))
            for label, reply, _ in replies
        ]
        image_gaps = []
        if self.image is not None:  # the image sequence's first row (the others: the same)
            image_row = pending.trainer_rows[count]
            image_gaps = [self.image.gap(label, image_row, reply) for label, _, reply in replies]
        gaps += image_gaps + [self._decode_gap(d) for d in decoding]
        self.last = {
            "sync/parity_gap": max((g.gap for g in gaps), default=0.0),
            "sync/probe_s": time.perf_counter() - began,
            "sync/probe_trainer_s": self.trainer_s,  # its first half, the engines' alongside
            "sync/probe_decode_halves": float(len(decoding)),
        }
        if image_gaps:
            self.last["sync/parity_gap_image"] = max(g.gap for g in image_gaps)
        failed = [g for g in gaps if not g.gap <= self.tolerance]
        if failed:
            raise parity_error(pending.version, failed, self.tolerance, pending.synced)

    def _body(self, version: int, half: str | None) -> dict[str, Any]:
        extra: dict[str, Any] = dict(ALONE) if half == "prefill" else {}
        if self.adapters:  # the adapter this sync loaded, not the base weights
            extra["lora_path"] = adapter_name(version)
        return engine_request(self.sequences, extra)


def probe_targets(
    targets: list[EngineTarget], halves: list[str | None], engines: list[EngineHandle]
) -> list[ProbeTarget]:
    """The synced engines as the probe reaches them: a decode half with its prefill partner,
    found among the rollout model's ``engines`` by URL and id."""
    by_url = {e.url: e for e in engines}
    by_id = {e.engine_id: e for e in engines}
    out = []
    for target, half in zip(targets, halves, strict=True):
        handle = by_url.get(target.url)
        partner = by_id.get(handle.prefill_id) if handle and handle.prefill_id else None
        prefill = None
        if half == "decode" and partner is not None and partner.bootstrap_port is not None:
            prefill = PrefillTarget.at(partner.engine_id, partner.url, partner.bootstrap_port)
        out.append(ProbeTarget(target, half, prefill))
    return out


def synced_summary(reports: list[dict[str, Any]]) -> str:
    """What a sync moved, for the probe's error: transport, tensors, bytes, staged tensors."""
    if not reports:
        return "nothing (no report)"
    transport = reports[0].get("transport", "?")
    tensors = sum(r.get("num_tensors", 0) for r in reports)
    nbytes = sum(r.get("num_bytes", 0) for r in reports)
    staged = sum(e.get("staged", 0) for r in reports for e in r.get("receivers", ()))
    repaired = " (sent twice)" if any(r.get("repaired") for r in reports) else ""
    return (
        f"{tensors} tensors, {nbytes / 1e6:.1f} MB by {transport}{repaired}, "
        f"{staged} staged for load_weights"
    )


def probe_for(
    job: JobConfig, plan: PlacementPlan, trainer_logprobs: TrainerLogprobs, *, adapters: bool
) -> ParityProbe | None:
    """The job's probe, or None (no rollout engines, turned off, or a precision without a
    measured tolerance: said once). ``adapters``: the engines serve the policy as an adapter."""
    section = job.weight_sync.parity_probe
    if not plan.engines_of("rollout") or not section.enabled:
        return None
    device = job.cluster.device
    tolerance = tolerance_for(section, job.trainer.dtype, job.engine_dtype("rollout"), device)
    if tolerance is None:
        operator_log().warning(
            f"relax-launch: weight-sync parity probe off: trainer {job.trainer.dtype} and "
            f"rollout engines {job.engine_dtype('rollout')} have no measured tolerance on "
            f"{device}; set "
            "weight_sync.parity_probe.tolerance to turn it on"
        )
        return None
    from transformers import AutoTokenizer  # rank 0 only, once

    model = ensure_model(job.rollout_model())
    tokenizer = AutoTokenizer.from_pretrained(str(model))
    count = plan.trainer.dp_size * job.trainer.sequences_per_micro_batch
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    return ParityProbe(
        probe_sequences(encode, count, section.tokens),
        tolerance,
        trainer_logprobs,
        colocated=plan.mode in ("split", "defer"),
        adapters=adapters,
        timeout_s=job.weight_sync.timeout_s,
        image=image_probe(model) if is_vision_language(job.trainer.model) else None,
    )
