"""Rank 0 collecting the critic's posted steps (``CriticClient.finish_training``): a step that
fails to answer still lets every later step be collected and its shard transfer finished, so
no send is left pending (on NCCL a pending send blocks the process group's teardown)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from relax_launch.runtime.critic_worker import CriticClient


def test_a_failed_step_still_collects_and_finishes_the_later_ones() -> None:
    collected, finished = [], []

    def collect(posted, local):
        collected.append(posted.name)
        if posted.name == "step 1":
            raise TimeoutError("critic rank 2 did not answer step 1")
        return {0: {"critic/value_loss": 0.1}}

    client = object.__new__(CriticClient)
    client.channel = SimpleNamespace(collect=collect)
    client.local = {}
    client.shards = SimpleNamespace(finish=finished.append)
    client._last_stage_rank = lambda: 0
    route = SimpleNamespace(route="critic_train")
    started = [(SimpleNamespace(name=f"step {k}", command=route), f"shards {k}") for k in (1, 2, 3)]
    with pytest.raises(TimeoutError, match="step 1"):
        client.finish_training(started)
    assert collected == ["step 1", "step 2", "step 3"]
    assert finished == ["shards 2", "shards 3"]  # not step 1's: its rank did not answer
