"""How an SGLang server's CPU threads are given: one count for a one-rank engine, and each
local TP rank's cores for an engine of several ranks (SGLang's CPU engine refuses to start
otherwise on a one-NUMA-node host)."""

from __future__ import annotations

import pytest

from relax_launch import platform


def test_a_one_rank_engine_gets_a_thread_count_only():
    assert platform.thread_env("cpu", 3) == {"OMP_NUM_THREADS": "3"}
    assert platform.thread_env("cuda", 3, 2, 2) == {}


@pytest.mark.parametrize(
    ("threads", "ranks", "engine_ranks", "cores", "bind"),
    [
        (4, 2, 2, 4, "0-1|2-3"),  # TP 2 on one node: the engine's cores split
        (2, 1, 2, 2, "0-1"),  # TP 2 over two nodes: this node's one rank takes them all
        (1, 2, 2, 2, "0|1"),  # fewer threads than ranks: still a core each
        (4, 4, 4, 2, "0|1|0|1"),  # more ranks than cores: wrapped over the node's cores
    ],
)
def test_an_engine_of_several_ranks_binds_each_local_rank(
    monkeypatch, threads, ranks, engine_ranks, cores, bind
):
    monkeypatch.setattr(platform, "node_cores", lambda: cores)
    env = platform.thread_env("cpu", threads, ranks, engine_ranks)
    assert env == {"OMP_NUM_THREADS": str(threads), "SGLANG_CPU_OMP_THREADS_BIND": bind}
