"""Activation recomputation (``trainer.recompute``): Megatron-core's, recomputing in the context
its forward ran in.

'selective' recomputes each layer's core attention in the backward pass (Megatron's
``recompute_modules=["core_attn"]``), so what the trainer's attention makes inside it is not
kept: keys and values repeated for grouped queries and the fused attention's own copies (little:
the checkpoint keeps q, k and v instead), and under context parallelism the scores over the
gathered keys (much). 'full' keeps only each layer's input and recomputes the whole layer
(``recompute_method="uniform"``, one layer per checkpoint).

A recomputation runs in the backward pass, but the forward it repeats read more than its
inputs: the micro-batch's token positions (``trainer/attention.py``) and the engine's routing
to replay (``trainer/moe.py``), context variables set once per forward. At backward time the
context holds another micro-batch's (the pipeline schedule runs later micro-batches' forwards
before earlier ones' backwards) or nothing (on GPUs autograd runs the backward in threads of
its own). So every checkpoint keeps a copy of its forward's context and recomputes in it.
"""

from __future__ import annotations

import contextvars
from typing import Any

import torch

_RECOMPUTING: contextvars.ContextVar[bool] = contextvars.ContextVar("recomputing", default=False)


def recompute_config(recompute: str) -> dict[str, Any]:
    """Megatron's TransformerConfig fields for ``trainer.recompute``."""
    if recompute == "selective":
        return {"recompute_granularity": "selective", "recompute_modules": ["core_attn"]}
    if recompute == "full":
        return {
            "recompute_granularity": "full",
            "recompute_method": "uniform",
            "recompute_num_layers": 1,
        }
    return {}


def recomputing() -> bool:
    """Whether the code running is a checkpoint's recomputation in the backward pass (which must
    not count what the forward counted, e.g. routing statistics)."""
    return _RECOMPUTING.get()


def _in_context(context: contextvars.Context, function: Any, *inputs: Any) -> Any:
    def recompute() -> Any:
        _RECOMPUTING.set(True)  # in the copy only
        return function(*inputs)

    return context.run(recompute)


def install() -> None:
    """Make Megatron's ``tensor_parallel.checkpoint`` (every layer and core-attention checkpoint
    calls it through the package) recompute in its forward's context. Idempotent."""
    from megatron.core import tensor_parallel

    megatron_checkpoint = tensor_parallel.checkpoint
    if getattr(megatron_checkpoint, "keeps_context", False):
        return

    def checkpoint(function: Any, distribute_saved_activations: bool, *args: Any) -> Any:
        context, calls = contextvars.copy_context(), []

        def run(*inputs: Any) -> Any:
            calls.append(None)
            if len(calls) == 1:  # the forward, in the context it has
                return function(*inputs)
            return _in_context(context, function, *inputs)

        return megatron_checkpoint(run, distribute_saved_activations, *args)

    checkpoint.keeps_context = True
    tensor_parallel.checkpoint = checkpoint


def inputs_need_grad(model: Any) -> None:
    """Make the first stage's embedding output require grad (training forwards only).

    Megatron's checkpoint is reentrant: it backpropagates through a recomputed layer only when
    one of the layer's inputs requires grad. Under LoRA the embedding is frozen, so without this
    the first layer's adapters would get no gradient under full recomputation."""
    embedding = getattr(model, "embedding", None)
    if embedding is None:  # a later pipeline stage: its input comes with requires_grad
        return

    def hook(module: Any, args: Any, output: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and not output.requires_grad:
            output.requires_grad_(True)
        return output

    embedding.register_forward_hook(hook)
