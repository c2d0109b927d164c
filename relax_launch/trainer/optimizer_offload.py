"""``trainer.optimizer_offload``: Megatron-core's optimizer CPU offload, on this stack.

Megatron's ``HybridDeviceOptimizer`` inside its distributed optimizer: every master weight and
Adam state of this rank's shard lives in host memory (offload fraction 1.0) and torch's AdamW
steps them there. Each step copies the gradient shards to the host, and the updated weights
back into DDP's param buffer, which the distributed optimizer then all-gathers.

Megatron-core 0.16.1 assumes what this stack does not have, so some of its steps are amended:

- Transformer Engine: the offload runs through the precision-aware optimizer's path (master
  weights held by the optimizer alone, gradients handed over as ``decoupled_grad``), whose
  config validation reads TE's version, a TypeError without TE, though the offload does not use
  it. The fields are set after validation, to what ``__post_init__`` sets without TE.
- 16-bit parameters only. The distributed optimizer hands fp32 parameters' shards (the norms of
  a bf16 model, which stay fp32 here, and all of an fp32 model) over as views autograd tracks,
  which a new torch optimizer refuses ("can't optimize a non-leaf Tensor"): they are handed over
  detached (the same memory). And loading a state looks each master weight up among the fp32
  copies of 16-bit parameters (a KeyError for an fp32 one): an fp32 one is restored into its
  host copy.
- Loading the per-rank checkpoint form (``dp_reshardable``, ``trainer/sharded_optimizer.py``)
  puts the loaded tensors in the optimizer's state but, unlike Megatron's other loaders, never
  hands them to the host optimizers, which would step on from their old weights: it does. The
  load also first steps a fresh optimizer once on random gradients to create its state
  (``dummy_step``), which writes this rank's shard of the parameters: the loaded master weights
  are copied back into them, as a step does.
"""

from __future__ import annotations

from typing import Any


def offload_optimizer(config: Any) -> None:
    """Turn Megatron's optimizer CPU offload on in OptimizerConfig ``config`` (which must have
    ``use_distributed_optimizer``)."""
    config.optimizer_cpu_offload = True
    config.optimizer_offload_fraction = 1.0
    config.use_precision_aware_optimizer = True
    config.use_precision_aware_optimizer_no_fp8_or_ds_fp8 = True
    config.store_param_remainders = False  # fp32 master weights, not TE's 16-bit remainders
    _amend_megatron()


def _amend_megatron() -> None:
    """The amendments of the module docstring; they act only on an offloaded optimizer.
    Idempotent."""
    from megatron.core.optimizer.cpu_offloading.hybrid_optimizer import HybridDeviceOptimizer
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    if HybridDeviceOptimizer._update_fp32_params_by_new_state is _restore_master_weights:
        return

    build = DistributedOptimizer._build_model_and_main_param_groups.__func__
    load = DistributedOptimizer.load_parameter_state_from_dp_reshardable

    def build_detached(cls: Any, gbuf_ranges: Any, gbuf_map: Any, ranges: Any, config: Any) -> Any:
        groups = build(cls, gbuf_ranges, gbuf_map, ranges, config)
        if config.optimizer_cpu_offload:
            for group_range, shards in zip(ranges, groups[3], strict=True):  # fp32 shards
                detached = {id(shard): _detached(shard) for shard in shards}
                shards[:] = [detached[id(shard)] for shard in shards]
                params = group_range["orig_group"]["params"]
                params[:] = [detached.get(id(param), param) for param in params]
        return groups

    def load_and_hand_over(self: Any, state_dict: Any) -> None:
        load(self, state_dict)
        if isinstance(self.optimizer, HybridDeviceOptimizer):
            self.optimizer._sync_hdo_state_to_sub_optimizers()
            for host, param in self.optimizer.cpu_copys_map_gpu_param.items():
                param.data.copy_(host.data)  # undoes the load's dummy step (module docstring)

    DistributedOptimizer._build_model_and_main_param_groups = classmethod(build_detached)
    DistributedOptimizer.load_parameter_state_from_dp_reshardable = load_and_hand_over
    HybridDeviceOptimizer._update_fp32_params_by_new_state = _restore_master_weights


def _detached(shard: Any) -> Any:
    """``shard`` detached, with the attributes Megatron set on it (tensor parallelism, sharing),
    which the gradient norm reads."""
    leaf = shard.detach()
    leaf.__dict__.update(shard.__dict__)
    return leaf


def _restore_master_weights(self: Any) -> None:
    """``HybridDeviceOptimizer._update_fp32_params_by_new_state`` for fp32 parameters too: the
    loaded master weight goes into the fp32 copy of a 16-bit parameter, else into the host copy
    the optimizer steps."""
    if not self.param_update_in_fp32:
        return
    for param, state in self.state.items():
        master = self.param_to_fp32_param.get(param, self.param_to_inner_param.get(param, param))
        master.data.copy_(state["master_param"])
