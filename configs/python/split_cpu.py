"""placement.mode=split on the CPU (configs/split_cpu.yaml) with the Python API: the trainer on
every rank, each engine on one of them, and a GenRM judge."""

from base import arithmetic, cpu, cpu_engines, quickstart, rewards, trainer

from relax_launch.config import GenRMConfig, PlacementConfig

config = quickstart(
    "split-cpu",
    cluster=cpu(3),
    placement=PlacementConfig(mode="split"),
    trainer=trainer(micro_batch_size=2),  # on every rank
    genrm=cpu_engines(GenRMConfig),
    data=arithmetic(prompts_per_step=3),
    reward=rewards(judge=True, fallback=0.0),
)
