"""torchrun worker: a Megatron-core GPT trained for a few steps with TP over gloo on the CPU.

Uses Megatron's real DDP wrapper, optimizer factory and forward-backward schedule. Rank 0
prints one JSON line with the losses and the tensor-parallel shapes it saw.
"""

import json
import os
import sys

import torch
import torch.distributed as dist

from relax_launch import platform


def main() -> None:
    tp_size = int(sys.argv[1])
    dist.init_process_group(platform.dist_backend("cpu"))
    platform.prepare_megatron("cpu")
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer import TransformerConfig

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp_size)
    torch.manual_seed(0)
    config = TransformerConfig(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        use_cpu_initialization=True,
        pipeline_dtype=torch.float32,
        params_dtype=torch.float32,
    )
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=128,
        max_sequence_length=32,
    )
    model = DistributedDataParallel(
        config=config,
        ddp_config=DistributedDataParallelConfig(
            overlap_grad_reduce=False, use_distributed_optimizer=False
        ),
        module=model,
    )
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=3e-3,
            bf16=False,
            fp16=False,
            use_distributed_optimizer=False,
            clip_grad=0.0,
        ),
        [model],
    )
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 128, (4, 32), generator=generator)
    position_ids = torch.arange(32).unsqueeze(0).expand(4, -1)
    mask = torch.tril(torch.ones(32, 32, dtype=torch.bool)).logical_not()[None, None]

    def forward_step(data_iterator, model):
        output = model(
            tokens[:, :-1], position_ids[:, :-1], mask[..., :-1, :-1], labels=tokens[:, 1:]
        )

        def loss_fn(output_tensor):
            loss = output_tensor.float().mean()
            return loss, {"loss": loss.detach()}

        return output, loss_fn

    losses = []
    forward_backward = get_forward_backward_func()
    for _ in range(5):
        model.zero_grad_buffer()
        optimizer.zero_grad()
        result = forward_backward(
            forward_step_func=forward_step,
            data_iterator=iter([None]),
            model=[model],
            num_microbatches=1,
            seq_length=31,
            micro_batch_size=4,
            forward_only=False,
        )
        update_ok, _, _ = optimizer.step()
        assert update_ok, "optimizer step skipped"
        losses.append(float(result[0]["loss"]))
    logits = model.module(tokens[:, :-1], position_ids[:, :-1], mask[..., :-1, :-1])
    local_params = sum(p.numel() for p in model.parameters())
    if dist.get_rank() == 0:
        print(
            json.dumps(
                {
                    "losses": losses,
                    "tp_size": parallel_state.get_tensor_model_parallel_world_size(),
                    "local_vocab": logits.shape[-1],
                    "local_params": local_params,
                    "world": dist.get_world_size(),
                    "pid": os.getpid(),
                }
            ),
            flush=True,
        )
    # Megatron's module globals hold its groups: drop them before torch destroys the world, so
    # no group outlives it into interpreter teardown (a gloo group freed there can abort)
    dist.barrier()
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
