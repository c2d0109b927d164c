"""Critic: one rank's share of PPO's value model, on the trainer's own ranks and layout.

The value model is Megatron-core's GPT built from a Hugging Face checkpoint like the policy,
its language-model head replaced by ``ValueHead``: a Linear(hidden, 1) replicated on every
tensor-parallel rank. The head sees the whole hidden state: the decoder's output is complete on
every TP rank (the row-parallel layers' outputs are all-reduced; sequence parallelism, which
would split it, is refused), and each TP rank's identical loss gives the replicated residual
stream the whole gradient, as Megatron's own replicated layers do. The GPT's forward without
labels returns the head's output as [batch, tokens, 1]: one value per input position, aligned
with the policy's logprobs (position t scores the state before token t + 1).

A critic batch travels as a ``TokenBatch`` (the shard channel's format): ``token_weights``
carry the returns and ``old_logprobs`` the values before the update
(``trainer/critic_loss.py::critic_batch``).
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

import torch

from relax_launch import platform
from relax_launch.trainer import micro_batches
from relax_launch.trainer.batch import TokenBatch
from relax_launch.trainer.config import TrainerConfig
from relax_launch.trainer.critic_loss import value_loss
from relax_launch.trainer.forward import loss_layout, step_inputs
from relax_launch.trainer.model import (
    build_gpt_module,
    build_optimizer,
    load_hf_checkpoint,
    read_shape,
    wrap_ddp,
)
from relax_launch.trainer.offload import kept_on
from relax_launch.trainer.step_metrics import dp_sums
from relax_launch.trainer.trainer import save_durably

# a critic step's reply: how long it took on the critic's rank (seconds, its own clock: a
# duration, so that rank 0 compares it with its own without the machines' clocks meeting)
STEP_SECONDS = "critic/step_seconds"
# on ranks of its own: the job's event tickets taken just before and after the step (the store
# orders them with the policy's, clock-free: ``rl/critic_step.py::critic_metrics``)
STEP_TICKETS = ("critic/step_began", "critic/step_ended")


class ValueHead(torch.nn.Module):
    """The value model's head in place of the GPT's output layer: ``(hidden [s, b, h], ...) ->
    (values [s, b, 1], None)``, the output layer's call signature (the tied embedding weight
    Megatron passes is not used). Weights from N(0, 1/(hidden+1)^2) drawn with ``seed`` (the
    same on every TP rank: the head is replicated), bias 0."""

    def __init__(self, hidden: int, dtype: torch.dtype, seed: int) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        weight = torch.randn(1, hidden, generator=generator) / (hidden + 1)
        self.weight = torch.nn.Parameter(weight.to(dtype))
        self.bias = torch.nn.Parameter(torch.zeros(1, dtype=dtype))

    def forward(self, hidden: torch.Tensor, **_: Any) -> tuple[torch.Tensor, None]:
        return torch.nn.functional.linear(hidden, self.weight, self.bias), None


class Critic:
    """The value model on this trainer rank: build, score values, train, save and load."""

    def __init__(
        self,
        *,
        section: TrainerConfig,
        model_dir: Path,
        pgc: Any,
        device: platform.Device,
        tp_field: str = "trainer.tp_size",
    ) -> None:
        """``tp_field``: the setting that sized its tensor parallelism (``critic.tp_size`` on
        ranks of its own), named when a checkpoint's shards do not match it."""
        self.section, self.pgc, self.tp_field = section, pgc, tp_field
        self.shape = read_shape(model_dir)
        if self.shape.moe is not None:
            raise ValueError(
                f"critic.model {section.model} is a mixture-of-experts model: the value model "
                "is dense-only for now; set critic.model to a dense model"
            )
        self.torch_device = platform.torch_device(device, int(os.environ.get("LOCAL_RANK", "0")))
        # built and loaded in host memory: the policy's vocab-sized head is replaced before the
        # model reaches the device (the memory plan counts the value head only)
        module = build_gpt_module(self.shape, section, pgc, "cpu", model_dir)
        load_hf_checkpoint(module, model_dir, self.shape, pgc)
        dtype = next(module.parameters()).dtype
        module.output_layer = ValueHead(self.shape.hidden_size, dtype, section.seed)
        module.to(self.torch_device)
        self.model = wrap_ddp(module, section, pgc)
        self.optimizer = build_optimizer(self.model, section, pgc)
        self.step = 0

    @torch.no_grad()
    def values(self, shard: TokenBatch) -> list[list[float]]:
        """Per-token values of ``tokens[:-1]`` positions (one per target, like logprobs) for
        this DP rank's ``shard``, in eval mode."""
        batches = self._micro_batches(shard)
        self.model.eval()
        try:
            outputs = self._schedule(batches, forward_only=True, clip=None)
        finally:
            self.model.train()
        rows: list[list[float]] = [[] for _ in shard.tokens]
        for batch, output in zip(batches, outputs, strict=True):
            for i, row in zip(batch["order"].tolist(), output["values"].tolist(), strict=False):
                rows[i] = row[: len(shard.tokens[i]) - 1]
        return rows

    def train_step(self, shard: TokenBatch, clip: float | None) -> dict[str, float]:
        """One optimizer step of the clipped value loss on this DP rank's ``shard`` (returns in
        ``token_weights``, old values in ``old_logprobs``); the batch's ``critic/*`` metrics."""
        batches = self._micro_batches(shard)
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        outputs = self._schedule(batches, forward_only=False, clip=clip)
        totals = dp_sums(outputs, SUMMED, self.pgc.dp)
        update_ok, grad_norm, _ = self.optimizer.step()
        if not update_ok:
            raise RuntimeError(f"critic step {self.step}: optimizer skipped the update")
        self.step += 1
        return {
            "critic/value_loss": totals["loss_sum"] / max(totals["count"], 1.0),
            "critic/clip_fraction": totals["value_clipped"] / max(totals["tokens"], 1.0),
            "critic/grad_norm": float(grad_norm or 0.0),
        }

    @property
    def file_name(self) -> str:
        return f"critic_tp{self.pgc.tp.rank()}_pp{self.pgc.pp.rank()}.pt"

    def save(self, directory: Path) -> str | None:
        """Write the value model and its optimizer (the first DP rank of each TP rank: the
        others hold the same). Returns the file written, if any."""
        if self.pgc.dp.rank() != 0:
            return None
        state = {
            "model": self.model.module.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "step": self.step,
        }
        return save_durably(state, directory / self.file_name)

    def load(self, directory: Path) -> int:
        """Restore the value model and its optimizer from ``directory``; returns its steps."""
        path = directory / self.file_name
        if not path.is_file():
            raise FileNotFoundError(
                f"{path} is missing: the checkpoint was saved without a critic, or with another "
                f"{self.tp_field} (resume with the critic section and sizes it was saved with)"
            )
        # mapped from the file, not read into host memory (every rank of a node loads at once);
        # the model's tensors reach the device only as the copies into their live places, the
        # Adam state whole (kept_on) before load_state_dict takes it as the live state
        state = torch.load(path, map_location="cpu", weights_only=False, mmap=True)
        self.model.module.load_state_dict(state["model"])  # copies into the live parameters
        self.optimizer.load_state_dict(kept_on(state.pop("optimizer"), self.torch_device))
        self.step = int(state["step"])
        return self.step

    def _micro_batches(self, shard: TokenBatch) -> list[dict[str, torch.Tensor]]:
        section, micro = self.section, self.section.sequences_per_micro_batch
        if len(shard) % micro:
            raise ValueError(
                f"a data-parallel shard of {len(shard)} sequences does not split into "
                f"critic micro-batches of {micro}"
            )
        groups = micro_batches.group_sequences(
            [len(t) - 1 for t in shard.tokens],
            micro_batch_size=micro,
            max_tokens=section.max_tokens_per_micro_batch,
            packed=section.pack_sequences,
        )
        built = micro_batches.build(shard, groups, packed=section.pack_sequences, cp=(0, 1))
        return [{k: v.to(self.torch_device) for k, v in b.items()} for b in built]

    def _schedule(
        self, batches: list[dict[str, torch.Tensor]], forward_only: bool, clip: float | None
    ) -> list[dict[str, Any]]:
        """Megatron's forward(-backward) schedule over the micro-batches (one pipeline stage)."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        micro, seq = batches[0]["inputs"].shape
        return get_forward_backward_func(pp_size=1, vp_size=None)(
            forward_step_func=functools.partial(
                value_step, train=not forward_only, clip=clip, cp=self.pgc.cp
            ),
            data_iterator=iter(batches),
            model=[self.model],
            num_microbatches=len(batches),
            seq_length=seq,
            micro_batch_size=micro,
            forward_only=forward_only,
            pg_collection=self.pgc,
        )


def value_step(
    data_iterator: Any, model: Any, train: bool, clip: float | None, cp: Any
) -> tuple[Any, Any]:
    """One micro-batch through the value model: its per-token values, and when training the
    clipped value loss against the returns (``weights``) and old values (``old_logprobs``)."""
    batch = next(data_iterator)
    output = model(*step_inputs(batch))  # no labels: the head's [batch, tokens, 1]

    def loss_fn(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
        per_token = loss_layout(values.squeeze(-1).float(), batch, cp)
        mask = batch["mask"]
        if train:
            loss_sum, count, sums = value_loss(
                per_token, batch["old_logprobs"], batch["weights"], mask, clip
            )
        else:  # scoring: Megatron still wants a loss and a count
            loss_sum, count, sums = per_token.sum() * 0.0, mask.sum(), {"tokens": mask.sum()}
        report = {"loss_sum": loss_sum.detach().clone(), "count": count.detach().clone()}
        report.update(sums, values=per_token.detach())
        return loss_sum, count.round().int(), report

    return output, loss_fn


SUMMED = ("loss_sum", "count", "tokens", "value_clipped")  # a train step's sums
