"""Generation, teacher scoring and judging through the controller's engine clients (every
request of a phase concurrent, on the job's one event loop; no hop through the gateway).

Every request carries a routing key: a prompt's group, for the samples of one prompt and their
teacher scoring. Under ``gateway.routing_policy: affinity`` a group then shares an engine (and
its prompt's prefix cache); under ``round_robin`` the keys are ignored.
"""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any, TypeVar

from relax_launch.rl.data import Prompt
from relax_launch.rl.samples import Sample
from relax_launch.rl.vision_prompts import text_of
from relax_launch.rl.vision_scoring import check_teacher_ids, teachable, teacher_inputs

if TYPE_CHECKING:  # rank 0's engine clients; the CLI's input check imports this module
    import torch

    from relax_launch.inference.inprocess import EngineClients
    from relax_launch.trainer.model_shape import ModelShape

T = TypeVar("T")


def _gather(engines: EngineClients, role: str, calls: list[tuple[str, dict, str | None]]) -> list:
    """Every call's reply, in order; the first failure cancels the rest and is raised."""
    client = engines.client(role)
    requests = [client.request(path, body, affinity_key=key) for path, body, key in calls]
    return engines.run(all_or_none(requests), what=f"{len(calls)} {role} requests")


async def all_or_none(coroutines: list[Coroutine[Any, Any, T]]) -> list[T]:
    """Every coroutine's result, in order, run concurrently; the first failure cancels the
    rest and is raised."""
    tasks = [asyncio.ensure_future(c) for c in coroutines]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for task in tasks:  # a no-op for the finished ones
            task.cancel()


def generate(
    engines: EngineClients,
    prompts: list[tuple[Prompt, list[int]]],
    *,
    n: int,
    temperature: float,
    max_tokens: int,
    routing: ModelShape | None = None,
) -> list[Sample]:
    """``n`` samples per (prompt, prompt token ids), in prompt order; with ``routing`` (the
    policy's shape, routing replay), each with the experts its tokens were routed to."""
    sampling = {"temperature": temperature, "max_new_tokens": max_tokens}
    body = {"return_logprob": True, "sampling_params": sampling}
    if routing is not None:
        body["return_routed_experts"] = True
    calls = [
        ("/generate", {**prompt_inputs(prompt, ids), **body}, f"g{g}")
        for g, (prompt, ids) in enumerate(prompts)
        for _ in range(n)
    ]
    replies = _gather(engines, "rollout", calls)
    samples = [reply_sample(i // n, *prompts[i // n], reply) for i, reply in enumerate(replies)]
    if routing is not None:
        for sample, reply in zip(samples, replies, strict=True):
            sample.routed_experts = routed_experts(sample, reply["meta_info"], routing)
    return samples


def prompt_inputs(prompt: Prompt, ids: list[int]) -> dict[str, Any]:
    """A ``/generate`` body's prompt: its token ids, or for a prompt with images the chat
    template's ids (one placeholder per image, which the engine expands) and the images."""
    if prompt.images is None:
        return {"input_ids": ids}
    return {
        "input_ids": list(prompt.images.engine_ids),
        "image_data": list(prompt.images.urls),
        "return_prompt_token_ids": True,  # checked against the trainer's (``reply_sample``)
    }


def routed_experts(sample: Sample, meta: dict[str, Any], shape: ModelShape) -> torch.Tensor:
    """The experts each MoE layer routed the sample's input tokens to (every token but the
    last, which the engine never computed), int32 [tokens - 1, MoE layers, top-k], from the
    engine's reply (SGLang's ``routed_experts``: base64 int32 [tokens - 1, layers, top-k])."""
    import torch

    raw = meta.get("routed_experts")
    if raw is None:
        raise RuntimeError(
            "the rollout engine returned no routed experts: it was started without "
            "--enable-return-routed-experts (algorithm.routing_replay sets it)"
        )
    flat = torch.frombuffer(bytearray(base64.b64decode(raw)), dtype=torch.int32)
    inputs = len(sample.prompt_ids) + len(sample.response_ids) - 1
    width = shape.num_layers * shape.moe.topk
    if flat.numel() != inputs * width:
        raise RuntimeError(
            f"the rollout engine routed {flat.numel() // width} tokens of a {inputs + 1}-token "
            "sample; routing replay needs every input token's experts"
        )
    every_layer = flat.view(inputs, shape.num_layers, shape.moe.topk)
    return every_layer[:, list(shape.moe.layers)].contiguous()


def reply_sample(group: int, prompt: Prompt, ids: list[int], reply: dict[str, Any]) -> Sample:
    """The sample of one engine reply to ``prompt`` (whose token ids are ``ids``)."""
    meta = reply["meta_info"]
    if prompt.images is not None and reply.get("prompt_token_ids") != ids:
        engine = reply.get("prompt_token_ids")
        raise RuntimeError(
            f"the rollout engine's token ids of prompt {prompt.index} (with its images expanded: "
            f"{'none returned' if engine is None else f'{len(engine)} tokens'}) are not the "
            f"trainer's ({len(ids)} tokens): their processors differ (the engine's must be the "
            "model directory's)"
        )
    return Sample(
        group=group,
        question=text_of(prompt.messages[-1]["content"]),
        label=prompt.label,
        prompt_ids=list(ids),
        response_ids=list(reply["output_ids"]),
        logprobs=[float(lp) for lp, *_ in meta["output_token_logprobs"]],
        text=reply["text"],
        weight_version=str(meta.get("weight_version")),
        finish_reason=(meta.get("finish_reason") or {}).get("type", ""),
        data_source=prompt.data_source,
        meta=prompt.meta,
        images=None if prompt.images is None else prompt.images.rows,
        prompt_images=prompt.images,
    )


def weight_version_of(meta: dict[str, Any]) -> int | None:
    """The weight version an engine reply says it was generated with (None before the first
    sync names one: SGLang's "default")."""
    version = str(meta.get("weight_version"))
    return int(version) if version.lstrip("-").isdigit() else None


def score_with_teacher(engines: EngineClients, samples: list[Sample], tokenizer: Any) -> None:
    """Write the teacher's logprob of every sampled response token onto each sample, each
    scored by the teacher model whose route_keys name its data source (else the default); a
    prompt's images go with it (``rl/vision_scoring.py``, ``tokenizer`` the policy's)."""
    route_keys = engines.client("teacher").manager.routing.route_key_map
    calls = []
    scored_samples = [s for s in samples if teachable(s, tokenizer)]
    for s in scored_samples:
        body = {
            **teacher_inputs(s),
            "return_logprob": True,
            # SGLang leaves the first returned position without a logprob: start one early
            "logprob_start_len": len(s.prompt_ids) - 1,
            "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
        }
        if s.data_source in route_keys:  # the teacher of its data source, else the default
            body["route_key"] = s.data_source
        calls.append(("/generate", body, f"g{s.group}"))
    replies = _gather(engines, "teacher", calls) if calls else []
    for s in samples:
        s.teacher_logprobs = []
    for s, reply in zip(scored_samples, replies, strict=True):
        check_teacher_ids(s, reply)
        scored = [float(lp) for lp, *_ in reply["meta_info"]["input_token_logprobs"][1:]]
        if len(scored) != len(s.response_ids):
            raise RuntimeError(
                f"teacher returned {len(scored)} logprobs for a {len(s.response_ids)}-token "
                "response; check that teacher and rollout share a tokenizer"
            )
        s.teacher_logprobs = scored


def judge(
    engines: EngineClients,
    conversations: list[list[dict[str, Any]]],
    regex: str,
    source: str = "",
    *,
    max_tokens: int,
) -> list[str]:
    """The GenRM judge's reply to each conversation (the gateway's judge form), greedy and
    constrained to ``regex`` by the engine's grammar backend, from the genrm model whose
    route_keys name the reward source ``source`` (else the role's default model)."""
    sampling = {"temperature": 0.0, "max_new_tokens": max_tokens, "regex": regex}
    route_keys = engines.client("genrm").manager.routing.route_key_map
    chosen = {"route_key": source} if source in route_keys else {}
    calls = [
        ("/generate", {"messages": c, "sampling_params": sampling, **chosen}, f"j{i}")
        for i, c in enumerate(conversations)
    ]
    return [r["response"] for r in _gather(engines, "genrm", calls)]
