"""The staggered start's waves and its barrier (the start-up itself runs in
tests/rl/test_colocated_job.py, split in the default run, defer under ``slow``)."""

from __future__ import annotations

import threading
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from relax_launch.config import load_config
from relax_launch.inference.process import free_port
from relax_launch.placement import plan
from relax_launch.runtime.staggered_start import wait_for_every_rank, waves

REPO = Path(__file__).resolve().parents[2]


def test_defer_starts_one_role_per_wave_in_phase_order_and_split_all_at_once():
    defer = plan(load_config(REPO / "configs" / "defer_8gpu.yaml"))
    assert waves(defer) == [("rollout",), ("teacher",), ("genrm",)]
    split = plan(load_config(REPO / "configs" / "split_8gpu.yaml"))
    assert waves(split) == [("rollout", "genrm", "teacher")]


@pytest.mark.parametrize(
    "config,device,staggered",
    [
        ("defer_8gpu.yaml", "cuda", True),
        ("defer_cpu.yaml", "cpu", False),
        ("split_cpu.yaml", "cpu", False),
        ("quickstart_cpu.yaml", "cpu", False),
        ("qwen3_8b_decoupled_2x8.yaml", "cuda", False),
    ],
)
def test_auto_staggers_colocated_gpu_jobs_only(config, device, staggered):
    job = load_config(REPO / "configs" / config)
    assert job.cluster.device == device and job.starts_staggered is staggered
    if not staggered and job.placement.mode != "decoupled":
        forced = load_config(REPO / "configs" / config, ["placement.staggered_start=true"])
        assert forced.starts_staggered


def test_the_barrier_waits_for_every_rank_and_names_the_ones_missing():
    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, 3, is_master=True, wait_for_workers=False)
    clients = [dist.TCPStore("127.0.0.1", port, 3, is_master=False) for _ in range(2)]
    for store in (server, *clients):
        store.set_timeout(timedelta(seconds=30))
    stores = [server, *clients]
    done = []
    threads = [
        threading.Thread(
            target=lambda r=r: done.append(wait_for_every_rank(stores[r], "w", r, 3, 20, "x"))
        )
        for r in (1, 2)
    ]
    for thread in threads:
        thread.start()
    wait_for_every_rank(server, "w", 0, 3, 20, "x")
    for thread in threads:
        thread.join(timeout=30)
    assert len(done) == 2
    with pytest.raises(TimeoutError, match=r"ranks \[1, 2\] did not report the engines to park"):
        wait_for_every_rank(server, "v", 0, 3, 1.5, "the engines to park")
