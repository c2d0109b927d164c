"""torchrun worker (two ranks): Megatron's optimizer factory sizes and gathers its parameter
groups over the trainer's group, while the rest of the process keeps the default world.

Rank 0 alone is "the trainer" (a group of one); rank 1 stands for an inference rank that never
joins the factory's gather. Rank 0 runs Megatron's own ``_get_param_groups`` inside
``model.optimizer_factory_world`` and prints one JSON line: the world size the process saw
there, and what the factory's module saw.
"""

import json

import torch
import torch.distributed as dist
from megatron.core import optimizer as factory
from megatron.core.optimizer import OptimizerConfig

from relax_launch.trainer.model import optimizer_factory_world

dist.init_process_group("gloo")
trainer = dist.new_group([0])  # every rank creates every group, members or not
if dist.get_rank() == 0:
    layers = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    with optimizer_factory_world(trainer):
        process_world = dist.get_world_size()
        factory_world = factory.torch.distributed.get_world_size()
        groups = factory._get_param_groups([layers], OptimizerConfig(lr=1e-3), None)
    report = {
        "process_world": process_world,
        "factory_world": factory_world,
        "param_groups": len(groups),
        "restored": factory.torch is torch,
    }
    print(json.dumps(report), flush=True)
dist.barrier()
dist.destroy_process_group()
