"""Every tensor a train step builds per micro-batch (the loss's layout of a packed row, the
loss's intermediates) is created on the device of the model's inputs, never on the default
device: on a GPU a CPU tensor there fails the step or silently moves data every micro-batch.

The batch is put on the ``meta`` device: any tensor made elsewhere shows as a device mismatch.
"""

from __future__ import annotations

import itertools

import torch
from torch.overrides import TorchFunctionMode

from relax_launch.trainer import micro_batches
from relax_launch.trainer.batch import TokenBatch
from relax_launch.trainer.forward import loss_layout, micro_batch_loss, step_inputs
from relax_launch.trainer.losses import LossSpec


class DevicesSeen(TorchFunctionMode):
    """The devices of every tensor any torch function returns while active."""

    def __init__(self) -> None:
        super().__init__()
        self.devices: set[str] = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        for item in result if isinstance(result, tuple) else (result,):
            if isinstance(item, torch.Tensor):
                self.devices.add(item.device.type)
        return result


class NoContextParallelism:
    def size(self) -> int:
        return 1


def meta_batch(old_logprobs: bool, packed: bool) -> dict[str, torch.Tensor]:
    tokens = ((1, 5, 9, 3), (1, 7, 2))
    batch = TokenBatch(
        tokens,
        tuple(tuple(float(j > 0) for j in range(len(t))) for t in tokens),
        tuple(tuple(0.5 for _ in t) for t in tokens),
        tuple(tuple(-1.0 for _ in t) for t in tokens) if old_logprobs else None,
    )
    (built,) = micro_batches.build(batch, [[0, 1]], packed=packed)
    return {k: v.to("meta") for k, v in built.items()}


def test_step_inputs_and_losses_stay_on_the_batchs_device():
    for old_logprobs, packed in itertools.product((True, False), (True, False)):
        batch = meta_batch(old_logprobs, packed)
        if old_logprobs:
            batch["ref_logprobs"] = torch.empty_like(batch["old_logprobs"])
        output = torch.empty(batch["inputs"].shape, device="meta", requires_grad=True)
        with DevicesSeen() as seen:
            inputs = step_inputs(batch)
            logprobs = -loss_layout(output, batch, NoContextParallelism())
            loss_sum, count, sums = micro_batch_loss(batch, logprobs, LossSpec(kl_coef=0.1))
        assert logprobs.shape == batch["mask"].shape
        assert seen.devices == {"meta"}, seen.devices
        tensors = [t for t in (*inputs, loss_sum, count, *sums.values()) if t is not None]
        assert {t.device.type for t in tensors} == {"meta"}
