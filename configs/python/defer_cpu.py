"""placement.mode=defer on the CPU (configs/defer_cpu.yaml) with the Python API: every role on
the same 2 ranks, taking turns, and a GenRM judge."""

from base import cpu, cpu_engines, quickstart, rewards, trainer

from relax_launch.config import GenRMConfig, PlacementConfig, RolloutConfig

config = quickstart(
    "defer-cpu",
    cluster=cpu(2),
    placement=PlacementConfig(mode="defer"),
    trainer=trainer(),  # on every rank
    rollout=cpu_engines(RolloutConfig, model=None, ranks=2),
    genrm=cpu_engines(GenRMConfig),
    reward=rewards(judge=True, fallback=0.0),
)
