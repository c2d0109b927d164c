"""Platform: every CPU/GPU difference, in one place. Nothing else names a device or backend.

``device`` is ``cluster.device``: ``cuda`` (NCCL, GPU SGLang) or ``cpu`` (gloo, SGLang's CPU
engine with import stand-ins, Megatron-core with its CUDA calls redirected).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from relax_launch.deadline import wait_until

if TYPE_CHECKING:
    import torch

Device = Literal["cpu", "cuda"]
STAND_INS_DIR = Path(__file__).parent / "stand_ins"
# Where the CPU memory saver stand-in writes static weights' backups (its BACKUP_DIR_ENV).
MEMORY_SAVER_DIR_ENV = "RELAX_MEMORY_SAVER_DIR"


def dist_backend(device: Device) -> str:
    """torch.distributed backend for collectives among ranks on ``device``."""
    return "gloo" if device == "cpu" else "nccl"


def weight_sync_backend(device: Device) -> str:
    """Backend of the weight sync's broadcast groups: NCCL on GPUs; on the CPU gloo behind
    NCCL's waits and aborts (``nccl_semantics``), so a wait that is wrong under NCCL fails here
    too. Registers it in this process."""
    if device != "cpu":
        return "nccl"
    from relax_launch.platform.nccl_semantics import register

    return register()


def engine_pads_for_tp(device: Device) -> bool:
    """Whether SGLang's engine on ``device`` pads intermediate sizes to a multiple of 32 per TP
    rank, and attention heads TP does not divide: its CPU engine does
    (``adjust_config_with_unaligned_cpu_tp``), its GPU engine does not."""
    return device == "cpu"


def sync_bucketing(device: Device) -> tuple[int, int]:
    """The weight sync's buckets (``receiver.broadcast_plan``): tensors under the first size, in
    bytes, travel together in broadcasts of about the second. Below about 1 MiB a gloo
    broadcast costs its fixed 0.35 ms more than its bytes; NCCL's fixed cost (launch, latency:
    tens of microseconds) matches its transfer at several MB over NVLink, and a GPU copies a
    bucket out at a TB/s."""
    return (1 << 20, 32 << 20) if device == "cpu" else (8 << 20, 64 << 20)


def torch_device(device: Device, local_rank: int = 0) -> str:
    """The torch device string of one rank."""
    return "cpu" if device == "cpu" else f"cuda:{local_rank}"


def device_memory_bytes(device: Device, local_rank: int) -> float | None:
    """Total memory of this rank's GPU; None on the CPU (its share of the host is planned)."""
    if device == "cpu":
        return None
    import torch

    return float(torch.cuda.get_device_properties(local_rank).total_memory)


def sglang_env(device: Device, base: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for an SGLang process (server or Engine) on ``device``."""
    env = dict(os.environ if base is None else base)
    env["HF_HUB_OFFLINE"] = "1"
    # Set by torchrun for its ranks' default group; SGLang's own process group would otherwise
    # wait forever for the agent's store (engines may start before the rank's group exists).
    env.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    if device == "cpu":
        env["SGLANG_USE_CPU_ENGINE"] = "1"
        paths = [str(STAND_INS_DIR), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
        env["PYTHONPATH"] = os.pathsep.join(paths)
    return env


def sglang_server_module(device: Device) -> str:
    """The module an SGLang server runs as (``python -m``): on the CPU, SGLang's own with its
    subprocesses forked (``forked_sglang``: 2.5x fewer core-seconds to come up)."""
    return "relax_launch.platform.forked_sglang" if device == "cpu" else "sglang.launch_server"


def sglang_server_args(device: Device) -> list[str]:
    """SGLang server flags that depend only on the device."""
    if device == "cpu":
        return [
            "--device",
            "cpu",
            "--attention-backend",
            "torch_native",
            "--disable-cuda-graph",
            "--skip-server-warmup",
            # An idle scheduler otherwise busy-polls a whole core; on a 2-core host that starves
            # the trainer and the other engines.
            "--sleep-on-idle",
        ]
    return []


def disaggregation_server_args(device: Device, half: str | None) -> list[str]:
    """SGLang flags a prefill/decode half needs on ``device``: on the CPU a decode engine keeps
    the KV of a request it retracts in plain tensors (its default, a pinned host pool, registers
    memory with CUDA)."""
    if device == "cpu" and half == "decode":
        return ["--disaggregation-decode-retraction-backup", "cpu_tensor"]
    return []


# set in a CPU prefill engine's environment: its plugin applies ``prefill_without_accelerator``
PREFILL_ON_CPU_ENV = "RELAX_PREFILL_ON_CPU"


def disaggregation_env(device: Device, half: str | None) -> dict[str, str]:
    """The KV transfer's transport: Mooncake over TCP on the CPU (no RDMA devices there), its
    own choice (RDMA) on GPUs. A CPU prefill engine sends a cached prefix's KV with the rest of
    the prompt's, not early (the early send waits on a CUDA event), and takes the stand-in of
    ``prefill_without_accelerator``."""
    if device != "cpu" or half is None:
        return {}
    env = {"MOONCAKE_PROTOCOL": "tcp"}
    if half == "prefill":
        env |= {"SGLANG_DISAGG_PREFILL_EARLY_SEND_CACHED_PREFIX": "0", PREFILL_ON_CPU_ENV: "1"}
    return env


def bind_device(device: Device, local_rank: int) -> None:
    """Call first, before torch.distributed or any allocation: on GPUs each rank owns the GPU of
    its local rank (NCCL communicators and CUDA tensors are then created there, not on GPU 0)."""
    if device == "cuda":
        import torch

        torch.cuda.set_device(local_rank)


def prepare_megatron(device: Device, seed: int = 0, tp_rank: int = 0) -> None:
    """Call before building Megatron-core objects: seeds Megatron's model-parallel RNG states on
    GPUs (its layers fork them: the same stream across data parallelism, one per TP rank), and
    redirects its CUDA calls on the CPU."""
    if device == "cuda":
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(seed, tp_rank=tp_rank, ep_rank=0, etp_rank=tp_rank)
    else:
        import sys

        from megatron.core.jit import disable_jit_fuser
        from megatron.core.tensor_parallel.random import initialize_rng_tracker

        from relax_launch.platform.cpu import redirect_megatron_to_cpu

        # Megatron wraps small fused functions (the vocab-parallel cross entropy's) in
        # torch.compile when they are imported. On the CPU inductor compiles C++ at the first
        # call and again for new sequence lengths: 10-25 s of a job's first steps, for kernels
        # that gain nothing here. Plain functions from the next import on.
        disable_jit_fuser()
        if "megatron.core.fusions.fused_cross_entropy" in sys.modules:
            raise RuntimeError("prepare_megatron must run before Megatron's model code is imported")
        redirect_megatron_to_cpu()
        # No CUDA RNG states to fork: dropout draws from the CPU generator.
        initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)


def node_cores() -> int:
    """The cores this process may run on (its affinity: a Slurm or container allotment)."""
    return len(os.sched_getaffinity(0))


def thread_env(
    device: Device, threads: int, ranks: int = 1, engine_ranks: int = 1
) -> dict[str, str]:
    """Environment giving an SGLang server ``threads`` compute threads on the CPU (torchrun
    sets OMP_NUM_THREADS=1 for its ranks, and the engines would inherit it); none on GPUs.

    An engine of more than one rank (``engine_ranks``, on any node) must tell SGLang's CPU
    engine the cores of each of its ``ranks`` on this node: the ``threads`` are split between
    them, wrapping over the node's cores."""
    if device != "cpu":
        return {}
    env = {"OMP_NUM_THREADS": str(threads)}
    if engine_ranks > 1:
        per_rank, cores = max(1, threads // ranks), node_cores()
        ids = [sorted({(r * per_rank + i) % cores for i in range(per_rank)}) for r in range(ranks)]
        env["SGLANG_CPU_OMP_THREADS_BIND"] = "|".join(_core_ranges(c) for c in ids)
    return env


def _core_ranges(cores: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2,5" (the form SGLang's CPU kernels parse)."""
    runs: list[list[int]] = []
    for core in cores:
        if runs and core == runs[-1][1] + 1:
            runs[-1][1] = core
        else:
            runs.append([core, core])
    return ",".join(f"{a}-{b}" if b > a else str(a) for a, b in runs)


def use_threads(device: Device, threads: int) -> None:
    """This process's compute threads on the CPU (the trainer's, for its forward and backward
    passes); GPUs compute on their own."""
    if device == "cpu":
        import torch

        torch.set_num_threads(threads)


def engine_base_device(device: Device, local_rank: int) -> int:
    """SGLang's base_gpu_id for an engine whose head has ``local_rank``.

    On the CPU SGLang reads it as a NUMA node index, and this machine kind has one node.
    """
    return local_rank if device == "cuda" else 0


def host_buffer(like: torch.Tensor) -> torch.Tensor:
    """A host tensor shaped like ``like`` to copy it into: pinned when ``like`` is on a GPU (so
    the copy runs asynchronously), plain host memory on the CPU."""
    import torch

    return torch.empty(like.shape, dtype=like.dtype, pin_memory=like.device.type == "cuda")


def current_device() -> torch.device:
    """This process's device: its bound GPU (``bind_device``) where there is one, else the CPU."""
    import torch

    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def synchronize(device: torch.device) -> None:
    """Wait for copies issued on ``device`` (a no-op on the CPU, where copies are synchronous)."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def wait_sent(
    works: list, device: torch.device, timeout_s: float, check: Callable[[], object]
) -> bool:
    """Wait until these sends (torch.distributed works) have completed, so the device copies
    they send from are free before the next are made; False if they have not within
    ``timeout_s``. ``check`` runs between short sleeps and raises to give up (the receiver
    failed, so never receives). NCCL's ``is_completed`` says when a send ended on its stream
    (after the copy it sends, made before it on the current stream); its ``wait`` then lets
    the tensor go. Gloo's stays False until ``wait``, which blocks (and a timed ``wait`` closes
    the connection): a thread waits there."""
    nccl = device.type == "cuda"
    waiting = None if nccl else _WaitThread(works)

    def ended() -> bool:
        check()
        return all(work.is_completed() for work in works) if waiting is None else waiting()

    if not wait_until(ended, timeout_s, interval_s=0.001, max_interval_s=0.02):
        return False
    if nccl:
        for work in works:
            work.wait()  # raises the send's error; drops the tensor NCCL stashed for it
    return True


class _WaitThread:
    """``works`` waited one after another in a thread of their own; called: whether they all
    completed (raising a wait's error). Given up on, it waits until the group's timeout or
    teardown ends the sends."""

    def __init__(self, works: list) -> None:
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._wait, args=(works,), daemon=True)
        self.thread.start()

    def _wait(self, works: list) -> None:
        try:
            for work in works:
                work.wait()
        except BaseException as exc:  # noqa: BLE001 - raised in the waiting caller's thread
            self.error = exc

    def __call__(self) -> bool:
        done = not self.thread.is_alive()
        if self.error is not None:
            raise self.error
        return done


def release_cached_memory(device: torch.device) -> None:
    """Hand memory freed on ``device`` back to the system, so a colocated process can take it:
    the CUDA caching allocator keeps freed blocks otherwise; the CPU allocator returns them."""
    import torch

    if device.type == "cuda":
        torch.cuda.empty_cache()


def pinned_memory_without_accelerator() -> None:
    """In a process without a GPU, ``pin_memory`` means ordinary memory instead of an error
    (``cpu.pinned_memory_is_ordinary``); with one, nothing changes."""
    import torch

    if not torch.cuda.is_available():
        from relax_launch.platform.cpu import pinned_memory_is_ordinary

        pinned_memory_is_ordinary()


def moe_engine_without_accelerator() -> None:
    """In an SGLang engine without a GPU, torch versions of what its MoE models call on GPUs
    only: Qwen2-MoE's shared-expert gate (a Triton kernel) and the registration of the host
    cache that returns routed experts (cudaHostRegister). SGLang plugin part; with a GPU,
    nothing changes."""
    import torch

    if torch.cuda.is_available():
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from relax_launch.platform import cpu

    replaced = {
        "sglang.srt.models.qwen2_moe.fused_gate_sigmoid_mul_add": cpu.gated_shared_expert_add,
        "sglang.srt.models.qwen2_moe.fused_gate_sigmoid_mul": cpu.gated_shared_expert,
        "sglang.srt.mem_cache.pool_host.common._cuda_host_register": cpu.no_host_register,
    }
    for target, function in replaced.items():
        HookRegistry.register(target, function, HookType.REPLACE)


def prefill_without_accelerator() -> None:
    """In a CPU prefill engine (``PREFILL_ON_CPU_ENV``), Mooncake's KV sender computes the pages
    to send on the host, where they already are: its other path copies them to pinned memory
    and waits on a CUDA event. SGLang plugin part; elsewhere, nothing changes."""
    if os.environ.get(PREFILL_ON_CPU_ENV) != "1":
        return
    from sglang.srt.disaggregation.mooncake.conn import MooncakeKVSender
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    class HostIndexKVSender(MooncakeKVSender):
        supports_host_tensor_indices = False

    HostIndexKVSender.__name__ = MooncakeKVSender.__name__
    HookRegistry.register(
        "sglang.srt.disaggregation.mooncake.conn.MooncakeKVSender",
        HostIndexKVSender,
        HookType.REPLACE,
    )


def lora_backend(device: Device) -> str:
    """SGLang's LoRA kernels for an engine on ``device``: its own default (Triton kernels) on a
    GPU, plain torch on the CPU (the only backend without Triton)."""
    return "torch_native" if device == "cpu" else "csgmv"
