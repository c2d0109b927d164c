"""One device's memory: how much the plan may use (``cluster.device_memory_gb``, the GPU's own,
or the host's share per rank on the CPU), and the check each GPU rank makes against it."""

from __future__ import annotations

import functools
import shutil
import subprocess
from typing import TYPE_CHECKING

from relax_launch.config.errors import ConfigError

if TYPE_CHECKING:
    from relax_launch.config.job import JobConfig
    from relax_launch.placement.plan import PlacementPlan

GB = 1e9
# an 80 GB H100 as CUDA and nvidia-smi report it (81559 MiB)
ASSUMED_GPU_GB = 81559 * 1024**2 / GB


def device_capacity(job: JobConfig) -> tuple[float, str]:
    """Bytes of one device and where the figure comes from."""
    if job.cluster.device_memory_gb is not None:
        return job.cluster.device_memory_gb * GB, "cluster.device_memory_gb"
    if job.cluster.device == "cpu":
        import psutil

        share = psutil.virtual_memory().total / job.cluster.nproc_per_node
        return share, f"this host's memory / {job.cluster.nproc_per_node} ranks"
    found = _nvidia_smi_bytes()
    if found:
        return found, "nvidia-smi on this machine"
    return ASSUMED_GPU_GB * GB, "assumed: an 80 GB H100 (set cluster.device_memory_gb)"


@functools.cache  # preflight, launch and each engine worker plan memory: ask the GPU once
def _nvidia_smi_bytes() -> float | None:
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.split()
    except (OSError, subprocess.SubprocessError):
        return None
    return min(float(mib) for mib in out) * 1024**2 if out else None


def check_device(job: JobConfig, plan: PlacementPlan, found: float | None, rank: int) -> None:
    """Refuse to start on a device smaller than the one the plan was made for (``found``: the
    device's bytes, None on the CPU)."""
    if found is None:
        return
    capacity, source = device_capacity(job)
    if found < capacity * 0.99:
        raise ConfigError(
            f"rank {rank}: its GPU has {found / GB:.1f} GB but the memory plan is for "
            f"{capacity / GB:.1f} GB ({source}): set cluster.device_memory_gb={found / GB:.1f} "
            "and check the plan (relax-launch plan CONFIG), or run on the GPUs it was made for.",
            ("cluster.device_memory_gb",),
        )
